"""The count of Triton compiles and autotunes (`ops.compiles`), on the CPU: it finds the kernels
of our modules and counts the variants their caches hold; GPU tests count real compiles."""

import os

import pytest

from dohnuts.ops import compiles

triton = pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="the interpreter compiles nothing")


def test_the_count_finds_our_kernels_and_counts_each_cached_variant_and_tuned_key(monkeypatch):
    from triton.runtime.jit import JITFunction

    from dohnuts.ops.norm import fused
    from dohnuts.ops.swiglu import fused as swiglu

    before = compiles.kernel_variants()
    assert before["kernels"] >= 10  # the norm, SwiGLU, convolution and delta-rule kernels
    assert isinstance(fused._rms_norm_fwd, JITFunction)
    # A variant in one device's cache and two in another's: what two compiles on two GPUs leave.
    monkeypatch.setattr(fused._rms_norm_fwd, "device_caches", {0: ({"a": 1}, None), 1: ({"b": 1, "c": 2}, None)})
    tuner = triton.autotune(configs=[triton.Config({}, num_warps=4)], key=["N"])(swiglu._swiglu_bwd)
    monkeypatch.setattr(swiglu, "_tuned_for_the_test", tuner, raising=False)
    monkeypatch.setattr(tuner, "cache", {(16,): tuner.configs[0], (32,): tuner.configs[0]})
    after = compiles.kernel_variants()
    assert after["compiled"] - before["compiled"] == 3 and after["tuned"] - before["tuned"] == 2
    assert after["kernels"] == before["kernels"]  # the autotuner wraps a kernel already counted
    keys = compiles.compiled_keys()  # what a failing GPU test shows: the kernels and their new keys
    assert keys["dohnuts.ops.norm.fused._rms_norm_fwd"] == {"a", "b", "c"}
    assert keys["dohnuts.ops.swiglu.fused._swiglu_bwd (tuned)"] == {"(16,)", "(32,)"}


def test_request_sized_arguments_are_not_specialised():
    """A count that follows the request must not pick a compiled variant (issue 37)."""
    from dohnuts.ops.delta_rule import rows, scan
    from dohnuts.ops.norm import fused
    from dohnuts.ops.swiglu import fused as swiglu

    # The gate's kernels also leave their layouts' rows a block unspecialised: 1 for a contiguous
    # tensor, the heads for a strided view, and a bucket's capture meets the one its warm-up did not.
    gate_layout = ("R", "XB", "GB")
    for kernel, arguments in [(fused._rms_norm_fwd, "R"), (fused._add_rms_norm_fwd, "R"),
                              (fused._norm_rotate_fwd, "R"), (fused._rms_norm_gated_fwd, "R"),
                              (fused._split_rotate_fwd, "R"), (swiglu._swiglu_fwd, "N"),
                              (swiglu._gated_fwd, gate_layout), (swiglu._gated_bwd, gate_layout),
                              (rows._delta_rows_fwd, "G"), (scan._delta_scan_walk, "G"), (scan._delta_scan_fwd, "G")]:
        arguments = (arguments,) if isinstance(arguments, str) else arguments
        unspecialised = {parameter.name for parameter in kernel.params if parameter.do_not_specialize}
        assert unspecialised == set(arguments), (kernel.fn.__name__, unspecialised)
