"""Image inputs prepared the way the model's bundle says: resize, rescale, normalize.

User code calls ``prepare_inputs(batch, model)``; this applies a Hugging Face
bundle's ``preprocessor_config.json`` (or the same keys given in ``params``) with
plain torch operations, so no image processor class and no remote code is loaded.
``params`` wins over the bundle: ``image_size``, ``rescale_factor``,
``image_mean``, ``image_std``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as functional

from executor.errors import InvalidRequest

# Floats at most this large are taken to be scaled to [0, 1] already; a second
# 1/255 would leave the model an almost black image.
ALREADY_SCALED_MAX = 1.5


class ImagePreprocessor:
    """Prepares image batches (``NCHW``, or one ``CHW`` image) for a model."""

    def __init__(
        self, preprocessor_config: Mapping[str, Any] | None, params: Mapping[str, Any] | None
    ) -> None:
        self.config: dict[str, Any] = dict(preprocessor_config or {})
        self.params: dict[str, Any] = dict(params or {})

    def prepare(self, value: Any, model: torch.nn.Module | None = None) -> torch.Tensor:
        """Float images, resized, rescaled and normalized as configured."""
        if not isinstance(value, torch.Tensor):
            value = torch.as_tensor(value)
        original_dtype = value.dtype
        value = value.float()
        single = value.ndim == 3
        if single:
            value = value.unsqueeze(0)
        value = self.resize(value, self.target_size(model))
        value = self.rescale(value, original_dtype)
        value = self.normalize(value)
        return value.squeeze(0) if single else value

    __call__ = prepare

    def target_size(self, model: torch.nn.Module | None) -> tuple[int, int] | None:
        """(height, width) from params.image_size, crop_size, size, then ``model.config.image_size``."""
        size = (
            self.params.get("image_size")
            or self.config.get("crop_size")
            or self.config.get("size")
            or getattr(getattr(model, "config", None), "image_size", None)
        )
        if isinstance(size, Mapping):
            if "height" in size and "width" in size:
                return int(size["height"]), int(size["width"])
            if "shortest_edge" in size:
                edge = int(size["shortest_edge"])
                return edge, edge
        if isinstance(size, list | tuple) and len(size) >= 2:
            return int(size[-2]), int(size[-1])
        return (size, size) if isinstance(size, int) else None

    def resize(self, value: torch.Tensor, target: tuple[int, int] | None) -> torch.Tensor:
        requested = self.params.get("image_size")
        processor_size = self.config.get("crop_size") or self.config.get("size")
        # An explicit params.image_size always resizes; a bundle's do_resize may switch it off.
        enabled = requested is not None or bool(self.config.get("do_resize", processor_size is not None))
        if not (enabled and target and value.ndim == 4 and tuple(value.shape[-2:]) != target):
            return value
        return functional.interpolate(value, size=target, mode="bilinear", align_corners=False)

    def rescale(self, value: torch.Tensor, original_dtype: torch.dtype) -> torch.Tensor:
        factor = self.params.get("rescale_factor", self.config.get("rescale_factor"))
        if factor is None or not bool(self.config.get("do_rescale", True)):
            return value
        already_scaled = original_dtype.is_floating_point and (
            not value.numel() or float(value.detach().max()) <= ALREADY_SCALED_MAX
        )
        return value if already_scaled else value * float(factor)

    def normalize(self, value: torch.Tensor) -> torch.Tensor:
        mean = self.params.get("image_mean", self.config.get("image_mean"))
        std = self.params.get("image_std", self.config.get("image_std"))
        requested = self.params.get("image_mean") is not None or self.params.get("image_std") is not None
        enabled = requested or bool(self.config.get("do_normalize", mean is not None and std is not None))
        if not enabled or mean is None or std is None or value.ndim != 4:
            return value
        mean_tensor = torch.as_tensor(mean, dtype=value.dtype).flatten()
        std_tensor = torch.as_tensor(std, dtype=value.dtype).flatten()
        if value.shape[1] == 1 and mean_tensor.numel() == 3:
            value = value.repeat(1, 3, 1, 1)  # grey images for an RGB model
        if mean_tensor.numel() != value.shape[1] or std_tensor.numel() != value.shape[1]:
            raise InvalidRequest(
                f"image processor has {mean_tensor.numel()} mean and {std_tensor.numel()} std values "
                f"but the images have {value.shape[1]} channels"
            )
        if bool((std_tensor <= 0).any()):
            raise InvalidRequest("image processor standard deviation must be positive")
        return (value - mean_tensor.view(1, -1, 1, 1)) / std_tensor.view(1, -1, 1, 1)
