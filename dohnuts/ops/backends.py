"""The backends the dispatch chooses from: FLA and our Triton kernels, loaded once and checked, and the slow paths.

`kernels` asks `fused` for FLA's functions and `_ours` for our Triton kernels; each answers
None where its backend cannot serve (off CUDA, or not installed), and records a slow path
where it could but is missing. This is the only module that imports `fla`.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
import threading
import types

import torch

LOG = logging.getLogger(__name__)
TRITON_TESTED = (3, 6)  # the oldest Triton our kernels are tested on
# FLA may dispatch the delta rule to other backends (FlashQLA, intra-card context parallelism)
# that ignore the chunk plan we pass. The project sets these, whatever the environment says: a
# user's environment must not silently change which kernels run. FLA reads them on every call.
FLA_SETTINGS = {"FLA_FLASH_QLA": "0", "FLA_INTRACARD_CP": "0"}
_SLOW: dict[str, str] = {}


def slow_path(key: str, reason: str) -> None:
    """Record a slower path the runtime takes, and why; the first time per key it is logged as
    a warning. The benchmark's environment record lists them all (`slow_paths`)."""
    if key not in _SLOW:
        _SLOW[key] = reason
        LOG.warning("%s", reason)


def slow_paths() -> dict[str, str]:
    """Every slower path taken in this process so far: key -> why."""
    return dict(_SLOW)


@functools.cache
def _fla():
    """The FLA functions, or None when FLA (or a GPU for it) is not there."""
    for name, value in FLA_SETTINGS.items():
        if os.environ.get(name, value) != value:
            slow_path(f"env:{name}", f"{name}={os.environ[name]} in the environment is overridden with {value}: "
                                     f"that FLA backend ignores the chunk plan dohnuts passes")
        os.environ[name] = value
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError:
        return None
    return {"chunk_gated_delta_rule": chunk_gated_delta_rule}


@functools.cache
def _triton_kernels():
    """Our own Triton kernels, a module a family (`conv`, `merge`, `norm`, `swiglu`, and the delta
    rule's `rows` and `scan`), or None without Triton."""
    try:
        from .conv import fused as conv
        from .delta_rule import rows, scan
        from .merge import fused as merge
        from .norm import fused as norm
        from .swiglu import fused as swiglu
    except ImportError:
        return None
    import triton

    version = tuple(int(part) for part in triton.__version__.split(".")[:2] if part.isdigit())
    if version < TRITON_TESTED:
        slow_path("triton-version", f"Triton {triton.__version__} is older than {'.'.join(map(str, TRITON_TESTED))}, "
                                    f"the oldest our kernels are tested on")
    return types.SimpleNamespace(conv=conv, merge=merge, norm=norm, swiglu=swiglu, rows=rows, scan=scan)


def _ours(x: torch.Tensor):
    """Our Triton kernels for a CUDA tensor they serve (they compute in float32, so float64
    keeps its exact reference), else None."""
    if not x.is_cuda or x.dtype == torch.float64:
        return None
    ops = _triton_kernels()
    if ops is None:
        slow_path("triton", "Triton is not importable on this CUDA machine: norms, SwiGLU, the delta rule's "
                            "convolution and its short rows run plain PyTorch (pip install -e '.[cuda]')")
    return ops


def fused(x: torch.Tensor):
    """The FLA functions when `x` lives on a CUDA device and FLA is installed, else None."""
    if not x.is_cuda:
        return None
    functions = _fla()
    if functions is None:
        slow_path("fla", "flash-linear-attention is not installed on this CUDA machine: the gated delta rule runs "
                         "its plain-PyTorch chunked reference, many times slower (pip install -e '.[cuda]')")
    return functions


_PLANS_LOCK = threading.Lock()
_plans_depth = 0
_plans_before = False


@contextlib.contextmanager
def uncached_plans():
    """FLA without its memo of derived plans (chunk offsets and the like) for the duration.

    FLA memoises such tensors by the identity of the cu_seqlens they came from, in a small
    cache that later calls evict. A CUDA graph captured while a plan came from that memo would
    keep a pointer to memory freed at eviction; computed afresh inside the capture, the plan
    belongs to the graph. FLA reads this switch (its FLA_DISABLE_TENSOR_CACHE setting) on
    every call. The switch is process-wide: nested or concurrent users share it, and the
    first to enter and the last to leave set and restore it.
    """
    global _plans_depth, _plans_before
    utils = sys.modules.get("fla.utils") if _fla() is not None else None
    if utils is None:
        yield
        return
    with _PLANS_LOCK:
        if _plans_depth == 0:
            _plans_before = getattr(utils, "FLA_DISABLE_TENSOR_CACHE", False)
            utils.FLA_DISABLE_TENSOR_CACHE = True
        _plans_depth += 1
    try:
        yield
    finally:
        with _PLANS_LOCK:
            _plans_depth -= 1
            if _plans_depth == 0:
                utils.FLA_DISABLE_TENSOR_CACHE = _plans_before
