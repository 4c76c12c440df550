"""Model artifacts: safetensors, ``torch.save`` files and Hugging Face zip bundles.

``prepare_model_artifact`` turns whatever was downloaded into the one canonical
``model.safetensors`` (with a safely extracted bundle beside it), and ``model_head`` checks
a download's first bytes before the rest is written; ``load_state_file``
and ``materialize_model`` are what tenant code calls to get a module back, and
``checkpoint_state`` maps a module's state back to the file's key names.

Inside, data flows down: ``_materialize`` (building timm / torchvision / Hugging Face
modules from a state dict) → ``_formats`` (format detection, the canonical model file,
weights-only torch loading) → ``_bundle`` (staging, weight consolidation and commit of a
bundle) → ``_extract`` (safe extraction of a hostile zip, bounded JSON).
"""

from executor.artifacts._formats import (
    BUNDLE_DIRNAME,
    MODEL_FILENAME,
    SAFETENSORS,
    ModelArtifact,
    detect_format,
    load_state_file,
    model_head,
    model_suffix,
    prepare_model_artifact,
)
from executor.artifacts._materialize import checkpoint_state, materialize_model

__all__ = [
    "BUNDLE_DIRNAME",
    "MODEL_FILENAME",
    "SAFETENSORS",
    "ModelArtifact",
    "checkpoint_state",
    "detect_format",
    "load_state_file",
    "materialize_model",
    "model_head",
    "model_suffix",
    "prepare_model_artifact",
]
