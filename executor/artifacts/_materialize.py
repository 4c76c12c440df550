"""Building a module from a state dict: locally, never from the hub, never with remote code.

``materialize_model`` takes the architecture from a bundle's config.json, else from the
round's ``params`` (timm, torchvision or a Hugging Face config). A Hugging Face model is
rebuilt with ``from_pretrained(None, state_dict=...)``: only that path applies
transformers 5's checkpoint key conversions, and it never touches the hub.
``checkpoint_state`` maps a model's state back to the file's names.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from executor.artifacts._formats import LONG_CAUSE_CHARS, state_from_loaded
from executor.errors import BadArtifact, InvalidRequest, RoundhouseError, Translations, into, map_exceptions
from executor.placement import onloaded_state

# --- Hugging Face ----------------------------------------------------------------------------


def checkpoint_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``model``'s state under the key names of its checkpoint file.

    transformers 5 renames some weights when it loads a checkpoint (ViT's
    ``encoder.layer.0.attention.attention.query`` is ``layers.0.attention.q_proj`` in
    memory) and reverts that on save; a delta against the canonical model file must
    use the file's names, so this applies the same revert.
    """
    state = onloaded_state(model)  # an offloaded model's real weights, not its placeholders
    try:
        from transformers import PreTrainedModel
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:
        return state
    if isinstance(model, PreTrainedModel):
        return dict(revert_weight_conversion(model, state))
    return state


def _hf_factory(params: Mapping[str, Any]) -> Any:
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForImageClassification,
        AutoModelForSequenceClassification,
    )

    factories = {
        "causal-lm": AutoModelForCausalLM,
        "image-classification": AutoModelForImageClassification,
        "sequence-classification": AutoModelForSequenceClassification,
    }
    task = str(params.get("hf_task") or "image-classification")
    if task not in factories:
        raise InvalidRequest(f"unsupported params.hf_task {task!r}; use one of {', '.join(factories)}")
    return factories[task]


def _task_class(factory: Any, config: Any, error: type[RoundhouseError]) -> type:
    """The concrete class an Auto factory would build (Auto classes cannot load a bare state dict)."""
    try:
        cls = factory._model_mapping[type(config)]
    except KeyError:
        raise error(f"{factory.__name__} has no model for model_type {config.model_type!r}") from None
    return cls[0] if isinstance(cls, list | tuple) else cls


def hf_class_from_params(params: Mapping[str, Any]) -> tuple[type, Any]:
    from transformers import AutoConfig

    raw = params.get("hf_config") or {}
    if not isinstance(raw, Mapping):
        raise InvalidRequest("params.hf_config must be an object")
    config_data = dict(raw)
    model_type = config_data.pop("model_type", None)
    if not model_type:
        raise InvalidRequest("Hugging Face models need params.hf_config.model_type")
    if "auto_map" in config_data or config_data.get("trust_remote_code"):
        raise InvalidRequest("params.hf_config must not ask for remote code (auto_map/trust_remote_code)")
    factory = _hf_factory(params)
    with map_exceptions(
        {Exception: into(InvalidRequest, "params.hf_config cannot be built", LONG_CAUSE_CHARS)}
    ):
        config = AutoConfig.for_model(str(model_type), **config_data)
    return _task_class(factory, config, InvalidRequest), config


def bundle_model_class(bundle_root: str, params: Mapping[str, Any]) -> tuple[type, Any]:
    """The bundle's own architecture (config.json ``architectures``), else the ``hf_task`` class."""
    import transformers

    with map_exceptions(
        {Exception: into(BadArtifact, "bundle config.json cannot be loaded", LONG_CAUSE_CHARS)}
    ):
        config = transformers.AutoConfig.from_pretrained(
            bundle_root, trust_remote_code=False, local_files_only=True
        )
    if getattr(config, "auto_map", None):
        raise BadArtifact("bundle config.json needs remote code (auto_map); it is never executed")
    for name in getattr(config, "architectures", None) or []:
        cls = getattr(transformers, str(name), None)
        if isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel):
            return cls, config
    return _task_class(_hf_factory(params), config, BadArtifact), config


def load_hf_model(
    cls: Any, config: Any, state: dict[str, torch.Tensor], error: type[RoundhouseError]
) -> tuple[torch.nn.Module, list[str], list[str]]:
    """``from_pretrained`` on a state dict: it applies transformers' checkpoint key conversions."""
    dtype = getattr(config, "dtype", None) or torch.get_default_dtype()
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, torch.get_default_dtype())
    translations: Translations = {
        RuntimeError: into(error, f"the state dict does not fit {cls.__name__}", LONG_CAUSE_CHARS),
        Exception: into(error, f"{cls.__name__} cannot be built", LONG_CAUSE_CHARS),
    }
    with map_exceptions(translations):
        # The model's dtype follows its config, as from_config would, not the state's.
        model, info = cls.from_pretrained(
            None,
            config=config,
            state_dict=state,
            dtype=dtype,
            output_loading_info=True,
            local_files_only=True,
        )
    return model, sorted(info.get("missing_keys", ())), sorted(info.get("unexpected_keys", ()))


# --- building models -----------------------------------------------------------------------


def materialize_model(
    loaded: Any, *, params: Mapping[str, Any], bundle_root: str | None
) -> tuple[torch.nn.Module, list[str], list[str]]:
    """Build the architecture locally (no hub, no remote code) and load ``loaded`` into it.

    ``loaded`` is a state dict or ``{"state_dict": ...}``. With ``bundle_root`` the
    architecture comes from the bundle's config.json, otherwise from ``params``
    (``model_name``, ``model_backend``, ``num_classes``, ``hf_config``, ``hf_task``).
    Returns ``(model, missing, unexpected)``; a missing key whose tensor is tied to a
    loaded one (an LM head sharing the embedding) is not reported as missing.
    """
    state = state_from_loaded(loaded, InvalidRequest)
    if bundle_root:
        cls, config = bundle_model_class(bundle_root, params)
        return load_hf_model(cls, config, state, BadArtifact)
    model_name = str(params.get("model_name") or "").strip()
    if not model_name:
        raise InvalidRequest("a state dict without a bundle needs params.model_name")
    backend = str(params.get("model_backend") or "timm").lower()
    if backend == "huggingface":
        cls, config = hf_class_from_params(params)
        return load_hf_model(cls, config, state, InvalidRequest)
    model = _build_vision_model(backend, model_name, params)
    unfit = into(InvalidRequest, f"the state dict does not fit {model_name!r}", LONG_CAUSE_CHARS)
    with map_exceptions({RuntimeError: unfit}):
        missing, unexpected = model.load_state_dict(state, strict=False)
    return model, _untied(model, state, list(missing)), list(unexpected)


def _untied(model: torch.nn.Module, state: Mapping[str, torch.Tensor], missing: list[str]) -> list[str]:
    current = model.state_dict()
    loaded = {current[key].untyped_storage().data_ptr() for key in state if key in current}
    loaded.discard(0)  # empty tensors all share the null pointer
    return [key for key in missing if current[key].untyped_storage().data_ptr() not in loaded]


def _build_vision_model(backend: str, model_name: str, params: Mapping[str, Any]) -> torch.nn.Module:
    raw = params.get("num_classes", 1000)
    not_an_int = {
        (TypeError, ValueError): lambda _: InvalidRequest(
            f"params.num_classes must be an integer, got {raw!r}"
        )
    }
    with map_exceptions(not_an_int):
        classes = int(raw)
    with map_exceptions(
        {Exception: into(InvalidRequest, f"{backend} cannot build {model_name!r}", LONG_CAUSE_CHARS)}
    ):
        if backend == "timm":
            import timm

            return timm.create_model(model_name, pretrained=False, num_classes=classes)
        if backend == "torchvision":
            from torchvision import models

            return models.get_model(model_name, weights=None, num_classes=classes)
    raise InvalidRequest(
        f"unsupported params.model_backend {backend!r}; use timm, torchvision or huggingface"
    )
