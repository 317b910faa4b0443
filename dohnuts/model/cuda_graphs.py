"""CUDA graphs of the inference forward: a request layout seen again replays a captured graph.

On the H200 the language forward of a small request is launch-bound: the GPU works for about
3 ms while the host spends 50 ms or more issuing kernels, most of it in flash-linear-
attention's Python wrappers (docs/runtime.md). A captured graph replays every kernel of the
forward with one launch. Everything that decides on the host (the image-feature cache,
FLA's chunk planning from the host `cu_seqlens` copies, attention's longest sequences)
depends only on the batch layout, so one graph per layout serves every request of that
layout: a replay copies the new embeddings and index tensors into the graph's inputs.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict

import torch

from ..ops import kernels
from .batch import Batch

# The batch fields `DecisionModel.scores` reads on the device (plus the fork); the others
# (token ids, pixels, image slots) only feed the eager embeddings. The plan fields hold values
# `layout_key` fixes (the cu_seqlens and the chunks made from them), so a graph keeps its own;
# a replay copies the rest.
PLAN_FIELDS = ("prefix_cu_seqlens", "cu_seqlens", "prefix_chunk_indices", "chunk_indices")
GRAPH_FIELDS = ("position_ids", "markers", "candidate_mask") + PLAN_FIELDS


def _inputs(embeds: torch.Tensor, batch: Batch) -> list[torch.Tensor]:
    """What a replay copies into the graph: everything it reads but the plan."""
    tensors = [embeds] + [getattr(batch, name) for name in GRAPH_FIELDS if name not in PLAN_FIELDS]
    if batch.fork is not None:
        tensors += batch.fork.tensors()
    return tensors


def layout_key(batch: Batch) -> tuple:
    """Everything the captured work depends on besides tensor contents: the shapes of the
    graph's inputs and the values of the host-side plan."""
    key = [batch.prefix_tokens, tuple(batch.prefix_cu_seqlens_cpu.tolist()), tuple(batch.cu_seqlens_cpu.tolist()),
           tuple(batch.input_ids.shape)]
    key += [(name, tuple(getattr(batch, name).shape)) for name in GRAPH_FIELDS]
    if batch.fork is not None:
        key.append(("fork", tuple(batch.fork.key_index.shape), *batch.fork.plan()))
    return tuple(key)


class _Graph:
    """One captured `scores` call with its static inputs and output."""

    def __init__(self, model, embeds: torch.Tensor, batch: Batch, pool):
        self.embeds = embeds.clone()
        static = {name: getattr(batch, name).clone() for name in GRAPH_FIELDS}
        if batch.fork is not None:
            static["fork"] = batch.fork.map(torch.clone)
        self.batch = dataclasses.replace(batch, **static)  # the *_cpu plan is shared and constant
        side = torch.cuda.Stream(embeds.device)
        side.wait_stream(torch.cuda.current_stream())
        # FLA memoises plans derived from a cu_seqlens tensor (chunk offsets and the like) by
        # that tensor's identity. The warm-ups leave no memo entry for this graph's own plan
        # tensors, so inside the capture the first layer derives each plan (in the graph,
        # which then owns it) and the other layers reuse it: about 200 fewer kernels in a
        # 50-row forward than deriving it in every layer. No entry made outside the capture
        # can be read by it, because no other call ever passes these tensors.
        # Keep it so: nothing but a replay may run the model on self.batch after the capture,
        # or it would read the capture's plans, which only a replay fills.
        with kernels.uncached_plans(), torch.cuda.stream(side):
            for _ in range(2):  # kernels autotune and compile outside the capture
                model.scores(self.embeds, self.batch)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.output = model.scores(self.embeds, self.batch)

    def replay(self, embeds: torch.Tensor, batch: Batch) -> torch.Tensor:
        for static, value in zip(_inputs(self.embeds, self.batch), _inputs(embeds, batch)):
            static.copy_(value)
        self.graph.replay()
        return self.output.clone()  # graphs share a memory pool: the next replay may reuse it


class GraphedScores:
    """`model.scores` through CUDA graphs for inference on CUDA; any other call runs eagerly.

    A layout is captured the second time it is seen (a one-off layout never pays for a
    capture) and kept in an LRU of `capacity` graphs sharing one memory pool. A layout whose
    capture fails runs eagerly from then on, and the failure is logged once. Graphs are
    dropped when the model's `generation` changes (a device or dtype move, or modules
    replaced, e.g. LoRA injected) and when any parameter changes in place (a graph reads the
    weights themselves, but also constants `kernels.derived` made from them).
    """

    def __init__(self, model, capacity: int = 8, remembered: int = 1024):
        self.model = model
        self.capacity = capacity
        self.remembered = remembered
        self.graphs: OrderedDict[tuple, _Graph] = OrderedDict()
        self.seen: OrderedDict[tuple, None] = OrderedDict()
        self.failed: set[tuple] = set()
        self.pool = None
        self.generation, self.parameters, self.versions = None, [], None
        self.stats = {"eager": 0, "captures": 0, "replays": 0, "failed": 0}

    def __call__(self, batch: Batch) -> torch.Tensor:
        model = self.model
        embeds = model.embeddings(batch)
        if not embeds.is_cuda or model.training or torch.is_grad_enabled():
            self.stats["eager"] += 1
            return model.scores(embeds, batch)
        if model.generation != self.generation:
            self.generation, self.parameters, self.versions = model.generation, list(model.parameters()), None
        versions = tuple(parameter._version for parameter in self.parameters)
        if versions != self.versions:
            self.graphs.clear()
            self.seen.clear()
            self.failed.clear()
            self.versions = versions
        key = layout_key(batch)
        graph = self.graphs.get(key)
        if graph is None and key in self.seen and key not in self.failed:
            graph = self._capture(key, embeds, batch)
        if graph is not None:
            self.graphs.move_to_end(key)
            self.stats["replays"] += 1
            return graph.replay(embeds, batch)
        self.seen[key] = None
        self.seen.move_to_end(key)
        if len(self.seen) > self.remembered:
            self.seen.popitem(last=False)
        self.stats["eager"] += 1
        return model.scores(embeds, batch)

    def _capture(self, key: tuple, embeds: torch.Tensor, batch: Batch) -> _Graph | None:
        if not self.graphs:
            # A pool handle may be shared only while a graph captured into it lives: the
            # allocator refuses (an internal assert) a capture into a pool whose graphs are
            # all gone but which still holds a block, such as a plan FLA's memo kept from
            # the last capture. So a capture with no live graph starts a fresh pool.
            self.pool = torch.cuda.graph_pool_handle()
        try:
            graph = _Graph(self.model, embeds, batch, self.pool)
        except Exception as error:  # noqa: BLE001 - any capture failure falls back to eager
            self.failed.add(key)
            self.stats["failed"] += 1
            kernels.slow_path("cuda-graph-capture", f"a CUDA graph capture failed (a layout of "
                                                    f"{int(batch.input_ids.shape[0])} tokens), so that layout runs "
                                                    f"eagerly: {type(error).__name__}: {error}")
            torch.cuda.synchronize()
            return None
        self.stats["captures"] += 1
        self.graphs[key] = graph
        if len(self.graphs) > self.capacity:
            self.graphs.popitem(last=False)
        return graph
