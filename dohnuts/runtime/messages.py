"""What a server's front ends and engines say to each other, as msgpack: encoded requests one
way (token ids, marker positions, each image's key, grid and RGB bytes), logits or an error back.

    request: [id, [[ids int32 bytes, markers int32 bytes, shared], ...], images, placed, deadline]
             images: the request's distinct images, each [key, [t, h, w], height, width, RGB bytes]
             placed: per vision block of its rows, in order, the index of its image in images
             deadline: None, or time.monotonic() seconds (one clock for a host's processes)
    reply:   [id, "logits", rows, columns, float32 bytes]  or  [id, "error", kind, message]
    cancel:  the frames CANCEL, [id]: the request's caller went away; drop it if it still waits

Error kinds: "overloaded" (the engine's queue is full), "closed" (it is stopping), "expired"
(the deadline passed before it ran), "failed" (the invocation failed).
"""

from __future__ import annotations

import msgpack
import numpy as np
import torch

from ..inputs.batch import EncodedImage, Row
from ..inputs.pixels import PixelSettings
from ..inputs.tokens import SPATIAL_MERGE
from .engine import EncodedRequest

LOGITS, ERROR = "logits", "error"
CANCEL = b"cancel"  # the first of a cancel's two frames (a request is one frame)


def pack_request(request_id: int, request: EncodedRequest) -> bytes:
    """The message of one encoded request (its images with their RGB bytes)."""
    rows = [[np.asarray(row.input_ids, dtype=np.int32).tobytes(), np.asarray(row.markers, dtype=np.int32).tobytes(),
             row.shared] for row in request.rows]
    images = []
    for image in request.images:
        if image.pixel_values is None or image.settings is None:
            raise ValueError("an image crosses to the engine as its RGB bytes: encode it with pixel settings")
        height, width = image.pixel_values.shape[:2]
        images.append([image.key, image.grid_thw[0].tolist(), height, width, image.pixel_values.numpy().tobytes()])
    placed = list(request.rows[0].images) if request.rows else []
    return msgpack.packb([request_id, rows, images, placed, request.deadline], use_bin_type=True)


def unpack_request(message: bytes, settings: PixelSettings | None) -> tuple[int, EncodedRequest]:
    """(id, encoded request) of a request message; `settings` turn its images' bytes into patches."""
    request_id, rows, images, placed, deadline = msgpack.unpackb(message, raw=False)
    encoded, grids = [], []
    for key, thw, height, width, pixels in images:
        rgb = torch.frombuffer(bytearray(pixels), dtype=torch.uint8).view(height, width, 3)
        encoded.append(EncodedImage(rgb, torch.tensor([thw], dtype=torch.long), key, settings))
        grids.append((thw[1] // SPATIAL_MERGE, thw[2] // SPATIAL_MERGE))
    placed = tuple(placed)
    own_grids = tuple(grids[index] for index in placed)
    made = [Row(_ints(ids), _ints(markers), None, shared, placed, own_grids) for ids, markers, shared in rows]
    return request_id, EncodedRequest(made, tuple(encoded), deadline)


def pack_cancel(request_id: int) -> list[bytes]:
    """The frames that cancel request `request_id`."""
    return [CANCEL, msgpack.packb([request_id])]


def unpack_cancel(frames: list[bytes]) -> int | None:
    """The id a message's frames cancel, or None when they are not a cancel."""
    if len(frames) == 2 and frames[0] == CANCEL:
        return int(msgpack.unpackb(frames[1])[0])
    return None


def _ints(data: bytes) -> tuple[int, ...]:
    return tuple(np.frombuffer(data, dtype=np.int32).tolist())


def pack_logits(request_id: int, logits: np.ndarray) -> bytes:
    """The reply carrying a request's logits [rows, columns] as float32."""
    rows, columns = logits.shape
    return msgpack.packb([request_id, LOGITS, rows, columns, np.ascontiguousarray(logits, dtype=np.float32).tobytes()],
                         use_bin_type=True)


def pack_error(request_id: int, kind: str, message: str) -> bytes:
    """The reply saying why a request was not run (`kind`: see the module's docstring)."""
    return msgpack.packb([request_id, ERROR, kind, message], use_bin_type=True)


def unpack_reply(message: bytes) -> tuple[int, np.ndarray | tuple[str, str]]:
    """(id, logits [rows, columns] float32) or (id, (error kind, message))."""
    request_id, kind, *rest = msgpack.unpackb(message, raw=False)
    if kind == LOGITS:
        rows, columns, data = rest
        return request_id, np.frombuffer(data, dtype=np.float32).reshape(rows, columns)
    return request_id, (rest[0], rest[1])
