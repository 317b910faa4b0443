"""The vision tower's CUDA graphs (patch buckets captured at load, exact grid lists that recur)
and the padded bucket computation they replay, against the eager tower."""

import pytest
import torch
from PIL import Image

from dohnuts.model.base import load_backbone
from dohnuts.model.decision import new_head
from dohnuts.model.vision import image_features, vision_blocks, vision_plan
from dohnuts.runtime.checkpoint import assemble
from dohnuts.runtime.vision_graphs import VisionBucket, VisionGraphs, _BucketGraph, vision_buckets


def _images(template, sizes):
    """Encoded images of `sizes`, each with its own colours."""
    encoded = []
    for index, size in enumerate(sizes):
        image = Image.new("RGB", size, "white")
        image.paste((20 + 40 * index, 200 - 30 * index, 90), (4, 4, 20 + index, 24))
        encoded.append(template.encode_image(image))
    return encoded


def test_vision_buckets_hold_the_nominal_patches_with_slack_in_whole_merged_tokens():
    assert vision_buckets(512 * 512, 16, 2) == [VisionBucket(1152, 1), VisionBucket(2304, 2), VisionBucket(4608, 4),
                                                VisionBucket(9216, 8)]
    assert vision_buckets(64 * 64, 16, 2, images=(1, 3)) == [VisionBucket(20, 1), VisionBucket(60, 3)]
    assert VisionBucket(20, 1).fits(20, 1) and not VisionBucket(20, 1).fits(21, 1)
    assert not VisionBucket(60, 2).fits(40, 3)
    with pytest.raises(ValueError, match="at least one patch and one segment"):
        VisionBucket(0, 1)


def test_a_padded_bucket_gives_each_image_its_own_features_in_float32(tiny):
    """The bucket's padded computation (run eagerly on the CPU over the same buffers a graph
    replays), for one image and for two images of different grids, then again with other
    images in the buffers' padding (a padding segment of some patches, or of none): equal to the
    tower on the images alone, to 1e-5 (float32; the matrix products' shapes differ)."""
    backbone = load_backbone(tiny.base, torch.float32)
    model = assemble(backbone, new_head(backbone.config.text_config.hidden_size, 0.01)).eval()
    visual, template = model.backbone.visual, tiny.template()
    settings = template.pixels
    single, pair = vision_buckets(settings.max_pixels, settings.patch, settings.merge, images=(1, 2))
    one = _images(template, [(64, 48)])
    two = _images(template, [(40, 90), (64, 64)])
    assert len({tuple(item.grid_thw[0].tolist()) for item in two}) == 2
    padded = []
    with torch.no_grad():
        for bucket, encoded in ((single, one), (pair, two), (pair, one)):
            graph = _BucketGraph(visual, bucket, "cpu")
            for batch in (two if bucket is pair else one, encoded):  # the second call over the first's padding
                pixels = torch.cat([item.patches() for item in batch])
                grids = torch.cat([item.grid_thw for item in batch])
                plan = vision_plan(visual, grids, "cpu")
                assert bucket.fits(pixels.shape[0], len(batch))
                padded.append(bucket.patches - pixels.shape[0])
                ours = graph(visual, pixels, plan)
                alone = vision_blocks(visual, pixels, plan)
                assert ours.shape == alone.shape
                torch.testing.assert_close(ours, alone, rtol=1e-5, atol=1e-5)
    assert 0 in padded and max(padded) > 0


def test_vision_buckets_need_whole_merged_tokens_and_prepare_nothing_on_the_cpu(tiny):
    backbone = load_backbone(tiny.base, torch.float32)
    visual = backbone.visual
    with pytest.raises(ValueError, match="multiple of 4"):
        _BucketGraph(visual, VisionBucket(18, 1), "cpu")
    graphs = VisionGraphs()
    assert graphs.prepare(visual, [VisionBucket(20, 1)]) == 0 and not graphs.buckets
    encoded = _images(tiny.template(), [(64, 48)])[0]
    image_features(visual, encoded.patches(), encoded.grid_thw, {}, graphs)
    assert graphs.stats["eager"] == 1 and graphs.stats["bucket_replays"] == 0


@pytest.mark.gpu
def test_vision_bucket_graphs_replay_new_grids_as_the_eager_tower(tiny):
    """Buckets captured at prepare serve grid lists never seen before (one image, then two), in
    bf16 on CUDA: within 1% of the largest feature of the eager tower on the images alone (the
    same kernels, other matrix shapes). No exact graph is captured meanwhile; padding is
    counted; a change drops the buckets, and the next call captures them again."""
    backbone = load_backbone(tiny.base, torch.bfloat16).cuda()
    model = assemble(backbone, new_head(backbone.config.text_config.hidden_size, 0.01).cuda()).eval()
    visual, graphs, template = model.backbone.visual, model.vision_graphs, tiny.template()
    settings = template.pixels
    wanted = vision_buckets(settings.max_pixels, settings.patch, settings.merge, images=(1, 2))
    assert graphs.prepare(visual, wanted) == 2 and graphs.prepare_seconds > 0
    calls = [_images(template, [size]) for size in ((64, 48), (40, 90), (64, 64), (90, 40))]
    calls.append(_images(template, [(48, 64), (64, 64)]))
    padding = 0
    for encoded in calls + calls:
        pixels = torch.cat([item.patches("cuda") for item in encoded])
        grids = torch.cat([item.grid_thw for item in encoded])
        ours = image_features(visual, pixels, grids, model.vision_plans, graphs)
        eager = image_features(visual, pixels, grids, model.vision_plans)
        assert (ours.float() - eager.float()).abs().max() <= 0.01 * eager.float().abs().max()
        smallest = min((bucket for bucket in wanted if bucket.fits(pixels.shape[0], len(encoded))),
                       key=lambda bucket: bucket.patches)
        padding += smallest.patches - pixels.shape[0]
    assert graphs.stats == {"eager": 0, "captures": 0, "replays": 0, "bucket_replays": 10, "padding_patches": padding}
    model.changed()
    assert not graphs.buckets and graphs.stale
    encoded = calls[0][0]
    ours = image_features(visual, encoded.patches("cuda"), encoded.grid_thw, model.vision_plans, graphs)
    assert len(graphs.buckets) == 2 and not graphs.stale and graphs.stats["bucket_replays"] == 11
    eager = image_features(visual, encoded.patches("cuda"), encoded.grid_thw, model.vision_plans)
    assert (ours.float() - eager.float()).abs().max() <= 0.01 * eager.float().abs().max()


@pytest.mark.gpu
def test_vision_graphs_replay_the_eager_tower_for_new_pixels(tiny):
    """A grid list's third sighting captures the tower's graph; replays with other pixels of the
    same grids equal the eager tower (the same kernels: to 1e-6); another grid list stays eager.
    No bucket is prepared here."""
    backbone = load_backbone(tiny.base, torch.bfloat16).cuda()
    model = assemble(backbone, new_head(backbone.config.text_config.hidden_size, 0.01).cuda()).eval()
    visual, graphs, template = model.backbone.visual, model.vision_graphs, tiny.template()
    colours = [(20, 60, 220), (200, 30, 30), (30, 200, 30), (90, 90, 90), (250, 200, 10)]
    for index, colour in enumerate(colours):
        image = Image.new("RGB", (64, 48), "white")
        image.paste(colour, (4, 4, 30 + index, 30))
        encoded = template.encode_image(image)
        pixels = encoded.patches("cuda")
        ours = image_features(visual, pixels, encoded.grid_thw, model.vision_plans, graphs)
        eager = image_features(visual, pixels, encoded.grid_thw, model.vision_plans)
        torch.testing.assert_close(ours, eager, rtol=1e-6, atol=1e-6)
    assert graphs.stats == {"eager": 2, "captures": 1, "replays": 3, "bucket_replays": 0, "padding_patches": 0}
    other = template.encode_image(Image.new("RGB", (40, 90), (10, 10, 10)))
    image_features(visual, other.patches("cuda"), other.grid_thw, model.vision_plans, graphs)
    assert graphs.stats["eager"] == 3 and len(graphs.graphs) == 1
    model.changed()
    assert not graphs.graphs  # a move or a new module: captured again when seen again
