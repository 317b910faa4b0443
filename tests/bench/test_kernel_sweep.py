"""The walk's resources compiled for sm_90 on the CPU (`kernel_sweep.walk_resources`)."""

import json

import pytest

pytest.importorskip("triton")

from dohnuts.bench import kernel_sweep  # noqa: E402


def test_walk_resources_compile_each_block_of_values_for_hopper_without_a_gpu(capsys):
    kernel_sweep.walk_resources(values=(16,), warps=4)
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(line["kernel"], line["values_a_program"], line["warps"]) for line in lines] == [("_chunk_walk", 16, 4)]
    # The lone long sequence's walk (16 values a program) keeps its state in registers, unspilled.
    walk = lines[0]
    assert walk["registers"] > 0 and walk["stack_bytes"] == 0, walk
