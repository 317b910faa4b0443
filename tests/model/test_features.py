"""The frozen image-feature cache: hits, misses, LRU bounds, duplicates, and the model using it."""

import pytest
import torch
from helpers import encoded
from PIL import Image

from dohnuts.config import LoraConfig
from dohnuts.inputs.batch import EncodedImage
from dohnuts.inputs.pixels import image_key
from dohnuts.model.base import load_backbone
from dohnuts.model.decision import new_head
from dohnuts.model.features import ImageFeatureCache
from dohnuts.model.vision import image_features
from dohnuts.runtime.checkpoint import assemble, build_training_model
from dohnuts.schema import parse_request

MERGE = 4  # patches per merged token


def _pixels(*grids):
    """Pixels whose values name their image, and the grids, for images of the given patch counts."""
    rows = [torch.full((t * h * w, 3), float(index)) for index, (t, h, w) in enumerate(grids)]
    return torch.cat(rows), torch.tensor(grids)


class Tower:
    """A stand-in vision tower: one merged token per 4 patches, valued by the patches it saw."""

    def __init__(self):
        self.calls = []

    def __call__(self, pixels, grid):
        self.calls.append(grid.tolist())
        return pixels[::MERGE, :2].clone()


def test_a_miss_encodes_and_a_hit_skips_the_tower():
    cache, tower = ImageFeatureCache(), Tower()
    pixels, grids = _pixels((1, 4, 4))
    cold = cache.features(("a",), pixels, grids, (True,), tower, MERGE)
    warm = cache.features(("a",), pixels, grids, (True,), tower, MERGE)
    assert torch.equal(cold, warm) and cold.shape == (4, 2)
    assert len(tower.calls) == 1
    assert cache.stats == {"hits": 1, "misses": 1, "vision_calls": 1, "evictions": 0}


def test_misses_of_a_batch_are_encoded_together_and_duplicates_once():
    cache, tower = ImageFeatureCache(), Tower()
    cache.features(("b",), *_pixels((1, 2, 2)), (True,), tower, MERGE)
    pixels, grids = _pixels((1, 4, 4), (1, 2, 2), (1, 4, 4), (1, 2, 4))
    out = cache.features(("a", "b", "a", "c"), pixels, grids, (True,) * 4, tower, MERGE)
    # "b" hits; "a" (twice in the batch) and "c" go to the tower together, "a" once.
    assert tower.calls == [[[1, 2, 2]], [[1, 4, 4], [1, 2, 4]]]
    assert out.shape == (4 + 1 + 4 + 2, 2)
    assert torch.equal(out[:4], out[5:9])  # both copies of "a" get the same features
    assert (out[:4] == 0).all() and (out[4] == 0).all() and (out[9:] == 3).all()


def test_eviction_is_least_recently_used_within_the_byte_bound():
    entry = 4 * 2 * 4  # 4 tokens x 2 channels x float32
    cache, tower = ImageFeatureCache(capacity=2 * entry), Tower()
    pixels, grids = _pixels((1, 4, 4))
    for key in ("a", "b"):
        cache.features((key,), pixels, grids, (True,), tower, MERGE)
    cache.features(("a",), pixels, grids, (True,), tower, MERGE)  # "a" is now the most recent
    cache.features(("c",), pixels, grids, (True,), tower, MERGE)  # evicts "b", the least recent
    assert list(cache.entries) == ["a", "c"] and cache.size == 2 * entry
    assert cache.stats["evictions"] == 1
    calls = len(tower.calls)
    cache.features(("b",), pixels, grids, (True,), tower, MERGE)
    assert len(tower.calls) == calls + 1  # "b" was gone


def test_an_image_built_as_a_hit_reads_the_cache_and_fails_clearly_once_evicted():
    cache, tower = ImageFeatureCache(), Tower()
    pixels, grids = _pixels((1, 4, 4))
    cold = cache.features(("a",), pixels, grids, (True,), tower, MERGE)
    assert torch.equal(cache.grid("a"), grids[0:1]) and cache.grid("b") is None
    # A batch whose first image was a hit when built carries only the second image's pixels.
    second, second_grid = _pixels((1, 2, 2))
    out = cache.features(("a", "b"), second, torch.cat([grids, second_grid]), (False, True), tower, MERGE)
    assert torch.equal(out[:4], cold) and tower.calls[-1] == [[1, 2, 2]]
    cache.clear()
    with pytest.raises(RuntimeError, match="no longer cached"):
        cache.features(("a",), None, grids, (False,), tower, MERGE)


def test_an_entry_larger_than_the_cache_is_used_but_not_kept():
    cache, tower = ImageFeatureCache(capacity=8), Tower()
    out = cache.features(("a",), *_pixels((1, 4, 4)), (True,), tower, MERGE)
    assert out.shape == (4, 2) and len(cache) == 0 and cache.size == 0


def test_negative_capacity_is_refused():
    with pytest.raises(ValueError, match="capacity must be >= 0"):
        ImageFeatureCache(capacity=-1)


def test_the_key_is_the_decoded_content_and_size():
    image = Image.new("RGB", (8, 6), "white")
    changed = image.copy()
    changed.putpixel((3, 2), (254, 255, 255))
    assert image_key(image) == image_key(image.copy())
    assert image_key(image) != image_key(changed)
    assert image_key(image) != image_key(Image.new("RGB", (6, 8), "white"))


def _image_batch(template, image):
    request = parse_request({"note": "a square", "image": image},
                            {"red": {"type": "noul", "instructions": "Is it red?"}}, template.reserved)
    return template.collate(*encoded(template, request))


def test_model_hits_skip_the_vision_tower_and_give_identical_logits(tiny):
    template = tiny.template()
    backbone = load_backbone(tiny.base, torch.float32).eval()
    model = assemble(backbone, new_head(backbone.config.text_config.hidden_size, 0.01)).eval()
    calls = []
    backbone.visual.merger.register_forward_hook(lambda *args: calls.append(1))  # once a tower pass
    image = Image.new("RGB", (64, 64), "white")
    image.paste((220, 20, 20), (8, 8, 40, 40))
    with torch.no_grad():
        cold = model(_image_batch(template, image))
        warm = model(_image_batch(template, image))
        assert len(calls) == 1 and torch.equal(cold, warm)
        changed = image.copy()
        changed.putpixel((0, 0), (255, 255, 254))
        model(_image_batch(template, changed))
        assert len(calls) == 2  # one pixel changed: a miss
    fresh = assemble(backbone, new_head(backbone.config.text_config.hidden_size, 0.01))
    assert len(fresh.image_cache) == 0 and len(model.image_cache) == 2
    model.double()
    assert len(model.image_cache) == 0  # a dtype or device change empties it


def test_features_cached_in_training_serve_prediction_and_survive_lora_updates(tiny):
    """One model trains and predicts: an image encoded in a training step is a cache hit for a
    later prediction, after optimizer steps have moved LoRA (the vision tower is frozen, so its
    features are still exact: they equal a fresh encoding)."""
    template = tiny.template()
    model, _ = build_training_model(tiny.base, "float32", LoraConfig(), 0.01, seed=0)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    calls = []
    model.backbone.visual.merger.register_forward_hook(lambda *args: calls.append(1))
    image = Image.new("RGB", (64, 64), "white")
    image.paste((20, 160, 40), (8, 8, 56, 40))
    model.train()
    before = [p.detach().clone() for p in model.parameters() if p.requires_grad]
    for _ in range(2):
        model(_image_batch(template, image)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    moved = [p for p in model.parameters() if p.requires_grad]
    assert any(not torch.equal(a, b) for a, b in zip(before, moved))  # LoRA and the head moved
    assert len(calls) == 1 and model.image_cache.stats["hits"] == 1  # the second step hit the cache
    key = image_key(image)
    cached = model.image_cache.entries[key][0].clone()
    model.eval()
    with torch.no_grad():
        grid = model.image_cache.grid(key)
        hit = template.collate(template.encode(parse_request(
            {"note": "a square", "image": image}, {"red": {"type": "noul", "instructions": "Is it red?"}},
            template.reserved), 4096, (0,), (EncodedImage(None, grid, key),)), [EncodedImage(None, grid, key)])
        model(hit)  # built as prediction builds a hit: no pixels at all
        assert len(calls) == 1
        encoded = template.encode_image(image)
        fresh = image_features(model.backbone.visual, encoded.patches(), encoded.grid_thw)
    assert torch.equal(fresh, cached)
