"""The messages between front ends and engines: a request and its reply round-trip, and a
cancel is told from a request by its frames."""

import numpy as np
import torch
from PIL import Image

from dohnuts.config import ModelConfig
from dohnuts.inputs.batch import Row
from dohnuts.runtime.engine import EncodedRequest
from dohnuts.runtime.messages import (
    pack_cancel,
    pack_error,
    pack_logits,
    pack_request,
    unpack_cancel,
    unpack_reply,
    unpack_request,
)
from dohnuts.runtime.predict import encode_request
from dohnuts.schema import parse_request


def test_a_request_and_its_replies_round_trip_and_a_cancel_is_its_own_message():
    request = EncodedRequest([Row((5, 6, 7, 8), (3,), None, 2), Row((5, 6, 9), (2,), None, 2)], (), 123.5)
    message = pack_request(41, request)
    assert unpack_cancel([message]) is None  # one frame: a request
    request_id, back = unpack_request(message, None)
    assert request_id == 41 and back.deadline == 123.5
    rows = [(row.input_ids, row.markers, row.shared) for row in back.rows]
    assert rows == [((5, 6, 7, 8), (3,), 2), ((5, 6, 9), (2,), 2)]
    assert unpack_cancel(pack_cancel(41)) == 41
    logits = np.arange(6, dtype=np.float32).reshape(2, 3)
    request_id, found = unpack_reply(pack_logits(7, logits))
    assert request_id == 7 and np.array_equal(found, logits)
    assert unpack_reply(pack_error(8, "expired", "too late")) == (8, ("expired", "too late"))


def test_a_request_of_several_images_crosses_with_each_distinct_image_once(tiny):
    """Three vision blocks of two images: each image's key, grid and bytes cross once, and the
    rows come back with their blocks' images and grids."""
    template = tiny.template()
    red, blue = Image.new("RGB", (64, 48), (220, 20, 20)), Image.new("RGB", (32, 64), (20, 20, 220))
    request = parse_request({"a": red, "b": [blue, red]}, {"q": {"type": "noul", "instructions": "Red?"}},
                            template.reserved)
    encoded = encode_request(template, ModelConfig(), request)
    assert len(encoded.images) == 2 and encoded.rows[0].images == (0, 1, 0)
    _, back = unpack_request(pack_request(3, encoded), template.pixels)
    assert [image.key for image in back.images] == [image.key for image in encoded.images]
    for mine, theirs in zip(encoded.images, back.images):
        assert torch.equal(mine.grid_thw, theirs.grid_thw) and torch.equal(mine.pixel_values, theirs.pixel_values)
    assert [(row.input_ids, row.images, row.image_grids) for row in back.rows] == [
        (row.input_ids, row.images, row.image_grids) for row in encoded.rows]
