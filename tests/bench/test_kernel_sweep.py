"""The walk's resources compiled for sm_90 on the CPU (`kernel_sweep.walk_resources`)."""

import json

import pytest

pytest.importorskip("triton")

from dohnuts.bench import kernel_sweep  # noqa: E402
from dohnuts.ops.delta_rule import scan  # noqa: E402


def test_walk_resources_compile_each_variant_for_hopper_without_a_gpu(capsys):
    kernel_sweep.walk_resources(values=(16,), warps=4)
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(line["step_products"], line["values_a_program"]) for line in lines] == [(2, 16), (1, 16)]
    two, one = lines
    # The lone long sequence's walk (16 values a program) keeps its state in registers, unspilled.
    assert two["registers"] > 0 and two["stack_bytes"] == 0 and one["stack_bytes"] == 0, (two, one)
    # One product a step holds each chunk's float32 N (128 x 128) in shared memory, stage by stage.
    assert one["shared_bytes"] >= scan.TRANSITION_STAGES * 128 * 128 * 4, one
