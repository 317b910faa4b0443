"""The vision tower as the runtime runs it (its patch projection as one linear map, its blocks
without host synchronisation, per-grid plans cached) against Hugging Face's forward."""

import copy

import pytest
import torch
from PIL import Image

from dohnuts.model.base import load_backbone
from dohnuts.model.decision import new_head
from dohnuts.model.vision import PatchProjection, grid_inputs, image_features, linear_patch_projection
from dohnuts.runtime.checkpoint import assemble


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
    model = assemble(backbone, new_head(backbone.config.text_config.hidden_size, 0.01)).eval()
    assert isinstance(model.backbone.visual.patch_embed.proj, PatchProjection)
    assert isinstance(reference.patch_embed.proj, torch.nn.Conv3d)
    template = tiny.template()
    image = Image.new("RGB", (64, 48), "white")
    image.paste((20, 60, 220), (8, 8, 40, 40))
    encoded = template.encode_image(image)
    ours = image_features(model.backbone.visual, encoded.patches(), encoded.grid_thw)
    with torch.no_grad():
        theirs = reference(encoded.patches(), grid_thw=encoded.grid_thw).pooler_output  # Hugging Face's forward
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)  # float32, summation order only
    model.backbone.save_pretrained(tmp_path)
    reloaded = load_backbone(tmp_path, torch.float32)
    assert isinstance(reloaded.visual.patch_embed.proj, torch.nn.Conv3d)  # the checkpoint format is Hugging Face's
    assert torch.equal(reloaded.visual.patch_embed.proj.weight, reference.patch_embed.proj.weight)
    linear_patch_projection(reloaded.visual)
    linear_patch_projection(reloaded.visual)  # idempotent
    assert isinstance(reloaded.visual.patch_embed.proj, PatchProjection)


def test_images_of_several_grids_in_one_call_equal_hugging_face_and_reuse_their_plan(tiny):
    """Three images of different sizes (at least two patch grids) packed in one call: the merged
    features equal Hugging Face's forward on the same pixels and grids, in float32; the grid list's
    plan is made once and read again."""
    backbone = load_backbone(tiny.base, torch.float32)
    reference = copy.deepcopy(backbone.visual).eval()
    model = assemble(backbone, new_head(backbone.config.text_config.hidden_size, 0.01)).eval()
    template = tiny.template()
    encoded = []
    for size, colour in (((64, 48), (20, 60, 220)), ((40, 90), (200, 30, 30)), ((64, 64), (30, 200, 30))):
        image = Image.new("RGB", size, "white")
        image.paste(colour, (4, 4, 30, 30))
        encoded.append(template.encode_image(image))
    pixels = torch.cat([item.patches() for item in encoded])
    grids = torch.cat([item.grid_thw for item in encoded])
    assert len({tuple(grid.tolist()) for grid in grids}) >= 2
    ours = image_features(model.backbone.visual, pixels, grids, model.vision_plans)
    again = image_features(model.backbone.visual, pixels, grids, model.vision_plans)
    with torch.no_grad():
        theirs = reference(pixels, grid_thw=grids).pooler_output
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    assert torch.equal(again, ours) and len(model.vision_plans) == 1
    model.changed()
    assert not model.vision_plans  # weights may have moved: plans are made again


@pytest.mark.gpu
def test_the_tower_on_cuda_in_bf16_matches_hugging_face(tiny):
    """Flash varlen attention (non-causal) and no host sync, against Hugging Face's forward on the
    same CUDA bf16 weights: within 2% of the largest feature."""
    backbone = load_backbone(tiny.base, torch.bfloat16).cuda()
    reference = copy.deepcopy(backbone.visual).eval()
    model = assemble(backbone, new_head(backbone.config.text_config.hidden_size, 0.01).cuda()).eval()
    template = tiny.template()
    encoded = [template.encode_image(Image.new("RGB", size, colour)) for size, colour in
               (((64, 48), (20, 60, 220)), ((40, 90), (200, 30, 30)))]
    pixels = torch.cat([item.patches() for item in encoded]).cuda()
    grids = torch.cat([item.grid_thw for item in encoded])
    ours = image_features(model.backbone.visual, pixels, grids, model.vision_plans)
    with torch.no_grad():
        theirs = reference(pixels.bfloat16(), grid_thw=grids.cuda()).pooler_output
    assert (ours.float() - theirs.float()).abs().max() <= 0.02 * theirs.float().abs().max()


def test_vision_plans_keep_the_most_recent_grid_lists():
    from dohnuts.model.vision import VisionPlans

    plans = VisionPlans(capacity=2)
    for key in ("a", "b", "c"):
        plans[key] = key
    assert plans.get("a") is None and plans.get("c") == "c" and len(plans) == 2
    with pytest.raises(ValueError, match="graphs need plans"):
        image_features(None, torch.zeros(1), torch.zeros(1, 3), None, object())


@pytest.mark.parametrize("mode", ["bilinear", "bicubic"])
@pytest.mark.parametrize("align_corners", [False, True])
def test_grid_inputs_equal_transformers_helpers_exactly(mode, align_corners):
    """The plan's host inputs, each image's rows and columns tapped once, equal transformers'
    per-patch helpers bit for bit: several images of odd shapes, a grid larger than the table,
    two frames of one, a repeated grid (its parts cached), in merge-block order of 2."""
    vision_utils = pytest.importorskip("transformers.vision_utils")
    grid = torch.tensor([[1, 32, 32], [1, 4, 58], [2, 10, 6], [1, 64, 2], [1, 32, 32]])
    side, merge = 48, 2
    indices, weights, positions, cu = grid_inputs(grid, side, merge, mode, align_corners)
    taps, tap_weights = vision_utils.get_vision_interpolation_indices_and_weights(
        grid, num_grid_per_side=side, mode=mode, align_corners=align_corners, spatial_merge_size=merge)
    assert torch.equal(indices, taps) and indices.dtype == taps.dtype
    assert torch.equal(weights, tap_weights) and weights.dtype == tap_weights.dtype
    assert torch.equal(positions, vision_utils.get_vision_position_ids(grid, merge))
    assert torch.equal(cu, vision_utils.get_vision_cu_seqlens(grid)) and cu.dtype == torch.int32
