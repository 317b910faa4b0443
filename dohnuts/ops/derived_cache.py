"""Constants derived from frozen weights (RMSNorm's `1 + weight`), kept while the weight is unchanged."""

from __future__ import annotations

import contextlib

import torch
from torch.utils.weak import WeakIdKeyDictionary

_DERIVED = WeakIdKeyDictionary()
_HELD: list | None = None  # the kept constants `derived` handed out inside `holding_derived`


@contextlib.contextmanager
def holding_derived():
    """Collect (into the list it yields) every kept constant `derived` hands out inside the
    block. A CUDA graph captured there reads their memory at each replay, so it holds them for
    as long as it lives: when an in-place change of a weight has the cache replace one, a replay
    launched before the change is noticed (`GraphedScores` reads the weights' versions while its
    exact graphs replay) still reads memory it owns."""
    global _HELD
    previous, _HELD = _HELD, []
    try:
        yield _HELD
    finally:
        _HELD = previous


def derived(parameter: torch.Tensor, tag: str, make) -> torch.Tensor:
    """`make(parameter)`, kept while the parameter keeps its storage, dtype and version.

    Constants derived from frozen weights (RMSNorm's `1 + weight` in the input dtype) would
    otherwise cost two or three small kernels per layer per pass,
    about a third of the launches of a forward on the GPU. An in-place change of the parameter
    bumps its version and recomputes. A parameter that takes gradients computes afresh. Inside a
    CUDA graph capture a kept constant is read (the graph then reads its memory, which stays
    while the parameter is unchanged; `GraphedScores` drops graphs when a parameter changes),
    but a missing one is computed without being kept: a capture's kernels only run at replay.
    `tag` names the derivation, including anything else `make` depends on (such as a dtype).
    """
    if parameter.requires_grad and torch.is_grad_enabled():
        return make(parameter)
    stamp = (parameter._version, parameter.data_ptr(), parameter.dtype, parameter.device)
    entries = _DERIVED.setdefault(parameter, {})
    entry = entries.get(tag)
    if entry is None or entry[0] != stamp:
        value = make(parameter)
        if value is parameter or value._base is parameter:
            return value  # nothing to save, and keeping it would keep the parameter alive
        if parameter.is_cuda and torch.cuda.is_current_stream_capturing():
            return value
        entry = entries[tag] = (stamp, value)
    if _HELD is not None:
        _HELD.append(entry[1])
    return entry[1]
