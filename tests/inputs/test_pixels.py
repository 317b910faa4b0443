"""Our preprocessing (the processor's PIL resize, torch for the rest) against Hugging Face's
Qwen2-VL processor itself: the same pixel values to float rounding, the same grids."""

import numpy as np
import pytest
import torch
from PIL import Image

from dohnuts.inputs.pixels import PixelSettings, qwen_pixels, rgb_bytes
from dohnuts.model.base import new_image_processor


def _image(size, mode="RGB", seed=0):
    rng = np.random.default_rng(seed)
    array = rng.integers(0, 256, size=(size[1], size[0], 3), dtype=np.uint8)
    image = Image.fromarray(array, "RGB")
    return image.convert(mode) if mode != "RGB" else image


@pytest.mark.parametrize("pixels, patch", [(64 * 64, 16), (512 * 512, 16), (None, 14)])
@pytest.mark.parametrize("size, mode", [((64, 64), "RGB"), ((37, 120), "RGB"), ((900, 300), "RGB"),
                                        ((512, 512), "RGB"), ((50, 40), "RGBA"), ((80, 60), "L")])
def test_our_pixels_equal_the_processors(pixels, patch, size, mode):
    processor = new_image_processor(patch, pixels)
    image = _image(size, mode, seed=sum(size))
    ours, grid = qwen_pixels(image, processor)
    expected = processor(images=[image], return_tensors="pt")
    assert torch.equal(grid, expected["image_grid_thw"])
    assert ours.dtype == expected["pixel_values"].dtype == torch.float32
    torch.testing.assert_close(ours, expected["pixel_values"], rtol=0, atol=1e-6)


def test_a_processor_it_does_not_know_runs_itself():
    class Other:
        def __call__(self, images, return_tensors):
            return {"pixel_values": torch.ones(4, 3), "image_grid_thw": torch.tensor([[1, 2, 2]])}

    pixels, grid = qwen_pixels(_image((8, 8)), Other())
    assert torch.equal(pixels, torch.ones(4, 3)) and grid.tolist() == [[1, 2, 2]]


def _smooth(size, seed):
    """A photo-like image: random colours blurred by down- and upscaling."""
    rough = _image((max(2, size[0] // 8), max(2, size[1] // 8)), seed=seed)
    return rough.resize(size, Image.BILINEAR)


@pytest.mark.parametrize("pixels", [64 * 64, 512 * 512])
@pytest.mark.parametrize("size", [(64, 64), (37, 120), (900, 300), (512, 512), (800, 600), (30, 30)])
def test_patches_made_on_the_device_side_stay_within_a_level_of_the_processors(pixels, size):
    """The batch path (bytes, then torch's antialiased bicubic resize rounded to bytes, on the
    model's device) against the processor's PIL resize. Same grid always; on photo-like images
    within one level of 255 everywhere (0.0078 after normalising to [-1, 1]; a quarter of values or
    fewer off by one, 0.002 on average); on white noise, where
    PIL clips between its two resize passes, within 26 levels at worst and 0.003 on average."""
    processor = new_image_processor(16, pixels)
    settings = PixelSettings.of(processor)
    assert settings is not None
    for image, worst, mean in ((_smooth(size, sum(size)), 1.01 * 2 / 255, 0.002),
                               (_image(size, seed=sum(size)), 26 * 2 / 255, 0.003)):
        ours = settings.patches(rgb_bytes(image))
        expected = processor(images=[image], return_tensors="pt")["pixel_values"]
        assert ours.shape == expected.shape
        assert torch.equal(settings.grid(image.height, image.width), processor(images=[image], return_tensors="pt")[
            "image_grid_thw"])
        difference = (ours - expected).abs()
        assert difference.max() <= worst and difference.mean() <= mean, (difference.max(), difference.mean())


def test_a_processor_of_another_resize_filter_keeps_its_own_host_path():
    processor = new_image_processor(16, 64 * 64)
    processor.resample = Image.Resampling.BILINEAR
    assert PixelSettings.of(processor) is None  # the device path reproduces bicubic only


@pytest.mark.parametrize("mode", ["RGB", "L", "RGBA", "P"])
def test_an_images_key_and_tensor_come_from_one_read_of_its_pixels(mode):
    """`content` gives the image's key and the RGB bytes its tensor is made of: the same key as
    `image_key`, the same [H, W, 3] bytes as reading the image again, writable and not the
    bytes' own memory; bytes of another size are refused."""
    from dohnuts.inputs.pixels import content, image_key, rgb_bytes

    generator = np.random.default_rng(3)
    image = Image.fromarray(generator.integers(0, 256, (37, 53, 3), dtype=np.uint8)).convert(mode)
    key, data = content(image)
    assert key == image_key(image)
    made = rgb_bytes(image, data)
    assert made.shape == (37, 53, 3) and made.dtype == torch.uint8
    assert torch.equal(made, rgb_bytes(image))
    made[0, 0, 0] += 1  # writable, and a copy: the bytes stay as they were
    assert content(image) == (key, data)
    with pytest.raises(ValueError, match="not the RGB bytes of a 53 x 37 image"):
        rgb_bytes(image, data[:-3])
