"""The vision tower's patch projection as one linear map equals the Conv3d it replaces."""

import copy

import pytest
import torch
from PIL import Image

from dohnuts.model.base import load_backbone
from dohnuts.model.decision import DecisionModel, new_head
from dohnuts.model.vision import PatchProjection, image_features, linear_patch_projection


def test_patch_projection_equals_the_conv3d_it_replaces():
    conv = torch.nn.Conv3d(3, 24, kernel_size=(2, 4, 4), stride=(2, 4, 4), bias=True).double()
    patches = torch.randn(37, 3, 2, 4, 4, dtype=torch.float64)
    projection = PatchProjection(conv)
    assert projection.weight is conv.weight and projection.bias is conv.bias  # the same parameters
    expected = conv(patches)
    actual = projection(patches)
    assert actual.shape == expected.shape == (37, 24, 1, 1, 1)
    torch.testing.assert_close(actual, expected, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="non-overlapping patch Conv3d"):
        PatchProjection(torch.nn.Conv3d(3, 8, kernel_size=(2, 4, 4), stride=(1, 2, 2)))


def test_vision_features_and_saved_weights_are_unchanged_by_the_linear_projection(tiny, tmp_path):
    backbone = load_backbone(tiny.base, torch.float32)
    reference = copy.deepcopy(backbone.visual).eval()  # Hugging Face's Conv3d tower
    model = DecisionModel(backbone, new_head(backbone.config.text_config.hidden_size, 0.01)).eval()
    assert isinstance(model.backbone.visual.patch_embed.proj, PatchProjection)
    assert isinstance(reference.patch_embed.proj, torch.nn.Conv3d)
    template = tiny.template()
    image = Image.new("RGB", (64, 48), "white")
    image.paste((20, 60, 220), (8, 8, 40, 40))
    encoded = template.encode_image(image)
    ours = image_features(model.backbone.visual, encoded.pixel_values, encoded.grid_thw)
    theirs = image_features(reference, encoded.pixel_values, encoded.grid_thw)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)  # float32, summation order only
    model.backbone.save_pretrained(tmp_path)
    reloaded = load_backbone(tmp_path, torch.float32)
    assert isinstance(reloaded.visual.patch_embed.proj, torch.nn.Conv3d)  # the checkpoint format is Hugging Face's
    assert torch.equal(reloaded.visual.patch_embed.proj.weight, reference.patch_embed.proj.weight)
    linear_patch_projection(reloaded.visual)
    linear_patch_projection(reloaded.visual)  # idempotent
    assert isinstance(reloaded.visual.patch_embed.proj, PatchProjection)
