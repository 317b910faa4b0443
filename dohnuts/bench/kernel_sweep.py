"""The elementwise kernels of a long sequence by launch setting: where a one-question request of
thousands of tokens spends its device time besides the matrix products and the delta rule, and
what each setting of the convolution and SwiGLU kernels gives there; and what the delta rule's
walk asks of a Hopper multiprocessor, compiled without a GPU. Measurements for choosing the next
optimisation, not part of the runtime."""

from __future__ import annotations

import json
import re
import subprocess
import tempfile
from pathlib import Path

import torch

from ..ops import kernels
from ..ops.plan import chunk_plan, cumulative
from . import settings as runtime_settings
from .host import require_cuda
from .short_rows import graphed

# The Qwen3.5-0.8B widths: the delta rule's packed projection (q, k, v, then z, b, a) and its
# convolution's channels, 16 heads of 128 a kind; the MLP's intermediate width.
HEADS, HEAD_DIM, CONV_WIDTH = 16, 128, 4
MIXED = 2 * HEADS * HEAD_DIM + HEADS * HEAD_DIM
PROJECTED = MIXED + HEADS * HEAD_DIM + 2 * HEADS
INTERMEDIATE = 3584
# Each kernel's settings (`bench.settings` names) and the values swept.
CONV = ("conv.TOKENS", "conv.WARPS"), [(tokens, warps) for tokens in (16, 32, 64) for warps in (2, 4, 8)]
SWIGLU = ("swiglu.BY_ROWS", "swiglu.BLOCK", "swiglu.WARPS"), [
    (int(by_rows), block, warps) for by_rows in (False, True) for block in (512, 1024, 2048, 4096)
    for warps in (4, 8) if warps == 4 or block >= 2048]
GATE = ("swiglu.GATE_ELEMENTS",), [(elements,) for elements in (1024, 2048, 4096, 8192)]
ATTENTION_HEADS, ATTENTION_DIM = 8, 256


@torch.no_grad()
def elementwise_sweep(lengths: tuple[int, ...] = (1500, 3000), replays: int = 100) -> None:
    """Time, on one sequence of each of `lengths` tokens (a one-question request's row, bf16, CUDA
    graph replays): the delta rule's convolution and head split (`conv.fused`) at each count of
    tokens and warps a program (`TOKENS`, `WARPS`), from zero states without final states as a
    one-row bucket runs it, reading its input in place from the packed projection's output; and
    SwiGLU (`swiglu.fused`) on the MLP's packed output by runs of the flattened output and by
    rows (`BY_ROWS`), at each block (`BLOCK`) and, for the larger ones, on 8 warps as well as 4
    (`WARPS`); and the attention's output gate (`kernels.gated`,
    the gate read in place from the query projection's output) at each count of elements a
    program (`GATE_ELEMENTS`). Prints one JSON line a setting: microseconds a
    call, the bytes it must move a microsecond (GB/s; the H200 reads and writes about 4,800), the
    largest difference from the runtime's setting (0 expected: every setting does the same
    arithmetic an element), and whether it is the runtime's.

        python benchmarks/run.py elementwise_sweep --lengths 1500 3000
    """
    require_cuda()
    before = runtime_settings.current()
    generator = torch.Generator(device="cuda").manual_seed(0)
    try:
        for tokens in lengths:
            _convolution(tokens, generator, replays)
            _swiglu(tokens, generator, replays)
            _gate(tokens, generator, replays)
    finally:
        runtime_settings.restore(before)


def _convolution(tokens: int, generator: torch.Generator, replays: int) -> None:
    projected = torch.randn(tokens, PROJECTED, device="cuda", generator=generator).bfloat16()
    weight = (torch.randn(MIXED, CONV_WIDTH, device="cuda", generator=generator) * 0.5).bfloat16()
    bounds = cumulative([tokens])
    device_bounds, plan = bounds.cuda(), chunk_plan([tokens]).cuda()

    def convolve():
        q, k, v, _ = kernels.conv_split_heads(projected[:, :MIXED], weight, None, False, device_bounds, bounds, plan,
                                              HEADS, HEAD_DIM, HEADS, HEAD_DIM)
        return torch.cat([q.flatten(), k.flatten(), v.flatten()])

    moved = tokens * MIXED * 2 * 2 + tokens * 2 * HEADS * 4  # x read, q k v written, the norms' rstd
    _sweep("conv_split_heads", tokens, convolve, moved, *CONV, replays)


def _swiglu(tokens: int, generator: torch.Generator, replays: int) -> None:
    mlp = torch.randn(tokens, 2 * INTERMEDIATE, device="cuda", generator=generator).bfloat16()
    moved = tokens * INTERMEDIATE * 2 * 3  # gate and up read, the output written
    _sweep("swiglu", tokens, lambda: kernels.swiglu(mlp[:, :INTERMEDIATE], mlp[:, INTERMEDIATE:]), moved, *SWIGLU,
           replays)


def _gate(tokens: int, generator: torch.Generator, replays: int) -> None:
    # The query projection's output, each head's query then its gate (read in place, as a one-row
    # bucket's graph reads it), and an attention output [T, H, D].
    width = ATTENTION_HEADS * ATTENTION_DIM
    projected = torch.randn(tokens, 2 * width, device="cuda", generator=generator).bfloat16()
    gate = projected.view(tokens, ATTENTION_HEADS, 2 * ATTENTION_DIM)[..., ATTENTION_DIM:]
    attended = torch.randn(tokens, ATTENTION_HEADS, ATTENTION_DIM, device="cuda", generator=generator).bfloat16()
    moved = tokens * width * 2 * 3  # x and the gate read, the output written
    _sweep("gated", tokens, lambda: kernels.gated(attended, gate), moved, *GATE, replays)


def _sweep(kernel: str, tokens: int, call, moved: int, names: tuple[str, ...], values: list[tuple], replays: int
           ) -> None:
    """One JSON line for each of `values` of the settings `names` (`bench.settings`) of `call`,
    the runtime's first."""
    now = runtime_settings.current()
    default = tuple(int(now[name]) for name in names)
    reference = None
    for setting in [default] + [setting for setting in values if setting != default]:
        runtime_settings.apply(tuple(f"{name}={value}" for name, value in zip(names, setting)))
        ms, out = graphed(call, replays)
        out = out.float()
        reference = out if reference is None else reference
        print(json.dumps({"kernel": kernel, "tokens": tokens, "setting": dict(zip(names, setting)),
                          "runtime": setting == default, "us": round(ms * 1e3, 2),
                          "gb_per_s": round(moved / (ms * 1e-3) / 1e9, 1),
                          "max_difference": (out - reference).abs().max().item()}), flush=True)
    runtime_settings.restore(now)


# `_chunk_walk`'s arguments that are not compile-time constants, typed as `_chunk_path` passes
# them for bf16 q, k and v (W and Hs in q's dtype; U and the decays float32). The states,
# parents and final state are unread in the variant compiled (INITIAL and FINAL off).
WALK_TYPES = {"k": "*bf16", "W": "*bf16", "U": "*fp32", "Gc": "*fp32", "Hs": "*bf16", "states": "*bf16",
              "parents": "*i32", "final": "*bf16", "cu_seqlens": "*i32", "G": "i32", "route": "*i32"}


def walk_resources(values: tuple[int, ...] = (16, 32), warps: int = 4) -> None:
    """What the 64-token walk (`scan._chunk_walk`) asks of a Hopper multiprocessor, compiled for
    sm_90 by the installed Triton's ptxas, no GPU needed: registers a thread, stack (spilled
    registers), Triton's shared memory, for each block of `values` value columns a program, the
    Qwen3.5-0.8B heads (16 of 128, bf16), pipelined as the runtime's walk is (`scan.WALK_STAGES`).
    The variant compiled walks from zero states and keeps no final state, unrouted (INITIAL, FINAL
    and ROUTED off), its pointers 16-byte aligned as a launch on torch's tensors marks them. Needs
    Triton with its NVIDIA tools (ptxas, cuobjdump); the GPU machine's Triton may differ from this
    one: a lead for a profile, not a timing.

        python benchmarks/run.py walk_resources --values 16 32

    Prints one JSON line a variant.
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from ..ops.delta_rule import scan

    kernel = scan._chunk_walk
    signature = {name: WALK_TYPES.get(name, "constexpr") for name in kernel.arg_names}
    aligned = {(index,): [["tt.divisibility", 16]] for index, name in enumerate(kernel.arg_names)
               if signature[name].startswith("*")}
    for block in values:
        constants = dict(H=HEADS, K=HEAD_DIM, HV=HEADS, V=HEAD_DIM, BK=HEAD_DIM, BV=block, INITIAL=False,
                         FINAL=False, ROUTED=False, STAGES=scan.WALK_STAGES)
        source = ASTSource(fn=kernel, signature=signature, attrs=aligned,
                           constexprs={(kernel.arg_names.index(name),): value for name, value in constants.items()})
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
        found = dict(re.findall(r"\b(REG|STACK):(\d+)", _resource_usage(compiled.asm["cubin"])))
        print(json.dumps({"kernel": "_chunk_walk", "values_a_program": block, "warps": warps,
                          "registers": int(found["REG"]), "stack_bytes": int(found["STACK"]),
                          "shared_bytes": compiled.metadata.shared, "triton": triton.__version__}), flush=True)


def _resource_usage(cubin: bytes) -> str:
    """cuobjdump's resource usage of a compiled kernel (Triton's own, or `TRITON_CUOBJDUMP_PATH`)."""
    import triton

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "kernel.cubin"
        path.write_bytes(cubin)
        return subprocess.run([triton.knobs.nvidia.cuobjdump.path, "--dump-resource-usage", str(path)],
                              capture_output=True, text=True, check=True).stdout
