"""CUDA graphs of the training forward and backward, over layouts padded to training buckets.

A training update of the Qwen3.5-0.8B shape (32 rows of about 290 tokens) is bound by host
work: some 5,700 launches, most of them small, cost about 240 ms of Python and dispatch for
about 100 ms of device work on the H200 (`h200-profile-training-update-96509e6.txt`). A captured
graph replays them all with one launch for the forward and one for the backward.

A graph fixes every shape, and every update brings a new layout (its states' lengths, its
rows' prefixes). So a batch is padded to a `TrainingBucket`, whose sizes are its own rounded
up: prefix and row tokens to multiples of `TOKEN_STEP`, attention keys to multiples of
`KEY_STEP`, prefix and row counts and candidates to small multiples. The padding is inert:

- padding prefixes (the spare prefix tokens, in sequences of at most `LONGEST_SEQUENCE`) that
  no row continues, then empty prefixes;
- a padding row (the spare row tokens, at least one) without a prefix, then empty rows;
- the attention keys the bucket holds beyond the batch's are given to the padding row, ahead of
  its own (it sees them all; no real row does);
- padding tokens have zero embeddings and position 0, and no candidate reads them.

No real token sees a padding token, and padding tokens get no gradient from the loss, so the
rows' logits and every weight's gradient are the batch's alone, up to floating-point order
(`tests/model/test_training_graphs.py`). Padding is counted as `padding_tokens`, never as work.

A bucket's graphs are captured on its second sighting (the first runs eagerly) and kept in an
LRU. A batch whose bucket has no graphs yet replays those of a larger captured bucket it fits
(`fits`: up to twice the tokens), until its own bucket recurs a fourth time and is captured.
Every graph shares one memory pool, which is safe because a graph's outputs are copied out of
the pool as soon as it has run and a backward must follow its own forward (checked).
Batches that fit no bucket (more than `MIXER_KEEP_TOKENS` tokens padded, a sequence longer
than `LONGEST_SEQUENCE`), models with anything but plain LoRA and the head training or in
float32, several processes (DistributedDataParallel's hooks are not yet tested under graphs) and
the CPU run eagerly.

On the H200 the benchmark's update (3,020 computed tokens) replays in 95 to 101 ms
(`h200-shape-only-benchmark-3154dbb-run*.jsonl`); a capture costs about 0.9 s, two or three
eager updates (0dc52ba's runs in benchmarks/ledger.jsonl).
"""

from __future__ import annotations

import dataclasses
import time
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from ..inputs.batch import Batch
from ..model.decoder import MIXER_KEEP_TOKENS, plain_lora
from ..ops import kernels
from ..ops.plan import CHUNK, Fork, cumulative, padded_plan, plan_fork
from .buckets import sequence_lengths

TOKEN_STEP = 512  # prefix and row tokens round up to a multiple of this
KEY_STEP = 2048  # attention keys round up to a multiple of this
PREFIX_STEP, ROW_STEP, CANDIDATE_STEP = 8, 16, 8  # counts round up to multiples of these
CAPTURE_AT = 2  # the sighting of a bucket that captures its graphs
# A batch whose bucket has no graphs replays those of a captured bucket it fits of up to twice
# its bucket's tokens (on the H200 a replay of twice the work costs less than an eager update,
# about 390 ms, let alone a capture, about 900), until its own bucket's OWN_GRAPH_AT-th sighting,
# which captures its own.
LARGER_TOKENS = 2.0
OWN_GRAPH_AT = 4
# Training graphs kept (least recently used dropped). They share one pool, so each adds only
# its static gradients and output (21 MB for the Qwen3.5-0.8B recipe's LoRA) to the largest
# bucket's activations.
CAPACITY = 64

# The longest sequence a training bucket holds (and its padding sequences' length): within the
# walk's gradient bound (`delta_rule.scan.SCAN_TOKENS`), so neither the forward nor the backward
# routes to FLA.
LONGEST_SEQUENCE = 1024


def _up(value: int, step: int) -> int:
    return -(-value // step) * step


def _layout(batch: Batch) -> tuple[list[int], list[int], int]:
    """(prefix lengths, row lengths, the keys rows inherit from their prefixes) of a batch, from
    its host fields."""
    if batch.fork is None:
        return [], sequence_lengths(batch.cu_seqlens_cpu), 0
    return (sequence_lengths(batch.prefix_cu_seqlens_cpu), sequence_lengths(batch.cu_seqlens_cpu),
            batch.fork.key_index.shape[0] - batch.computed_tokens)


@dataclass(frozen=True)
class TrainingBucket:
    """The shapes a training graph fixes: tokens, sequences, attention keys and candidates."""

    prefix_tokens: int
    prefixes: int
    row_tokens: int
    rows: int
    key_tokens: int
    candidates: int

    @property
    def tokens(self) -> int:
        return self.prefix_tokens + self.row_tokens

    @property
    def prefix_chunks(self) -> int:
        return self.prefix_tokens // CHUNK + self.prefixes  # each prefix adds at most one partial chunk

    @property
    def row_chunks(self) -> int:
        return self.row_tokens // CHUNK + self.rows  # each row adds at most one partial chunk

    @property
    def longest_key(self) -> int:
        """A bound on any sequence's keys: a real row's prefix and own tokens, or the first
        padding row's spare keys and own tokens."""
        return max(2 * LONGEST_SEQUENCE, self.key_tokens - self.tokens + LONGEST_SEQUENCE)


def training_bucket(batch: Batch) -> TrainingBucket | None:
    """The training bucket of a batch (on the host or the device: only host fields are read),
    or None when it fits none (see the module's docstring)."""
    prefix_lengths, row_lengths, inherited = _layout(batch)
    if max(prefix_lengths + row_lengths, default=0) > LONGEST_SEQUENCE:
        return None
    prefix_tokens = max(CHUNK, _up(batch.prefix_tokens, TOKEN_STEP))
    row_tokens = _up(sum(row_lengths) + 1, TOKEN_STEP)  # at least one padding token: the padding row
    if prefix_tokens + row_tokens > MIXER_KEEP_TOKENS:
        return None
    return TrainingBucket(
        prefix_tokens=prefix_tokens, prefixes=_up(len(prefix_lengths) + 2, PREFIX_STEP),
        row_tokens=row_tokens, rows=_up(len(row_lengths) + 2, ROW_STEP),
        key_tokens=_up(prefix_tokens + row_tokens + inherited, KEY_STEP),
        candidates=_up(batch.markers.shape[1], CANDIDATE_STEP))


def _pieces(spare: int) -> list[int]:
    """`spare` padding tokens as sequences of at most LONGEST_SEQUENCE tokens."""
    whole, rest = divmod(spare, LONGEST_SEQUENCE)
    return [LONGEST_SEQUENCE] * whole + ([rest] if rest else [])


def fits(batch: Batch, bucket: TrainingBucket) -> bool:
    """Whether `batch` pads to `bucket`: its own bucket (`training_bucket`) or a larger one,
    whose spare prefix and row tokens become padding sequences of at most LONGEST_SEQUENCE
    tokens, with an empty prefix and an empty row left over, and whose keys and candidates
    hold the batch's."""
    if bucket.tokens > MIXER_KEEP_TOKENS or batch.markers.shape[1] > bucket.candidates:
        return False
    prefixes, rows, inherited = _layout(batch)
    if max(prefixes + rows, default=0) > LONGEST_SEQUENCE:
        return False
    spare_prefix, spare_rows = bucket.prefix_tokens - batch.prefix_tokens, bucket.row_tokens - sum(rows)
    return (spare_prefix >= 0 and spare_rows >= 1
            and len(prefixes) + len(_pieces(spare_prefix)) < bucket.prefixes
            and len(rows) + len(_pieces(spare_rows)) < bucket.rows
            and bucket.tokens + inherited <= bucket.key_tokens)


@dataclass
class TrainingPlan:
    """A batch's host-side plan in its bucket: the padded sequences, chunk plans and fork."""

    prefix_cu_seqlens: torch.Tensor
    cu_seqlens: torch.Tensor
    prefix_chunk_indices: torch.Tensor
    chunk_indices: torch.Tensor
    fork: Fork

    def tensors(self) -> list[torch.Tensor]:
        return [self.prefix_cu_seqlens, self.cu_seqlens, self.prefix_chunk_indices, self.chunk_indices,
                *self.fork.tensors()]


def training_plan(batch: Batch, bucket: TrainingBucket, parents: list[int]) -> TrainingPlan:
    """The host plan of `batch` padded to `bucket` (see the module's docstring). `parents` are
    the batch's rows' prefixes (-1: none), on the host.

    Raises:
        ValueError: the batch does not fit the bucket.
    """
    prefix_lengths, row_lengths, _ = _layout(batch)
    if not fits(batch, bucket) or len(parents) != len(row_lengths):
        raise ValueError(f"a batch of {batch.prefix_tokens} prefix tokens in {len(prefix_lengths)} prefixes and "
                         f"{len(row_lengths)} rows of {sum(row_lengths)} tokens does not fit {bucket}")
    padding_prefixes = _pieces(bucket.prefix_tokens - batch.prefix_tokens)
    padding_rows = _pieces(bucket.row_tokens - sum(row_lengths))
    prefixes = prefix_lengths + padding_prefixes + [0] * (bucket.prefixes - len(prefix_lengths) - len(padding_prefixes))
    rows = row_lengths + padding_rows + [0] * (bucket.rows - len(row_lengths) - len(padding_rows))
    padding_row = len(row_lengths)
    fork = plan_fork(prefixes, rows, parents + [-1] * (bucket.rows - len(row_lengths)))

    # The bucket's spare keys go to the first padding row, ahead of its own: its sequence's keys
    # are the spare ones (copies of its first token), then its tokens.
    key_index = fork.key_index.numpy()
    cu_k = fork.cu_seqlens_k.numpy().astype(np.int64)
    sequence = bucket.prefixes + padding_row
    spare_keys = bucket.key_tokens - len(key_index)
    first_token = bucket.prefix_tokens + sum(row_lengths)
    key_index = np.concatenate([key_index[:cu_k[sequence]], np.full(spare_keys, first_token, dtype=np.int64),
                                key_index[cu_k[sequence]:]])
    cu_k[sequence + 1:] += spare_keys
    fork = Fork(fork.parents, fork.cu_seqlens_q, torch.from_numpy(key_index), torch.from_numpy(cu_k.astype(np.int32)),
                LONGEST_SEQUENCE, bucket.longest_key, True)

    # The last prefix and the last row are always empty: the plans' padding entries name them.
    return TrainingPlan(cumulative(prefixes), cumulative(rows), padded_plan(prefixes, bucket.prefix_chunks),
                        padded_plan(rows, bucket.row_chunks), fork)


def graphable(model) -> str | None:
    """Why `model`'s training forward cannot run through training graphs, or None when it can:
    only plain LoRA adapters (`decoder.plain_lora`: no dropout at work, no variant, no bias)
    and the head may train, so the forward draws no random numbers and every backward kernel
    plans on the device."""
    for name, parameter in model.named_parameters():
        if parameter.requires_grad and ".lora_" not in name and parameter is not model.head.weight:
            return f"the parameter {name} trains"
    for name, module in model.backbone.language_model.named_modules():
        if hasattr(module, "lora_A") and plain_lora(module) is None:
            return f"{name} is not plain LoRA (dropout at work, a variant or a bias)"
    dtype = model.backbone.language_model.get_input_embeddings().weight.dtype
    if dtype not in (torch.bfloat16, torch.float16):
        return f"the model is {dtype}: attention would run the padded reference over the bucket's bounds"
    return None


class BucketInputs:
    """A bucket's inputs to `DecisionModel.scores`, allocated once on the model's device (outside
    any graph's pool), and `fill`ed with each batch: the static inputs of its graphs."""

    def __init__(self, model, bucket: TrainingBucket, batch: Batch, plan: TrainingPlan):
        device = model.device
        dtype = model.backbone.language_model.get_input_embeddings().weight.dtype
        self.bucket = bucket
        self.embeds = torch.zeros(bucket.tokens, model.backbone.config.text_config.hidden_size, dtype=dtype,
                                  device=device)
        self.plan = TrainingPlan(*(tensor.to(device) for tensor in plan.tensors()[:4]),
                                 plan.fork.map(lambda tensor: tensor.to(device)))
        # The host plan of the first batch stays the graph's. Kernels read from it the sequence
        # counts and that some sequences are empty, which the bucket fixes, and the longest
        # prefix, which it does not: that only routes the delta rule (every prefix of a bucket
        # is at most LONGEST_SEQUENCE tokens, so the route is the same).
        self.batch = dataclasses.replace(
            batch, input_ids=torch.zeros(bucket.tokens, dtype=torch.long, device=device),
            position_ids=torch.zeros(3, bucket.tokens, dtype=torch.long, device=device),
            prefix_tokens=bucket.prefix_tokens, prefix_cu_seqlens=self.plan.prefix_cu_seqlens,
            prefix_cu_seqlens_cpu=plan.prefix_cu_seqlens.clone(), cu_seqlens=self.plan.cu_seqlens,
            cu_seqlens_cpu=plan.cu_seqlens.clone(), prefix_chunk_indices=self.plan.prefix_chunk_indices,
            chunk_indices=self.plan.chunk_indices, fork=self.plan.fork,
            markers=torch.zeros(bucket.rows, bucket.candidates, dtype=torch.long, device=device),
            candidate_mask=torch.zeros(bucket.rows, bucket.candidates, dtype=torch.bool, device=device),
            image_slots=batch.image_slots[:0], image_sources=batch.image_sources[:0], pixel_values=None,
            image_grid_thw_cpu=None, image_keys=(), image_has_pixels=(), rows_bound=LONGEST_SEQUENCE,
            lone_row=False, pixel_settings=None, image_shapes_cpu=None)

    def fill(self, embeds: torch.Tensor, batch: Batch, plan: TrainingPlan) -> None:
        """Copy a batch's embeddings [P + S, D] and tensors (on the device) and its padded plan (on
        the host) in: the real prefixes' tokens first, the real rows' from the bucket's rows part
        on; zeros (embeddings, positions, candidates) everywhere else."""
        prefix, start, end = batch.prefix_tokens, self.bucket.prefix_tokens, batch.computed_tokens
        self.embeds.zero_()
        self.embeds[:prefix].copy_(embeds[:prefix])
        self.embeds[start:start + end - prefix].copy_(embeds[prefix:])
        positions = self.batch.position_ids
        positions.zero_()
        positions[:, :prefix].copy_(batch.position_ids[:, :prefix])
        positions[:, start:start + end - prefix].copy_(batch.position_ids[:, prefix:])
        for static, value in zip(self.plan.tensors(), plan.tensors()):
            static.copy_(value, non_blocking=True)
        rows, candidates = batch.markers.shape
        for static, value in ((self.batch.markers, batch.markers), (self.batch.candidate_mask, batch.candidate_mask)):
            static.zero_()
            static[:rows, :candidates].copy_(value)


class _Order:
    """The forward replays of the graphs of one pool, counted: a backward must follow its own
    forward call, since every replay (of the same graph too) rewrites the pool's activations."""

    def __init__(self):
        self.replays, self.last = 0, None


class _Graph:
    """One bucket's training forward and backward as two CUDA graphs sharing a memory pool, over
    its `BucketInputs`, with their output and gradients."""

    def __init__(self, model, inputs: BucketInputs, parameters, pool, order: _Order):
        self.inputs, self.order = inputs, order
        self.grad_output = torch.zeros(inputs.bucket.rows, inputs.bucket.candidates, dtype=torch.float32,
                                       device=model.device)
        side = torch.cuda.Stream(model.device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # kernels compile and autotune, cuBLAS plans, outside the capture
            torch.autograd.grad(model.scores(inputs.embeds, inputs.batch), parameters, self.grad_output,
                                allow_unused=True)
        torch.cuda.current_stream().wait_stream(side)
        # thread_local: a loader's pin-memory thread may call CUDA while the capture runs.
        self.forward_graph, self.backward_graph = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.forward_graph, pool=pool, capture_error_mode="thread_local"):
            output = model.scores(inputs.embeds, inputs.batch)
        with torch.cuda.graph(self.backward_graph, pool=pool, capture_error_mode="thread_local"):
            self.grads = torch.autograd.grad(output, parameters, self.grad_output, allow_unused=True)
        self.output = output.detach()


class TrainingGraphs:
    """The training forward of a `DecisionModel` through CUDA graphs of training buckets (see the
    module's docstring); called by the model's `forward` in training on CUDA with gradients."""

    def __init__(self, capacity: int = CAPACITY, capture_at: int = CAPTURE_AT):
        self.capacity, self.capture_at = capacity, capture_at
        self.graphs: OrderedDict[TrainingBucket, _Graph] = OrderedDict()
        self.seen: dict[TrainingBucket, int] = {}
        self.failed: set[TrainingBucket] = set()
        self.pool = None
        self.key = None  # what the graphs were captured for: the model's generation and parameters
        self.frozen, self.versions, self.reason, self.switches, self.adapters = [], (), None, (), []
        self.order = _Order()
        # Calls that ran eagerly, captured a bucket's graphs, replayed graphs (a capturing call
        # replays them too), failed to capture; padding tokens added; seconds spent capturing.
        self.stats = {"eager": 0, "captures": 0, "replays": 0, "failed": 0, "padding_tokens": 0,
                      "capture_seconds": 0.0}

    def clear(self) -> None:
        self.graphs.clear()
        self.seen.clear()
        self.failed.clear()
        self.order = _Order()

    def _parameters(self, model) -> list[torch.nn.Parameter] | None:
        """The trainable parameters, or None when they cannot train under graphs (`graphable`,
        checked again whenever they change). Every graph is dropped when they, the model's
        generation, its checkpointing, a LoRA module's merged or disabled state or a frozen
        parameter's contents change (graphs read frozen weights' derived constants)."""
        trainable = [parameter for parameter in model.parameters() if parameter.requires_grad]
        key = (model.generation, model.activation_checkpointing, tuple(id(parameter) for parameter in trainable))
        switches = tuple((module.merged, module.disable_adapters) for module in self.adapters)
        if key != self.key or switches != self.switches:
            self.clear()
            self.key, self.versions = key, ()
            self.adapters = [module for module in model.backbone.language_model.modules() if hasattr(module, "lora_A")]
            self.switches = tuple((module.merged, module.disable_adapters) for module in self.adapters)
            self.frozen = [parameter for parameter in model.parameters() if not parameter.requires_grad]
            self.reason = graphable(model)
            if self.reason is not None:
                kernels.slow_path("training-graphs", f"training runs eagerly, without CUDA graphs: {self.reason}")
        if self.reason is not None:
            return None
        versions = tuple(parameter._version for parameter in self.frozen)
        if versions != self.versions:
            self.clear()
            self.versions = versions
        return trainable

    def __call__(self, model, batch: Batch) -> torch.Tensor:
        """Logits [B, K] of a training batch on `model`'s device (the DecisionModel that owns
        this object, passed in so that neither holds the other in a cycle), with their autograd
        graph."""
        embeds = model.embeddings(batch)
        if model.device.type != "cuda" or (torch.distributed.is_available() and torch.distributed.is_initialized()):
            return self._eager(model, embeds, batch)
        parameters = self._parameters(model)
        bucket = training_bucket(batch) if parameters is not None else None
        if bucket is None:
            return self._eager(model, embeds, batch)
        graph = self.graphs.get(bucket)
        sightings = self.seen.get(bucket, 0) + 1
        self.seen[bucket] = sightings
        if graph is None and (sightings < OWN_GRAPH_AT or bucket in self.failed):
            # A larger bucket's graphs serve a batch whose own bucket has none yet, until its
            # bucket has recurred often enough to be worth its own capture.
            larger = self._larger(batch, bucket)
            if larger is not None:
                bucket, graph = larger, self.graphs[larger]
        if graph is None and (sightings < self.capture_at or bucket in self.failed):
            return self._eager(model, embeds, batch)
        parents = batch.fork.parents.tolist() if batch.fork is not None else [-1] * batch.markers.shape[0]
        plan = training_plan(batch, bucket, parents)
        if graph is None:
            graph = self._capture(model, bucket, embeds, batch, plan, parameters)
            if graph is None:
                return self._eager(model, embeds, batch)
        else:
            graph.inputs.fill(embeds, batch, plan)
        self.graphs.move_to_end(bucket)
        self.stats["replays"] += 1
        self.stats["padding_tokens"] += bucket.tokens - batch.computed_tokens
        logits = _Replay.apply(graph, *parameters)
        return logits[: batch.markers.shape[0], : batch.markers.shape[1]]

    def _larger(self, batch: Batch, own: TrainingBucket) -> TrainingBucket | None:
        """The smallest bucket with graphs that `batch` fits, of at most LARGER_TOKENS times its
        own bucket's tokens, or None."""
        fitting = [bucket for bucket in self.graphs if bucket.tokens <= LARGER_TOKENS * own.tokens
                   and bucket.prefix_tokens >= own.prefix_tokens and bucket.row_tokens >= own.row_tokens
                   and fits(batch, bucket)]
        return min(fitting, key=lambda bucket: (bucket.tokens, bucket.key_tokens), default=None)

    def _eager(self, model, embeds: torch.Tensor, batch: Batch) -> torch.Tensor:
        self.stats["eager"] += 1
        return model.scores(embeds, batch)

    def _capture(self, model, bucket, embeds, batch, plan, parameters) -> _Graph | None:
        if not self.graphs:
            self.pool = torch.cuda.graph_pool_handle()  # no live graph: a fresh pool (see GraphedScores)
        start = time.perf_counter()
        try:
            inputs = BucketInputs(model, bucket, batch, plan)
            inputs.fill(embeds, batch, plan)
            graph = _Graph(model, inputs, parameters, self.pool, self.order)
        except Exception as error:  # noqa: BLE001 - a bucket that fails to capture runs eagerly
            self.failed.add(bucket)
            self.stats["failed"] += 1
            # One known cause: an earlier step's autograd graph kept alive (a loss held on to)
            # keeps the parameters' gradient accumulators on another stream, which the
            # backward's capture may not wait for.
            kernels.slow_path(f"training-graph-{bucket}", f"the training graphs of {bucket} failed to capture, so "
                                                          f"its batches run eagerly (is an earlier step's loss or "
                                                          f"output, with its autograd graph, still referenced?): "
                                                          f"{type(error).__name__}: {error}")
            torch.cuda.synchronize()
            return None
        self.stats["captures"] += 1
        self.stats["capture_seconds"] += time.perf_counter() - start
        self.graphs[bucket] = graph
        if len(self.graphs) > self.capacity:
            self.graphs.popitem(last=False)
        return graph


class _Replay(torch.autograd.Function):
    """A training graph as one autograd node: the forward replays its forward graph, the
    backward its backward graph, and the trainable parameters take the gradients."""

    @staticmethod
    def forward(ctx, graph: _Graph, *parameters):
        graph.forward_graph.replay()
        order = graph.order
        order.replays += 1
        ctx.graph, ctx.replay = graph, order.replays
        order.last = order.replays
        return graph.output.clone()  # the pool is the graphs': the next replay may reuse it

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_output):
        graph = ctx.graph
        if graph.order.last != ctx.replay:
            raise RuntimeError("a training graph's backward must follow its own forward call, with no other "
                               "training forward through graphs in between (every replay rewrites the activations "
                               "the backward reads, in one memory pool)")
        graph.grad_output.copy_(grad_output)
        graph.backward_graph.replay()
        graph.order.last = None
        present = [grad for grad in graph.grads if grad is not None]
        copies = iter(torch._foreach_mul(present, 1.0) if present else [])  # out of the pool, in a few launches
        return (None, *(next(copies) if grad is not None else None for grad in graph.grads))
