"""Our preprocessing (the processor's PIL resize, torch for the rest) against Hugging Face's
Qwen2-VL processor itself: the same pixel values to float rounding, the same grids."""

import numpy as np
import pytest
import torch
from PIL import Image

from dohnuts.model.base import new_image_processor
from dohnuts.model.pixels import qwen_pixels


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
