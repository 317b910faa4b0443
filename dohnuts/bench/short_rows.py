"""The delta rule of the 50-question request's short rows on the GPU, three ways, each replayed
from a CUDA graph: a measurement for choosing the next optimisation, not part of the runtime."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..ops import kernels
from ..ops.plan import CHUNK, chunk_plan, cumulative
from .host import require_cuda, warmed_predictor


def row_lengths() -> list[int]:
    """The rows' own lengths (after the shared prefix) of the distinct_text_50q request, as the
    benchmark's predictor packs them."""
    predictor, state, questions = warmed_predictor("distinct_text_50q")
    batch, _ = predictor.encode(state, questions)
    return (batch.cu_seqlens_cpu[1:] - batch.cu_seqlens_cpu[:-1]).tolist()


def graphed(call, replays: int = 200) -> tuple[float, torch.Tensor]:
    """(mean ms per replay of `call` captured in a CUDA graph, its output)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), kernels.uncached_plans():
        for _ in range(3):
            call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / replays, out.clone()


@torch.no_grad()
def delta_rule_short_rows(*, fused_recurrent) -> None:
    """Time the delta rule of the 50-question request's rows on the GPU, three ways: FLA's chunked
    kernels (what `kernels.chunk_gated_delta_rule` runs, after forking the prefix's state to the
    rows), FLA's fused recurrent kernel (forward only, one program per sequence, head and 8 values,
    stepping token by token, on the forked states) and our `delta_rule.rows.delta_rule_rows` (forward
    only, one program per row, head and block of values, reading the prefix's state through the
    row's parent index) in a few launch settings.

        python benchmarks/run.py delta_rule_short_rows > delta-rule-short-rows.txt

    `fused_recurrent` is FLA's `fused_recurrent_gated_delta_rule`, handed in by the caller (only
    `dohnuts.ops` imports FLA). Shape: the Qwen3.5-0.8B delta-rule layer (16 key and 16 value
    heads of width 128), bf16, and the rows' own lengths of the distinct_text_50q request, packed.
    Each variant, including any fork of the prefix's final state to the rows, is captured in a
    CUDA graph and replayed 200 times; it prints the mean per replay and the largest difference
    of each output from the chunked one, relative to the largest chunked output.
    """
    require_cuda()
    lengths = row_lengths()
    heads, width, total = 16, 128, sum(lengths)
    generator = torch.Generator(device="cuda").manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=generator, device="cuda")

    q = F.normalize(rand(1, total, heads, width), dim=-1).bfloat16()
    k = F.normalize(rand(1, total, heads, width), dim=-1).bfloat16()
    v = rand(1, total, heads, width).bfloat16()
    g = rand(1, total, heads).bfloat16()  # raw gate input: the kernels apply A_log and dt_bias
    beta = torch.sigmoid(rand(1, total, heads)).bfloat16()
    A_log, dt_bias = rand(heads).float() * 0.5, rand(heads).float() * 0.5
    prefix_state = rand(1, heads, width, width) * 0.1  # one prefix's final state, float32
    parents = torch.zeros(len(lengths), dtype=torch.long, device="cuda")
    bounds_cpu = cumulative(lengths)
    bounds, plan = bounds_cpu.cuda(), chunk_plan(lengths).cuda()  # int32, as the decoder passes them
    gate = {"use_gate_in_kernel": True, "A_log": A_log, "dt_bias": dt_bias}

    def chunked():
        out, _ = kernels.chunk_gated_delta_rule(q, k, v, g, beta, prefix_state[parents], False, bounds, False,
                                                bounds_cpu, plan, A_log, dt_bias)
        return out

    def recurrent():
        out, _ = fused_recurrent(q, k, v, g, beta=beta, initial_state=prefix_state[parents],
                                 output_final_state=False, cu_seqlens=bounds, **gate)
        return out

    def fork_only():
        return prefix_state[parents]

    from ..ops.delta_rule import rows as ops  # our Triton kernel and its launch settings

    def rows():
        return ops.delta_rule_rows(q[0], k[0], v[0], g[0], beta[0], prefix_state, parents, bounds, max(lengths),
                                   A_log, dt_bias)[None]

    variants = [("fork of the prefix state only", fork_only), ("chunked (FLA chunk_gated_delta_rule)", chunked),
                ("fused recurrent (FLA, forward only)", recurrent)]
    for values, warps in ((64, 4), (32, 4), (64, 8), (128, 8), (32, 2)):
        def setting(call=rows, values=values, warps=warps):
            ops.VALUES, ops.ROW_WARPS = values, warps
            return call()
        variants.append((f"rows kernel ({values} values, {warps} warps)", setting))

    print(f"# {len(lengths)} rows, {total} tokens (own lengths {min(lengths)} to {max(lengths)}), "
          f"{heads} heads of width {width}, bf16; CUDA graph replays")
    results, defaults = {}, (ops.VALUES, ops.ROW_WARPS)
    try:
        for name, call in variants:
            ms, out = graphed(call)
            results[name] = out
            print(f"{name:40s} {ms * 1e3:8.1f} us per replay")
    finally:
        ops.VALUES, ops.ROW_WARPS = defaults  # the settings the runtime launches with
    chunked_out = results["chunked (FLA chunk_gated_delta_rule)"].float()
    for name, out in results.items():
        if out.shape == chunked_out.shape:
            print(f"max |chunked - {name}| / max |chunked| = "
                  f"{((chunked_out - out.float()).abs().max() / chunked_out.abs().max()).item():.2e}")


@torch.no_grad()
def delta_rule_prefixes(lengths: tuple[int, ...] = (256, 1024, 2048), together: tuple[int, ...] = (1, 2, 4, 8),
                        sets: tuple[str, ...] = (), only: tuple[str, ...] = ()) -> None:
    """Time `delta_rule.scan.delta_rule_scan` on prefixes from zero states keeping their final
    states (a prefix's layer in a bucket), each replayed from a CUDA graph: each count of
    `together` sequences of each of `lengths` tokens, then each of `sets` (sequences of unequal
    lengths run together, "700,200,90": a request's long rows), by each of its paths (the parts solved
    apart, 1 or 4 a program, then walked with blocks of 16, 32 or 64 values, pipelined in 1 to 3
    stages, with 2 or 4 warps; 64-token chunks solved whole and walked, `WALK_CHUNK`; the
    one-kernel walk, with the runtime's blocks of values and warps and with others, `FWD_VALUES`
    and `FWD_WARPS`), whatever
    the count would choose (`PARTS_BELOW`); `only` keeps the paths whose names contain one of
    its texts. Shape: the Qwen3.5-0.8B delta-rule layer (16 key and
    16 value heads of width 128), bf16. Prints microseconds a layer and tokens a microsecond,
    marks the path the runtime takes (one sequence of `ALONE_FROM` to `ALONE_TO` tokens: 64-token
    steps of `ALONE_VALUES` values, `one_long`, as it runs eagerly or in a one-row bucket; a
    prefix in a routed bucket keeps the 16-token walk), and gives each path's largest output
    difference from the first's.

        python benchmarks/run.py delta_rule_prefixes --lengths 1024 2048 --together 1 2 4 8 --sets 700,200,90

    Raises:
        ValueError: a set that is not lengths joined by commas.
    """
    packs = [[length] * count for count in together for length in lengths]
    for given in sets:
        try:
            packs.append([int(length) for length in given.split(",")])
        except ValueError:
            raise ValueError(f"a set is lengths joined by commas, like 700,200,90: got {given!r}") from None
    require_cuda()
    from ..ops.delta_rule import scan as ops

    heads, width = 16, 128
    generator = torch.Generator(device="cuda").manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=generator, device="cuda")

    # (name, {setting of `scan`: value}): the parts solved apart, then walked, and the one-kernel walk
    names = ("WALK_VALUES", "PARTS_BELOW", "PARTS_A_PROGRAM", "WALK_STAGES", "WALK_WARPS", "WALK_CHUNK", "SOLVE_WARPS",
             "FWD_VALUES", "FWD_WARPS", "VALUES", "ROW_WARPS")
    defaults = {name: getattr(ops, name) for name in names}
    paths = [(f"parts {split} a program, walk values {values}, stages {stages}, warps {warps}",
              {**defaults, "WALK_VALUES": values, "PARTS_BELOW": 2**31, "PARTS_A_PROGRAM": split,
               "WALK_STAGES": stages, "WALK_WARPS": warps})
             for split, values, stages, warps in ((1, 32, None, 4), (4, 32, None, 4), (1, 64, None, 4),
                                                  (1, 32, 1, 4), (1, 32, 2, 4), (1, 32, 3, 4), (1, 32, None, 2),
                                                  (1, 32, 2, 2), (1, 16, 2, 2))]
    paths += [(f"64-token chunks solved whole ({solve} warps), walk values {values}, warps {warps}",
               {**defaults, "WALK_VALUES": values, "PARTS_BELOW": 2**31, "WALK_CHUNK": 64, "SOLVE_WARPS": solve,
                "WALK_WARPS": warps})
              for solve, values, warps in ((4, 32, 4), (2, 32, 4), (4, 16, 4), (4, 64, 8))]
    # The same with the walk's 16 values (one long sequence's path), varying the others' launches:
    # the inverse's warps, the values and warps a program of W and U and of the outputs
    # (`VALUES`, `ROW_WARPS`), the walk's pipeline stages and warps.
    paths += [(f"64-token chunks, solve warps {solve}, W U and outputs values {values} warps {rows}, walk 16 "
               f"values, stages {stages}, warps {warps}",
               {**defaults, "WALK_VALUES": 16, "PARTS_BELOW": 2**31, "WALK_CHUNK": 64, "SOLVE_WARPS": solve,
                "VALUES": values, "ROW_WARPS": rows, "WALK_STAGES": stages, "WALK_WARPS": warps})
              for solve, values, rows, stages, warps in (
                  (2, 64, 4, None, 4), (8, 64, 4, None, 4), (4, 32, 4, None, 4), (4, 128, 4, None, 4),
                  (4, 128, 8, None, 4), (4, 64, 8, None, 4), (4, 32, 2, None, 4), (4, 64, 4, 1, 4), (4, 64, 4, 3, 4),
                  (4, 64, 4, None, 2), (4, 64, 4, None, 8))]
    paths.append(("one kernel", {**defaults, "PARTS_BELOW": 0}))
    paths += [(f"one kernel, values {values}, warps {warps}",
               {**defaults, "PARTS_BELOW": 0, "FWD_VALUES": values, "FWD_WARPS": warps})
              for values, warps in ((32, 4), (32, 2), (64, 8), (128, 8), (16, 2))
              if (values, warps) != (defaults["FWD_VALUES"], defaults["FWD_WARPS"])]
    paths = [path for path in paths if not only or any(text in path[0] for text in only)]
    print(f"# {heads} heads of width {width}, bf16, from zero states, final states kept; CUDA graph replays; "
          f"the runtime takes the one-kernel walk from {ops.PARTS_BELOW} sequences (in a bucket, from "
          f"{ops.PARTS_BELOW} sequences over 64 tokens, counted on the device)")
    try:
        for pack in packs:
            count, total = len(pack), sum(pack)
            label = (f"{count} x {pack[0]:5d} tokens" if len(set(pack)) == 1
                     else f"{'+'.join(map(str, pack))} tokens" if count <= 8
                     else f"{count} sequences of {total} tokens, the longest {max(pack)}")
            q, k = (F.normalize(rand(total, heads, width), dim=-1).bfloat16() for _ in range(2))
            v = rand(total, heads, width).bfloat16()
            g, beta = rand(total, heads).bfloat16(), torch.sigmoid(rand(total, heads)).bfloat16()
            A_log, dt_bias = rand(heads).float() * 0.5, rand(heads).float() * 0.5
            bounds = cumulative(pack).cuda()
            # The chunk plan made ahead, as inference batches carry it: the scan would otherwise
            # read the bounds back to the host, which a graph capture cannot do.
            plan = chunk_plan(pack).cuda()
            first = None
            # In a bucket the route picks the path on the device (`_scan_route`), by the defaults.
            to_parts = ops.routes_to_parts(pack)
            for name, settings in paths:
                for setting, value in settings.items():
                    setattr(ops, setting, value)

                def scan(arguments=(q, k, v, g, beta, None, None, bounds, True, A_log, dt_bias), plan=plan):
                    out, final = ops.delta_rule_scan(*arguments, chunks=plan)
                    return torch.cat([out.flatten().float(), final.flatten()])

                ms, out = graphed(scan, replays=50)
                first = out if first is None else first
                gap = ((out - first).abs().max() / first.abs().max()).item()
                if not to_parts:
                    taken = settings == {**defaults, "PARTS_BELOW": 0}
                elif ops.walks_alone(count, max(pack), routed=False):
                    taken = settings == {**defaults, "PARTS_BELOW": 2**31, "WALK_CHUNK": CHUNK,
                                         "WALK_VALUES": ops.ALONE_VALUES}
                else:
                    taken = settings == {**defaults, "PARTS_BELOW": 2**31}
                print(f"{label}, {name:58s}: {ms * 1e3:8.1f} us a layer, "
                      f"{total / (ms * 1e3):7.1f} tokens/us, max difference {gap:.1e}{' (taken)' if taken else ''}",
                      flush=True)
    finally:
        for setting, value in defaults.items():
            setattr(ops, setting, value)
