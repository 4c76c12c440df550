"""Image preparation: the seed's resize, rescale and normalize rules on real tensors."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as functional

from executor.errors import InvalidRequest
from executor.preprocess import ImagePreprocessor

VIT_PROCESSOR = {
    "do_resize": True,
    "size": {"height": 8, "width": 8},
    "do_rescale": True,
    "rescale_factor": 1 / 255,
    "do_normalize": True,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
}


class WithConfig(torch.nn.Module):
    def __init__(self, image_size: Any) -> None:
        super().__init__()
        self.config = SimpleNamespace(image_size=image_size)


def test_uint8_batch_gets_the_full_pipeline() -> None:
    images = torch.randint(0, 256, (2, 3, 12, 10), dtype=torch.uint8)
    out = ImagePreprocessor(VIT_PROCESSOR, {}).prepare(images, torch.nn.Identity())
    resized = functional.interpolate(images.float(), size=(8, 8), mode="bilinear", align_corners=False)
    assert out.dtype == torch.float32
    assert out.shape == (2, 3, 8, 8)
    torch.testing.assert_close(out, (resized / 255 - 0.5) / 0.5)


def test_floats_already_scaled_are_not_rescaled_again() -> None:
    config = {"rescale_factor": 1 / 255}
    scaled = torch.rand(1, 3, 4, 4)
    torch.testing.assert_close(ImagePreprocessor(config, {}).prepare(scaled), scaled)
    raw = scaled * 255
    torch.testing.assert_close(ImagePreprocessor(config, {}).prepare(raw), raw / 255)
    # Integer input is always rescaled, even when its values are small.
    small = torch.ones(1, 3, 2, 2, dtype=torch.int64)
    torch.testing.assert_close(ImagePreprocessor(config, {}).prepare(small), small.float() / 255)


def test_do_rescale_false_and_params_factor() -> None:
    images = torch.full((1, 3, 2, 2), 100, dtype=torch.uint8)
    off = ImagePreprocessor({"do_rescale": False, "rescale_factor": 0.5}, {}).prepare(images)
    torch.testing.assert_close(off, images.float())
    by_params = ImagePreprocessor({}, {"rescale_factor": 0.01}).prepare(images)
    torch.testing.assert_close(by_params, torch.ones(1, 3, 2, 2))


def test_single_image_stays_three_dimensional() -> None:
    image = torch.randint(0, 256, (3, 16, 16), dtype=torch.uint8)
    out = ImagePreprocessor(VIT_PROCESSOR, {}).prepare(image)
    assert out.shape == (3, 8, 8)


def test_grey_images_are_repeated_to_rgb() -> None:
    grey = torch.rand(2, 1, 8, 8)
    out = ImagePreprocessor({"image_mean": [0.5] * 3, "image_std": [0.25] * 3}, {}).prepare(grey)
    assert out.shape == (2, 3, 8, 8)
    torch.testing.assert_close(out, ((grey - 0.5) / 0.25).repeat(1, 3, 1, 1))


def test_channel_mismatch_and_bad_std_are_invalid_requests() -> None:
    two_channels = torch.rand(1, 2, 4, 4)
    with pytest.raises(InvalidRequest, match="2 channels") as info:
        ImagePreprocessor({"image_mean": [0.5] * 3, "image_std": [0.5] * 3}, {}).prepare(two_channels)
    assert info.value.code == "invalid_request"
    with pytest.raises(InvalidRequest, match="must be positive"):
        ImagePreprocessor({"image_mean": [0.5] * 3, "image_std": [0.5, 0.0, 0.5]}, {}).prepare(
            torch.rand(1, 3, 2, 2)
        )


def test_params_override_the_bundle() -> None:
    images = torch.rand(1, 3, 8, 8)
    params = {"image_mean": [0.0] * 3, "image_std": [2.0] * 3, "image_size": 4}
    out = ImagePreprocessor(VIT_PROCESSOR | {"do_normalize": False, "do_resize": False}, params).prepare(
        images
    )
    expected = functional.interpolate(images, size=(4, 4), mode="bilinear", align_corners=False) / 2
    torch.testing.assert_close(out, expected)


@pytest.mark.parametrize(
    ("config", "params", "model", "expected"),
    [
        ({}, {"image_size": 5}, None, (5, 5)),
        ({}, {"image_size": [6, 7]}, None, (6, 7)),
        ({"crop_size": {"height": 3, "width": 4}, "size": 9}, {}, None, (3, 4)),
        ({"size": {"shortest_edge": 6}}, {}, None, (6, 6)),
        ({}, {}, WithConfig(12), (12, 12)),
        ({}, {}, torch.nn.Identity(), None),
    ],
)
def test_target_size_sources(
    config: dict[str, Any],
    params: dict[str, Any],
    model: torch.nn.Module | None,
    expected: tuple[int, int] | None,
) -> None:
    assert ImagePreprocessor(config, params).target_size(model) == expected


def test_resize_follows_do_resize_and_model_config() -> None:
    images = torch.rand(1, 3, 10, 10)
    assert ImagePreprocessor({"size": 4, "do_resize": False}, {}).prepare(images).shape == (1, 3, 10, 10)
    # The model's own config is a target only when something asks for resizing.
    assert ImagePreprocessor({}, {}).prepare(images, WithConfig(4)).shape == (1, 3, 10, 10)
    assert ImagePreprocessor({"do_resize": True}, {}).prepare(images, WithConfig(4)).shape == (1, 3, 4, 4)


def test_without_configuration_only_the_dtype_changes() -> None:
    images = [[[1, 2], [3, 4]]]  # lists work too
    out = ImagePreprocessor(None, None)(images)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, torch.tensor(images, dtype=torch.float32))
