"""The messages between front ends and engines: a request and its reply round-trip, and a
cancel is told from a request by its frames."""

import numpy as np

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


def test_a_request_and_its_replies_round_trip_and_a_cancel_is_its_own_message():
    request = EncodedRequest([Row((5, 6, 7, 8), (3,), None, 2), Row((5, 6, 9), (2,), None, 2)], None, 123.5)
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
