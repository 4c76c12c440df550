"""Model artifacts: safetensors, ``torch.save`` files and Hugging Face zip bundles.

``prepare_model_artifact`` turns whatever was downloaded into the one canonical
``model.safetensors`` (with a safely extracted bundle beside it); ``load_state_file``
and ``materialize_model`` are what tenant code calls to get a module back.
"""

from executor.artifacts._bundle import checkpoint_state
from executor.artifacts._formats import (
    BUNDLE_DIRNAME,
    MODEL_FILENAME,
    ModelArtifact,
    detect_format,
    load_state_file,
    materialize_model,
    model_suffix,
    prepare_model_artifact,
)

__all__ = [
    "BUNDLE_DIRNAME",
    "MODEL_FILENAME",
    "ModelArtifact",
    "checkpoint_state",
    "detect_format",
    "load_state_file",
    "materialize_model",
    "model_suffix",
    "prepare_model_artifact",
]
