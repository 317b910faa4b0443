"""CUDA graphs of the inference forward: a request layout that recurs replays a captured graph.

On the H200 the language forward of a small request is launch-bound: the GPU works for about
3 ms while the host spends 50 ms or more issuing kernels, most of it in flash-linear-
attention's Python wrappers (docs/changelog.md). A captured graph replays every kernel of the
forward with one launch. Everything that decides on the host (the image-feature cache,
FLA's chunk planning from the host `cu_seqlens` copies, attention's longest sequences)
depends only on the batch layout, so one graph per layout serves every request of that
layout: a replay copies the new embeddings and index tensors into the graph's inputs.
"""

from __future__ import annotations

import logging
import operator
from collections import OrderedDict

import torch

from ..inputs.batch import PACKED_BYTES, Batch, move_packed, packed_layout, packed_views
from ..model.decision import plan_segments
from ..model.decoder import (
    Prefixes,
    attention_core,
    attention_inputs,
    attention_output,
    delta_layer,
    final_norm,
    input_norm,
    mlp_block,
    rotary_tables,
)
from ..ops import kernels
from .buckets import Ladder, all_buckets, bucket_for, empty_batch, pad_to_bucket, padding_tokens, rank
from .progress import Progress

# The batch fields `DecisionModel.scores` reads on the device (plus the fork); the others
# (token ids, pixels, image slots) only feed the eager embeddings. The plan fields hold values
# `layout_key` fixes (the cu_seqlens and the chunks made from them), so a graph keeps its own;
# a replay copies the rest.
PLAN_FIELDS = ("prefix_cu_seqlens", "cu_seqlens", "prefix_chunk_indices", "chunk_indices")
GRAPH_FIELDS = ("position_ids", "markers", "candidate_mask") + PLAN_FIELDS


def _inputs(embeds: torch.Tensor | None, batch: Batch) -> list[torch.Tensor]:
    """What a replay copies into the graph: everything it reads but the plan; the token ids
    where the graph looks up the embeddings itself (`embeds` None)."""
    tensors = [batch.input_ids if embeds is None else embeds]
    tensors += [getattr(batch, name) for name in GRAPH_FIELDS if name not in PLAN_FIELDS]
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
        key.append(("fork", *(tuple(tensor.shape) for tensor in batch.fork.tensors()), *batch.fork.plan()))
    return tuple(key)


logger = logging.getLogger(__name__)
_VERSION = operator.attrgetter("_version")  # a tensor's in-place version counter
CAPTURE_AT = 3  # the sighting of a layout that captures its graph
BUCKET_MEMORY = 0.4  # the share of the device's memory the bucket graphs may hold
# Eager forwards of a bucket before its capture, on a side stream, so that what a capture may not
# do (compile or tune a kernel, plan a cuBLAS call, grow the allocator's pools) happens before it.
# Each costs about a third of a bucket's preparation; on trial (`bench.settings`
# "graphs.WARM_UPS"): whether one suffices, every bucket still captured and no request compiling.
WARM_UPS = 2
# Whether a bucket with prefixes is one graph, attention captured with the rest (its fork
# planned by chunk, `plan.ChunkedFork`), or pieces between attention layers, attention eager
# between them (`bench.settings` "graphs.WHOLE_BUCKETS" off, to compare). A one-row bucket is
# always one graph.
WHOLE_BUCKETS = True


class _PackedInputs:
    """A graph's device inputs: every tensor of the batch it was captured on (`device_tensors`,
    the fork's too) in one byte buffer (`packed_layout`), so a host batch of the same shapes
    moves straight into them in one copy (`load`) and a replay copies nothing more."""

    def __init__(self, batch: Batch, device: torch.device):
        tensors = batch.device_tensors()
        self.shapes = [(tensor.shape, tensor.dtype) for tensor in tensors]
        self.offsets, self.bytes = packed_layout(tensors)
        self.buffer = torch.empty(max(self.bytes, 1), dtype=torch.uint8, device=device)
        self.tensors = [view.copy_(tensor) for view, tensor in zip(packed_views(self.buffer, tensors, self.offsets),
                                                                   tensors)]
        self.batch = self.own(batch)  # the *_cpu plan is shared and constant

    def load(self, batch: Batch) -> Batch | None:
        """A host batch of these shapes moved straight into the inputs (one copy, `move_packed`):
        the batch on the device, its tensors the inputs. None when a tensor's shape or dtype
        differs (an image of another size) or the batch is large or not contiguous: it then moves
        as usual."""
        if self.bytes > PACKED_BYTES:
            return None
        tensors = []
        owned = self.own(batch, tensors)  # one walk over the fields: their tensors, and the batch on ours
        if ([(tensor.shape, tensor.dtype) for tensor in tensors] != self.shapes
                or not all(tensor.is_contiguous() for tensor in tensors)):
            return None
        move_packed(tensors, self.buffer, self.offsets, self.bytes)
        return owned

    def own(self, batch: Batch, found: list | None = None) -> Batch:
        """`batch` with the input tensors in place of its tensors, in order (each of its own
        appended to `found`)."""
        placed = iter(self.tensors)

        def swap(tensor):
            if found is not None:
                found.append(tensor)
            return next(placed, tensor)

        return batch.map_tensors(swap)


class _Arena:
    """Device buffers the bucket graphs share: what a bucket's pieces pass between them (each
    piece's outputs, the attention cores' outputs) and its embeddings. Only one bucket replays
    at a time, on one stream, and these live from one piece to the next within a replay, so one
    buffer a role (`take`'s key) serves every bucket: a bucket's views are the first of its
    elements. Kept a bucket each, they held most of the bucket graphs' memory: about 150 KB a
    token of the Qwen3.5-0.8B shape, 38.7 GiB for the 119 buckets of 2026-12-04.

    `tokens` bounds the buckets it serves at first; a larger one gets a buffer of its own size
    (the smaller buffer stays with the graphs that read it)."""

    def __init__(self, device: torch.device, tokens: int):
        self.device, self.tokens = device, tokens
        self.buffers: dict = {}

    def take(self, key, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        """A zeroed view of `shape` ([tokens, ...]) at the start of the buffer of `key`. Call it
        outside a capture: a buffer made in one would be the capture's pool's."""
        per_token = 1
        for size in shape[1:]:
            per_token *= size
        numel = shape[0] * per_token
        buffer = self.buffers.get((key, dtype))
        if buffer is None or buffer.numel() < numel:
            buffer = torch.empty(max(self.tokens, shape[0]) * per_token, dtype=dtype, device=self.device)
            self.buffers[(key, dtype)] = buffer
        return buffer[:numel].view(shape).zero_()


def _copy_in(statics, values) -> None:
    """Each value into its static tensor, but where it is that tensor (loaded into the inputs)."""
    for static, value in zip(statics, values):
        if static.data_ptr() != value.data_ptr():
            static.copy_(value)


class _Graph:
    """One captured `scores` call with its static inputs and output."""

    def __init__(self, model, embeds: torch.Tensor, batch: Batch, pool):
        # A text batch's embeddings are a lookup of its token ids, which the graph does itself:
        # a replay then launches nothing before it and copies no embeddings. An image batch's
        # come in: their image features are the cache's, found on the host.
        self.text = not batch.image_keys
        self.embeds = None if self.text else embeds.clone()
        # A host batch of the same shapes moves straight into the graph's inputs in one copy
        # (`load`), and the replay copies only the embeddings.
        self.inputs = _PackedInputs(batch, embeds.device)
        self.batch = self.inputs.batch
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
                self._forward(model)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with kernels.holding_derived() as self.derived, torch.cuda.graph(self.graph, pool=pool):
            self.output = self._forward(model)

    def _forward(self, model) -> torch.Tensor:
        embeds = model.embeddings(self.batch) if self.text else self.embeds
        return model.scores(embeds, self.batch)

    @property
    def tensors(self) -> list[torch.Tensor]:
        return self.inputs.tensors

    def load(self, batch: Batch) -> Batch | None:
        """A host batch of this graph's layout moved straight into its inputs (`_PackedInputs.load`)."""
        return self.inputs.load(batch)

    def replay(self, embeds: torch.Tensor | None, batch: Batch) -> torch.Tensor:
        """Logits of `batch`, whose `embeds` a text graph ignores (None will do)."""
        if self.text:
            embeds = None
        _copy_in(_inputs(self.embeds, self.batch), _inputs(embeds, batch))
        self.graph.replay()
        return self.output.clone()  # graphs share a memory pool: the next replay may reuse it


class _BucketGraph:
    """A bucket's forward (`dohnuts.model.buckets`) as one CUDA graph (`whole`), or as one per
    stretch of layers between attention cores, which then run eagerly between the replays.

    Whole, every shape its work takes is the bucket's. A bucket with prefixes plans its rows'
    fork by 64-token chunk (`plan.ChunkedFork`): attention's two flash calls have the bucket's
    chunks as their grid, whatever the batch's rows (`kernels.chunked_fork_attention`). A
    one-row bucket has no prefix, so each sequence's keys are its own tokens: the whole bucket
    as one causal sequence (`attention.DENSE_LONE`, the padding seeing the row's keys, which no
    candidate reads), or with it off each sequence planned for up to the bucket's row tokens
    (flash attention skips the blocks past a sequence's end). One launch where the pieces take
    thirteen, and no attention planned on the host between them. Only its logits outlive the
    capture: what the forward made on the way goes back to the pool the bucket graphs share,
    for the next capture (replays run one at a time, each read before the next).

    In pieces (`WHOLE_BUCKETS` off, to compare), piece j replays the output side of attention
    layer j - 1 (its gate, projection and MLP), the delta-rule layers up to attention layer j,
    and that layer's norm and projections; the last piece ends with the final norm and the head
    at the markers. Each piece's outputs pass to the next through buffers every bucket shares
    (`_Arena`); what a piece makes on the way goes back to the memory pool the bucket graphs
    share. For a one-row bucket the device is the bound, not the host: on the H200 a 1,287-token
    question took 9.79 ms (p50) whole against 9.91 in pieces, 2,787 tokens 15.94 against 16.05
    (alternated in one process, docs/changelog.md)."""

    FIELDS = ("position_ids", "prefix_cu_seqlens", "cu_seqlens", "prefix_chunk_indices", "chunk_indices", "markers",
              "candidate_mask")

    def __init__(self, model, bucket, batch: Batch, pool, arena: _Arena):
        language = model.backbone.language_model
        self.model, self.bucket, self.config = model, bucket, language.config
        self.layers = language.layers
        self.attention = [index for index, kind in enumerate(self.config.layer_types) if kind == "full_attention"]
        self.whole = bucket.single or WHOLE_BUCKETS
        # Every padded batch of the bucket has these shapes: a text one moves straight in (`load`).
        self.inputs = _PackedInputs(batch, batch.input_ids.device)
        self.static = self.inputs.batch
        self.fork = self.static.fork
        self.embeds = arena.take("embeds", (bucket.tokens, self.config.hidden_size),
                                 language.get_input_embeddings().weight.dtype)
        self.rows, self.prefixes = plan_segments(self.static)
        heads, head_dim = self.config.num_attention_heads, self.config.head_dim
        # Each attention core's output: copied into the arena between pieces, made in the graph
        # when whole.
        self.attended = [None if self.whole else arena.take(("attended", index), (bucket.tokens, heads, head_dim),
                                                            self.embeds.dtype)
                         for index in range(len(self.attention))]
        self.outputs: list = []
        side = torch.cuda.Stream(self.embeds.device)
        side.wait_stream(torch.cuda.current_stream())
        with kernels.uncached_plans(), torch.cuda.stream(side):
            for _ in range(WARM_UPS):  # kernels compile and autotune, cuBLAS plans, outside the capture
                self._forward(batch.fork)
        torch.cuda.current_stream().wait_stream(side)
        # The graphs hold the constants derived from weights they read (`kernels.holding_derived`):
        # a replay launched before an in-place change is noticed (`GraphedScores._replay_bucket`)
        # still reads memory of its own.
        with kernels.holding_derived() as self.derived:
            if self.whole:
                self.graphs = [torch.cuda.CUDAGraph()]
                with torch.cuda.graph(self.graphs[0], pool=pool):
                    self._forward(self.fork)
                self.outputs, self.attended = self.outputs[-1:], [None] * len(self.attention)  # the logits alone
            else:
                # Each piece's outputs pass through the arena, so what the graph makes on the way
                # (those outputs included) goes back to the pool, for the next capture.
                passed = [[arena.take((index, slot), tensor.shape, tensor.dtype) for slot, tensor in enumerate(outputs)]
                          for index, outputs in enumerate(self.outputs[:-1])]
                self.graphs, self.outputs = [], []
                for index in range(len(self.attention) + 1):
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool):
                        self.outputs.append(self._piece(index, passed[index] if index < len(passed) else None))
                    self.graphs.append(graph)
        # A graph's first launch uploads it to the device: here, not on a request (`prepare`
        # waits for the device after the last bucket).
        self.replay(self.embeds, self.static)

    def _forward(self, fork) -> None:
        """Every piece in turn, attending between them through `fork`: `outputs` made anew."""
        self.outputs = []
        for index in range(len(self.attention) + 1):
            self.outputs.append(self._piece(index))
            if index < len(self.attention):
                self._attend(index, fork)

    def _piece(self, index: int, into: list[torch.Tensor] | None = None):
        """Piece `index` over the static inputs and the previous piece's outputs: (hidden, q, k,
        v, gate, cos, sin) before attention layer `index` (copied `into` those tensors if given),
        or the logits after the last."""
        config, layers, attention = self.config, self.layers, self.attention
        if index == 0:
            cos, sin = rotary_tables(config, self.static.position_ids, self.embeds.dtype)
            (hidden, branch), first = (self.embeds, None), 0
        else:
            hidden, _, _, _, gate, cos, sin = self.outputs[index - 1]
            layer = layers[attention[index - 1]]
            hidden, branch = mlp_block(layer, config, hidden,
                                       attention_output(layer.self_attn, self.attended[index - 1], gate))
            first = attention[index - 1] + 1
        last = attention[index] if index < len(attention) else len(layers)
        for layer in layers[first:last]:  # delta-rule layers only: pieces end at attention layers
            hidden, branch = delta_layer(layer, config, hidden, branch, self.rows, self.prefixes, False)
        if index == len(attention):
            # A bucket's markers, [rows, 64], outnumber its row tokens about eight times, so its last
            # layer runs whole and the states are picked after the final norm (`decoder.picks_early`).
            rows = final_norm(self.model.backbone.language_model, hidden, branch, self.static.prefix_tokens)
            return self.model.logits(rows[self.static.markers.flatten()], self.static.candidate_mask)
        layer = layers[last]
        hidden, normed = input_norm(layer, config, hidden, branch)
        outputs = (hidden, *attention_inputs(layer.self_attn, config, normed, cos, sin), cos, sin)
        if into is None:
            return outputs
        for kept, made in zip(into, outputs, strict=True):
            kept.copy_(made)
        return tuple(into)

    def _attend(self, index: int, fork) -> None:
        _, query, key, value, _, _, _ = self.outputs[index]
        prefixes = Prefixes(self.static.prefix_tokens, self.prefixes.segments, fork) if fork is not None else None
        out = attention_core(self.config, query, key, value, self.rows, prefixes)
        if self.whole:
            self.attended[index] = out
        else:
            self.attended[index].copy_(out)

    def load(self, batch: Batch) -> Batch | None:
        """A padded host batch moved straight into the graph's inputs (`_PackedInputs.load`)."""
        return self.inputs.load(batch)

    def replay(self, embeds: torch.Tensor, batch: Batch) -> torch.Tensor:
        """Logits [rows, candidates] of a padded batch of this bucket (on the device)."""
        self.embeds.copy_(embeds)
        fields = [getattr(self.static, name) for name in self.FIELDS], [getattr(batch, name) for name in self.FIELDS]
        _copy_in(*fields)
        if self.fork is not None:  # the whole graph reads all of it; the pieces the delta rule's parents
            _copy_in(*((self.fork.tensors(), batch.fork.tensors()) if self.whole else
                       ([self.fork.parents], [batch.fork.parents])))
        if self.whole:
            self.graphs[0].replay()
            return self.outputs[-1].clone()
        for index, graph in enumerate(self.graphs):
            graph.replay()
            if index < len(self.attention):
                self._attend(index, batch.fork)
        return self.outputs[-1].clone()


class GraphedScores:
    """`model.scores` through CUDA graphs for inference on CUDA; any other call runs eagerly.

    A layout is captured the `capture_at`-th time it is seen (third by default) and kept in an
    LRU of `capacity` graphs sharing one memory pool. A capture costs about three eager calls,
    so the layouts of varied traffic, mostly met once or twice, never pay for one; a layout
    that keeps coming back (a client's fixed form) is captured on its third call. Any other
    host batch that fits a bucket `prepare` captured (`dohnuts.model.buckets`) is padded to it
    and replays the bucket's graphs: first sight included, with no capture on the request; a
    layout a bucket serves is captured only `deferred` (a 1,287-token question's capture on its
    third call took 139 ms on the H200, its bucket's replay 7).
    A layout whose capture fails runs eagerly from then on, and the failure is logged once. Graphs are
    dropped when the model's `generation` changes (a device or dtype move, or modules
    replaced, e.g. LoRA injected) and when any parameter changes in place (a graph reads the
    weights themselves, but also constants `kernels.derived` made from them).

    With `deferred` set, no request pays for a capture: a layout due its graph is kept as
    pending, its request runs as any other sighting (a bucket's graphs or eagerly), and
    `capture_pending` captures it later, when its owner has nothing else to do (the engine's
    serving loop when no request waits, `engine.EngineLoop`). Captured on requests, one client's 16 varied requests to
    the server on the H200 (Qwen3.5-0.8B shape, d99f160's serving runs in benchmarks/ledger.jsonl)
    took 15 ms at the median but 102 ms at p95: 7 of them captured a graph.
    """

    def __init__(self, model, capacity: int = 8, remembered: int = 1024, capture_at: int = CAPTURE_AT,
                 pad_id: int = 0):
        if capture_at < 1:
            raise ValueError(f"capture_at must be >= 1, got {capture_at}")
        self.model = model
        self.capacity = capacity
        self.remembered = remembered
        self.capture_at = capture_at
        self.pad_id = pad_id
        self.graphs: OrderedDict[tuple, _Graph] = OrderedDict()
        self.seen: OrderedDict[tuple, int] = OrderedDict()  # eager sightings of each layout
        self.failed: set[tuple] = set()
        self.pool = None
        self.buckets: dict = {}  # Bucket -> _BucketGraph, made by `prepare`
        self._ladder, self._ladder_of = Ladder(()), None  # `ladder` and what it was made of
        self.arena: _Arena | None = None  # what their pieces pass between them
        self.wanted: tuple = ()  # the buckets `prepare` was asked for, made again after a change
        self.stale = False  # the model changed since they were
        self.generation, self.parameters, self.versions = None, [], None
        self._deferred = False
        self.pending: OrderedDict[tuple, Batch] = OrderedDict()  # host batches of layouts due a capture
        # "failed": captures that failed, a bucket's or a layout's; "failed_buckets": the buckets'.
        self.stats = {"eager": 0, "captures": 0, "replays": 0, "failed": 0, "failed_buckets": 0, "bucket_replays": 0,
                      "padding_tokens": 0, "prepare_seconds": 0.0, "idle_captures": 0}

    @property
    def deferred(self) -> bool:
        """Whether a layout due its capture waits for `capture_pending` (see the class)."""
        return self._deferred

    @deferred.setter
    def deferred(self, on: bool) -> None:
        self._deferred = bool(on)
        if not on:  # captures happen on requests again: nothing stays pending
            self.pending.clear()

    def prepare(self, buckets=None, memory_fraction: float = BUCKET_MEMORY) -> int:
        """Capture the graphs of `buckets` (all of `buckets.all_buckets` by default) on a CUDA
        model, so first-seen layouts replay one: at load or warm-up, never on a request.

        Smallest first, while the graphs hold at most `memory_fraction` of the device's memory
        (each kept its layers' outputs between pieces before they shared `_Arena`'s: 9.3 GiB for
        the 50 buckets of the Qwen3.5-0.8B shape the ladders had before 2026-12-03, captured in
        14 to 17 s; with 90 the
        split server was ready 35 and 59 s after its start on two H200s, loading included,
        docs/figures.md; the 99 of 2026-12-04, one-row buckets added, took 37 s to prepare on a
        fresh H200); larger batches then run eagerly, and the stop is logged once.
        Returns how many are ready (0 on the CPU). A bucket whose capture fails is left out,
        and the failure logged once."""
        model = self.model
        if model.device.type != "cuda":
            return 0
        self._check_versions()
        self.stale = False
        self.wanted = tuple(sorted(all_buckets() if buckets is None else buckets, key=rank))
        pool = torch.cuda.graph_pool_handle()
        if self.arena is None:
            self.arena = _Arena(model.device, max((bucket.tokens for bucket in self.wanted), default=0))
        budget = memory_fraction * torch.cuda.get_device_properties(model.device).total_memory
        held = torch.cuda.memory_reserved(model.device)
        missing = [bucket for bucket in self.wanted if bucket not in self.buckets]
        progress = Progress("shape buckets' CUDA graphs", len(missing), logger)
        with torch.no_grad():
            for bucket in missing:
                if torch.cuda.memory_reserved(model.device) - held > budget:
                    kernels.slow_path("bucket-memory", f"the bucket graphs reached {memory_fraction:.0%} of the "
                                                       f"device's memory: {bucket} and larger run eagerly")
                    break
                try:
                    batch = empty_batch(bucket, self.pad_id).to(model.device)
                    self.buckets[bucket] = _BucketGraph(model, bucket, batch, pool, self.arena)
                except Exception as error:  # noqa: BLE001 - a failed bucket leaves its batches eager
                    self.stats["failed"] += 1
                    self.stats["failed_buckets"] += 1
                    kernels.slow_path(f"bucket-capture-{bucket}", f"the CUDA graphs of {bucket} failed to capture, "
                                                                  f"so its batches run eagerly: "
                                                                  f"{type(error).__name__}: {error}")
                    torch.cuda.synchronize()
                progress.step()
        torch.cuda.synchronize()
        self._ladder_of = None  # the buckets changed: `ladder` is made again
        self.stats["prepare_seconds"] += progress.end(sum(bucket in self.buckets for bucket in missing))
        return len(self.buckets)

    @property
    def ladder(self) -> Ladder:
        """`buckets` as a `buckets.Ladder` (to find a batch's), made again after `prepare` or a
        model change, or when `buckets` is another dict or holds another count."""
        source, count = self._ladder_of or (None, 0)
        if source is not self.buckets or count != len(self.buckets):
            self._ladder, self._ladder_of = Ladder(self.buckets), (self.buckets, len(self.buckets))
        return self._ladder

    def _check_versions(self) -> None:
        """Drop every graph when the model changed (see the class docstring)."""
        model = self.model
        if model.generation != self.generation:
            self.generation, self.parameters, self.versions = model.generation, list(model.parameters()), None
        versions = list(map(_VERSION, self.parameters))
        if versions == self.versions:
            return
        self.graphs.clear()
        self.seen.clear()
        self.pending.clear()
        self.failed.clear()
        self.stale = bool(self.buckets)
        self.buckets.clear()
        self._ladder_of = None
        self.arena = None
        self.versions = versions

    def __call__(self, batch: Batch) -> torch.Tensor:
        """Logits [B, K] of a batch, on the host or already on the model's device (a host
        batch can also take a bucket's graphs)."""
        model = self.model
        device = model.device
        if device.type != "cuda" or model.training or torch.is_grad_enabled():
            self.stats["eager"] += 1
            return model(batch.to(device))
        on_host = not batch.input_ids.is_cuda
        if model.generation != self.generation:
            self._check_versions()  # new modules or storage: every graph goes
        key = layout_key(batch)
        graph = self.graphs.get(key)
        if graph is not None:
            return self._replay(graph, key, batch, on_host)
        # A batch its bucket serves reads the weights' versions while the device replays
        # (`_replay_bucket`); any other checks them first.
        bucket = bucket_for(batch, self.ladder) if on_host and self.buckets else None
        if bucket is None:
            self._check_versions()
            if self.stale:
                self.prepare(self.wanted)  # the model changed: its buckets are captured again
                bucket = bucket_for(batch, self.ladder) if on_host and self.buckets else None
        captures = self.seen.get(key, 0) + 1 >= self.capture_at and key not in self.failed
        if captures and bucket is not None and not self.deferred:
            captures = False  # its bucket serves it: a capture would stall this request (140 ms on the H200)
        if captures and self.deferred and on_host:  # captured later (`capture_pending`), not on this request
            self.pending[key] = batch
            self.pending.move_to_end(key)
            if len(self.pending) > self.capacity:
                self.pending.popitem(last=False)
            captures = False
        if not captures:
            self.seen[key] = self.seen.get(key, 0) + 1
            self.seen.move_to_end(key)
            if len(self.seen) > self.remembered:
                self.seen.popitem(last=False)
        if bucket is not None:  # padded on the host, then moved in one copy (never with `captures`)
            return self._replay_bucket(bucket, batch)
        moved = batch.to(device) if on_host else batch
        embeds = model.embeddings(moved)
        if captures:
            graph = self._capture(key, embeds, moved)
        if graph is not None:
            self.graphs.move_to_end(key)
            self.stats["replays"] += 1
            return graph.replay(embeds, moved)
        if captures:  # the capture failed: this layout runs eagerly from now on
            self.seen[key] = self.seen.get(key, 0) + 1
        self.stats["eager"] += 1
        return model.scores(embeds, moved)

    def capture_pending(self) -> bool:
        """Do one piece of deferred work (see `deferred`): capture the graph of the layout longest
        pending, or, after the model changed, its buckets' graphs again. False when there was
        none (nothing pending, not on CUDA, or the model training); an attempt that failed still
        counts, so the caller goes on with the rest. Call it only where no request waits: a
        layout takes about as long as three eager calls of it."""
        model = self.model
        if not self.pending or model.device.type != "cuda" or model.training:
            return False
        self._check_versions()  # a changed model drops its pending layouts with its graphs...
        if self.stale:  # ...and leaves its buckets to capture again: here, not on a request
            self.prepare(self.wanted)
            return True
        if not self.pending:
            return False
        key, batch = self.pending.popitem(last=False)
        if key in self.graphs or key in self.failed:
            return True
        with torch.no_grad():
            try:
                moved = batch.to(model.device)
                embeds = model.embeddings(moved)
            except Exception as error:  # noqa: BLE001 - e.g. its image's cached features evicted since
                logger.info("a pending layout could not be embedded for its capture (%s: %s); it waits for "
                            "its next sighting", type(error).__name__, error)
                return True
            if self._capture(key, embeds, moved) is not None:  # a failure is logged there; it runs eagerly
                self.stats["idle_captures"] += 1  # of `captures`, those made here, on no request
        return True

    def _replay(self, graph: _Graph, key: tuple, batch: Batch, on_host: bool) -> torch.Tensor:
        """Logits of a batch of a captured layout. The weights' versions are read while the
        device replays (about 475 of them for Qwen3.5-0.8B, 0.1 ms of host time on the H200's
        host): when one changed in place, the replay read stale derived constants (which the
        graph holds, `kernels.holding_derived`, so their memory is still its own), so its
        logits are dropped with every graph and the batch runs again on the new weights."""
        model = self.model
        moved = graph.load(batch) if on_host else None
        if moved is None:
            moved = batch.to(model.device) if on_host else batch
        logits = graph.replay(None if graph.text else model.embeddings(moved), moved)
        if self.changed_during_replay():
            return self(batch)
        self.graphs.move_to_end(key)
        self.stats["replays"] += 1
        return logits

    def changed_during_replay(self) -> bool:
        """Whether a weight changed in place before the replay just launched, read while the
        device replays; if so, once the replay has ended, every graph is dropped (its logits are
        stale: the caller runs the batch again)."""
        if list(map(_VERSION, self.parameters)) == self.versions:
            return False
        torch.cuda.current_stream(self.model.device).synchronize()  # the replay ends before its graphs go
        self._check_versions()
        return True

    def _replay_bucket(self, bucket, batch: Batch) -> torch.Tensor:
        """Logits [B, K] of a host batch through `bucket`'s graphs. As in `_replay`, the weights'
        versions are read while the device replays (0.17 ms of host time before the launch on
        an H100's host, run `2026-12-06-4423d17-h100-steps`): when one changed in place, the
        logits are dropped with every graph and the batch runs again, its buckets captured anew."""
        model = self.model
        # From pageable memory a copy first waits for the stream: for the invocation running
        # before this one, which the engine means to overlap (`engine.Engine.launch`).
        graphs = self.buckets[bucket]
        padded = pad_to_bucket(batch, bucket, self.pad_id)
        padded = graphs.load(padded) or padded.moved(model.device)
        logits = graphs.replay(model.embeddings(padded), padded)
        if self.changed_during_replay():
            return self(batch)
        self.stats["bucket_replays"] += 1
        self.stats["padding_tokens"] += padding_tokens(batch, bucket)
        return logits[: batch.markers.shape[0], : batch.markers.shape[1]]

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
