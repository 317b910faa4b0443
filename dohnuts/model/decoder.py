"""Our Qwen3.5 language forward over packed variable-length rows.

It runs the layers of a Hugging Face `Qwen3_5TextModel` (whose parameters keep the checkpoint
names, so weights, peft LoRA and merge apply unchanged) with our own math: rows are packed
along one axis with cumulative sequence lengths instead of padded, and every kernel comes from
`dohnuts.ops.kernels` (fused on CUDA, plain PyTorch elsewhere). Hugging Face's forward is the test
oracle.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch.utils.weak import WeakIdKeyDictionary

from ..ops import kernels
from ..ops.lora import lora_linear
from ..ops.plan import ChunkedFork, Fork


def rotary_tables(config, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, R] of interleaved M-RoPE for positions [3, T] (temporal, height, width).

    Frequency j takes the height position when j % 3 == 1 and j < 3 * section[1], the width
    position when j % 3 == 2 and j < 3 * section[2], else the temporal one.
    """
    rope = config.rope_parameters
    head_dim = config.head_dim
    rotary = int(head_dim * rope.get("partial_rotary_factor", 1.0))
    inv_freq = 1.0 / (rope["rope_theta"] ** (torch.arange(0, rotary, 2, dtype=torch.float32,
                                                          device=position_ids.device) / rotary))
    freqs = position_ids.float()[..., None] * inv_freq  # [3, T, R/2]
    section = rope.get("mrope_section", [rotary // 2, 0, 0])
    mixed = freqs[0].clone()
    for axis in (1, 2):
        index = slice(axis, section[axis] * 3, 3)
        mixed[..., index] = freqs[axis][..., index]
    table = torch.cat([mixed, mixed], dim=-1)
    return table.cos().to(dtype), table.sin().to(dtype)


@dataclass(frozen=True)
class Segments:
    """Packed sequences of one part of the token axis: cu_seqlens [N + 1] int32 (on the
    device), its host copy, the longest sequence and the 64-token chunk plan (`chunk_plan`,
    or None to let the fused kernels plan), so no kernel synchronises to find its way."""

    cu_seqlens: torch.Tensor
    cu_seqlens_cpu: torch.Tensor
    max_seqlen: int
    chunk_indices: torch.Tensor | None
    routed: bool = False  # the delta rule chooses its path on the device (a bucket's graph)
    lone: bool = False  # one real sequence, then padding no candidate reads (a one-row bucket)

    @classmethod
    def of(cls, cu_seqlens: torch.Tensor, cu_seqlens_cpu: torch.Tensor | None = None,
           chunk_indices: torch.Tensor | None = None, max_seqlen: int | None = None, routed: bool = False,
           lone: bool = False) -> Segments:
        """`max_seqlen`, when given, bounds the longest sequence instead (a CUDA graph of a
        bucket serves every layout under its bound: `dohnuts.runtime.buckets`); `routed`: the
        count of sequences is not the request's (a bucket's padding), so the delta rule's walk
        chooses its path on the device (`delta_rule.scan.delta_rule_scan`); `lone`: the first
        sequence is the only real one, the others padding after it that no candidate reads (a
        one-row bucket's), so attention may take the whole axis as one causal sequence
        (`kernels.lone_row_attention`): the padding then sees the row's keys, and the other token
        mixers still run each sequence apart."""
        if cu_seqlens_cpu is None:
            cu_seqlens_cpu = cu_seqlens.cpu()  # one synchronisation for the whole pass
        if max_seqlen is None:
            lengths = cu_seqlens_cpu[1:] - cu_seqlens_cpu[:-1]
            max_seqlen = int(lengths.max()) if len(lengths) else 0
        return cls(cu_seqlens, cu_seqlens_cpu, max_seqlen, chunk_indices, routed, lone)


@dataclass(frozen=True)
class Prefixes:
    """Shared prefixes packed ahead of the rows: the first `tokens` of the token axis, in
    `segments`, forked to the rows by `fork`."""

    tokens: int
    segments: Segments
    fork: Fork | ChunkedFork


def plain_lora(module) -> str | None:
    """The one active adapter of a peft LoRA `Linear` that is plain LoRA (unmerged, no dropout
    at work, no bias, no variant such as DoRA, over an exact nn.Linear without bias or
    gradient), else None: such a module runs its own forward."""
    lora_a = getattr(module, "lora_A", None)
    if lora_a is None or module.merged or module.disable_adapters:
        return None
    base = module.base_layer
    if type(base) is not nn.Linear or base.bias is not None or base.weight.requires_grad:
        return None
    adapters = [name for name in module.active_adapters if name in lora_a]
    if len(adapters) != 1:
        return None
    name = adapters[0]
    dropout = module.lora_dropout[name]
    dropping = not isinstance(dropout, nn.Identity) and (dropout.training or not isinstance(dropout, nn.Dropout))
    if name in getattr(module, "lora_variant", {}) or module.lora_B[name].bias is not None or dropping:
        return None
    return name


def projections(modules, x: torch.Tensor) -> list[torch.Tensor]:
    """`[module(x) for module in modules]` for linear projections of one input [..., D].

    The plain peft LoRA projections among them (`plain_lora`) run as one autograd node
    (`ops.lora`): they share one product with their stacked A matrices, and autograd records
    one node instead of a dozen operations each, the host work that bounds a training update.
    The adapters run in x's dtype, as mixed-precision training does (float32 weights,
    low-precision products with float32 accumulation). Plain nn.Linear modules (a merged
    model) run one product each; any other module (LoRA dropout in training, a variant, a
    LoRA bias, a base layer that is not exactly nn.Linear) runs its own forward.
    """
    flat = x.reshape(-1, x.shape[-1])
    stacked = _stacked_weight(modules)
    if stacked is not None:  # one product for all of them, its outputs column blocks of one tensor
        outputs = F.linear(flat, stacked).split([module.out_features for module in modules], dim=1)
    else:
        names = [plain_lora(module) for module in modules]
        plain = [index for index, name in enumerate(names) if name]
        outputs = [None] * len(modules)
        if plain:
            adapted = lora_linear(flat, [modules[i].base_layer.weight for i in plain],
                                  [modules[i].lora_A[names[i]].weight for i in plain],
                                  [modules[i].lora_B[names[i]].weight for i in plain],
                                  [modules[i].scaling[names[i]] for i in plain])
            for index, out in zip(plain, adapted):
                outputs[index] = out
        for index, module in enumerate(modules):
            if not names[index]:
                outputs[index] = (F.linear(flat, module.weight, module.bias) if type(module) is nn.Linear
                                  else module(flat))
    return [out.view(*x.shape[:-1], out.shape[-1]) for out in outputs]


# The projections that read one input, in the order the layers call `projections` with them.
# `pack_projections` lays each group's weights out as row blocks of one matrix, so the group runs
# as one matrix product: a delta-rule layer's input side is then one product where it was four
# (two of them 16 columns wide), attention's three one and the MLP's two one.
PROJECTION_GROUPS = {"linear_attn": ("in_proj_qkv", "in_proj_b", "in_proj_a", "in_proj_z"),
                     "self_attn": ("q_proj", "k_proj", "v_proj"), "mlp": ("gate_proj", "up_proj")}


def _packable(modules) -> bool:
    """Plain bias-free nn.Linear modules of one input width, dtype and device."""
    first = modules[0].weight
    return all(type(module) is nn.Linear and module.bias is None
               and module.weight.dtype == first.dtype and module.weight.device == first.device
               and module.in_features == modules[0].in_features for module in modules)


def _stacked_weight(modules) -> torch.Tensor | None:
    """The weights of `modules` as one [sum of outputs, D] matrix, when `pack_projections` laid
    them out one after another in one storage (a view, no copy), else None. Weights autograd
    would differentiate keep their own products."""
    if len(modules) < 2 or not _packable(modules):
        return None
    if torch.is_grad_enabled() and any(module.weight.requires_grad for module in modules):
        return None
    first = modules[0].weight
    stamp = tuple((id(module.weight), module.weight.data_ptr(), module.weight.shape) for module in modules)
    kept = _STACKED.get(first)
    if kept is not None and kept[0] == stamp:
        return kept[1]
    _STACKED.pop(first, None)  # a view of storage the weights left: let it go
    if not _adjacent(modules):
        return None
    rows = sum(module.out_features for module in modules)
    stacked = first.detach().as_strided((rows, first.shape[1]), (first.shape[1], 1))
    _STACKED[first] = (stamp, stacked)
    return stacked


_STACKED = WeakIdKeyDictionary()  # a group's first weight -> (its group's weights then, their stacked view)


def forget_stacked() -> None:
    """Drop the kept stacked views (each holds its weights' storage alive): after a model moved."""
    _STACKED.clear()


def _adjacent(modules) -> bool:
    """Whether the modules' contiguous weights follow one another in one storage (separate
    storages may happen to lie side by side: a view across them would read out of bounds)."""
    at = modules[0].weight.data_ptr()
    storage = modules[0].weight.untyped_storage().data_ptr()
    for module in modules:
        weight = module.weight
        if (weight.data_ptr() != at or not weight.is_contiguous()
                or weight.untyped_storage().data_ptr() != storage):
            return False
        at += weight.numel() * weight.element_size()
    return True


@torch.no_grad()
def pack_projections(language_model) -> int:
    """Lay out the weights of each of `PROJECTION_GROUPS` that holds plain nn.Linear modules (a
    merged model at inference) as row blocks of one new matrix, each module's weight a
    view of its block: the same values under the same names, in the same memory (the old
    storages are freed). Returns how many groups it packed.

    For inference only: a state dict of views into one storage is not what `save_pretrained`
    writes. A move to another device or dtype gives every weight its own storage again."""
    packed = 0
    for layer in language_model.layers:
        for owner, names in PROJECTION_GROUPS.items():
            block = getattr(layer, owner, None)
            if block is None or not all(hasattr(block, name) for name in names):
                continue
            modules = [getattr(block, name) for name in names]
            if not _packable(modules) or _adjacent(modules):
                continue
            stacked = torch.cat([module.weight for module in modules])
            at = 0
            for module in modules:
                module.weight.data = stacked[at:at + module.out_features]
                at += module.out_features
            packed += 1
    return packed


def project(module, x: torch.Tensor) -> torch.Tensor:
    """`module(x)` for one linear projection (`projections`)."""
    return projections([module], x)[0]


def attention_inputs(module, config, hidden: torch.Tensor, cos, sin):
    """A full-attention layer's query, key and value (normed, rotated) and output gate from its
    normed input [T, D]: ([T, H, Dh], [T, HKV, Dh], [T, HKV, Dh], [T, H, Dh]); the gate is read
    where the projection wrote it, interleaved with the query, not copied out."""
    head_dim = config.head_dim
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    total = hidden.shape[0]
    query, key, value = projections([module.q_proj, module.k_proj, module.v_proj], hidden)
    query, gate = query.view(total, heads, 2 * head_dim).chunk(2, dim=-1)
    query = kernels.norm_rotate(query, module.q_norm.weight, cos, sin, config.rms_norm_eps)
    key = kernels.norm_rotate(key.view(total, kv_heads, head_dim), module.k_norm.weight, cos, sin,
                              config.rms_norm_eps)
    value = value.view(total, kv_heads, head_dim)
    return query, key, value, gate


def attention_core(config, query, key, value, rows: Segments, prefixes: Prefixes | None) -> torch.Tensor:
    """Causal attention of packed tokens [T, H, Dh]. With `prefixes`, the prefixes and the rows
    run in one call: each row's queries see its prefix's keys, then its own (`Fork`)."""
    scale = config.head_dim**-0.5
    if prefixes is None and rows.lone and not torch.is_grad_enabled():  # a one-row bucket's: its row, then padding
        return kernels.lone_row_attention(query, key, value, rows.cu_seqlens, rows.max_seqlen, scale)
    if prefixes is None:
        return kernels.attention(query, key, value, rows.cu_seqlens, rows.cu_seqlens, rows.max_seqlen, rows.max_seqlen,
                                 scale)
    fork = prefixes.fork
    if isinstance(fork, ChunkedFork):  # a bucket's: shapes fixed by chunk (its CUDA graph captures it)
        return kernels.chunked_fork_attention(query, key, value, fork, prefixes.tokens, scale)
    return kernels.attention(query, key[fork.key_index], value[fork.key_index], fork.cu_seqlens_q, fork.cu_seqlens_k,
                             fork.max_seqlen_q, fork.max_seqlen_k, scale)


def attention_output(module, out: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """The attention output [T, H, Dh] gated by sigmoid(gate [T, H, Dh]) and projected: [T, D]."""
    return project(module.o_proj, kernels.gated(out, gate).flatten(1))


def _delta_mix(module, config, hidden: torch.Tensor, rows: Segments, prefixes: Prefixes | None):
    """Gated delta-rule token mixing of packed tokens, up to the delta rule's output.
    hidden: [T, D] normed. Returns (out [T, Hv, V], the output gate's input [T, Hv * V]).

    With `prefixes`, the projections run once over all tokens; the convolution and the delta
    rule run over the prefixes first, then over the rows from their prefix's final states.
    """
    key_heads, value_heads = config.linear_num_key_heads, config.linear_num_value_heads
    key_dim, value_dim = config.linear_key_head_dim, config.linear_value_head_dim
    mixed, beta, gate, output_gate = projections(
        [module.in_proj_qkv, module.in_proj_b, module.in_proj_a, module.in_proj_z], hidden)
    # gate stays raw: the kernels make it Qwen3.5's decay (kernels.decay). Without autograd so
    # does beta's input, whose sigmoid the forward kernels take as they read it; with autograd
    # the sigmoid runs once here, before the prefixes and rows are split.
    forward_only = not torch.is_grad_enabled()
    if not forward_only:
        beta = torch.sigmoid(beta)
    weight = module.conv1d.weight.squeeze(1)

    def mix(mixed, gate, beta, segments: Segments, conv_state, states, fork: Fork | ChunkedFork | None, keep: bool,
            out=None):
        """The convolution (split into L2-normalised q, k and v, as Qwen3.5's delta rule wants)
        and the delta rule of whole sequences of `segments`, from the conv states `conv_state`
        and the recurrent states `states` through `fork`'s parents (zeros without): ([t, Hv, V], written
        into `out` when given, the final conv and recurrent states if `keep`)."""
        query, key, value, conv_final = kernels.conv_split_heads(
            mixed, weight, conv_state, keep, segments.cu_seqlens, segments.cu_seqlens_cpu, segments.chunk_indices,
            key_heads, key_dim, value_heads, value_dim, fork.parents if fork else None, fork.orphans if fork else True)
        out, final = kernels.delta_rule(
            query, key, value, gate, beta, segments.cu_seqlens, segments.cu_seqlens_cpu, segments.max_seqlen,
            segments.chunk_indices, module.A_log, module.dt_bias, states, fork.parents if fork else None,
            fork.orphans if fork else False, keep, out, forward_only, routed=segments.routed)
        return out, conv_final, final

    if prefixes is None:
        out, _, _ = mix(mixed, gate, beta, rows, None, None, None, False)
        return out, output_gate
    # The prefixes first, from zero states; then the rows continue their final states, the conv
    # and the recurrent ones read through the parent index (the conv states forked first under
    # autograd, `kernels.conv_split_heads`). Split, not sliced, so the backward joins the two
    # parts' gradients in one copy. Without autograd, both parts write their outputs into one
    # tensor instead of being joined.
    sizes = [prefixes.tokens, hidden.shape[0] - prefixes.tokens]
    (mixed_head, mixed_tail), (gate_head, gate_tail), (beta_head, beta_tail) = (
        x.split(sizes) for x in (mixed, gate, beta))
    joined, parts = None, (None, None)
    if forward_only:
        joined = mixed.new_empty(hidden.shape[0], value_heads, value_dim)  # v's dtype: the conv writes x's
        parts = joined.split(sizes)
    head, conv_final, recurrent_final = mix(mixed_head, gate_head, beta_head, prefixes.segments, None, None, None,
                                            True, parts[0])
    tail, _, _ = mix(mixed_tail, gate_tail, beta_tail, rows, conv_final, recurrent_final, prefixes.fork, False,
                     parts[1])
    return (joined if joined is not None else torch.cat([head, tail])), output_gate


def _delta_output(module, config, out: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """The delta rule's output [T, Hv, V], gated RMSNorm by silu(gate), projected: [T, D]."""
    out = kernels.rms_norm_gated(out, gate.view(out.shape), module.norm.weight, config.rms_norm_eps)
    return project(module.out_proj, out.flatten(1))


# The residual stream runs as a pair (hidden, branch): its value is hidden + branch, the branch
# being the last MLP's output (None before the first layer). The add is left to the next norm
# that reads the stream, the next layer's input norm or the final norm, which adds and norms in
# one kernel (`kernels.add_rms_norm`): one launch a layer fewer than a separate add.


def _stream_norm(hidden: torch.Tensor, branch: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(the residual stream hidden + branch, its RMSNorm by weight): one kernel either way."""
    if branch is None:
        return hidden, kernels.rms_norm(hidden, weight, eps)
    return kernels.add_rms_norm(hidden, branch, weight, eps)


def input_norm(layer, config, hidden: torch.Tensor, branch: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(the residual stream hidden + branch, the layer's input norm of it)."""
    return _stream_norm(hidden, branch, layer.input_layernorm.weight, config.rms_norm_eps)


def mlp_block(layer, config, hidden: torch.Tensor, mixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add of a token mixer's output, then the MLP: (the stream after the mixer,
    the MLP's output, its branch, left for the next norm to add)."""
    hidden, normed = kernels.add_rms_norm(hidden, mixed, layer.post_attention_layernorm.weight, config.rms_norm_eps)
    mlp = layer.mlp
    gate, up = projections([mlp.gate_proj, mlp.up_proj], normed)
    return hidden, project(mlp.down_proj, kernels.swiglu(gate, up))


def _delta_tail(layer, config, hidden, out, gate):
    return mlp_block(layer, config, hidden, _delta_output(layer.linear_attn, config, out, gate))


# Under activation checkpointing, a batch of at most this many computed tokens keeps each
# layer's token-mixer activations (in bf16 for the Qwen3.5-0.8B shape, about 38 KB a token a
# delta-rule layer and 30 KB an attention layer: some 6.5 GiB over its 24 layers at this bound);
# a larger batch, such as one of long documents, recomputes its layers whole.
MIXER_KEEP_TOKENS = 8192


def _recomputed(function, *args):
    """function(*args), its activations recomputed in the backward pass instead of kept (the
    plan fixes the shapes, so the recomputation needs no metadata check). Inside a CUDA graph
    capture the random-number state is not saved for the recomputation (it cannot be read
    there); only forwards that draw no random numbers are captured (`training_graphs.graphable`)."""
    hidden = args[2]
    capturing = hidden.is_cuda and torch.cuda.is_current_stream_capturing()
    return checkpoint(function, *args, use_reentrant=False, determinism_check="none",
                      preserve_rng_state=not capturing)


def _run(function, *args):
    return function(*args)


def picks_early(picked: torch.Tensor | None, row_tokens: int) -> bool:
    """Whether the last layer's output side runs at `picked` only: when they are fewer than the
    rows' tokens. Padded markers may outnumber them (a bucket's [rows, 16]); then the whole last
    layer runs, and the states are picked after the final norm."""
    return picked is not None and picked.numel() < row_tokens


def _picked_tokens(picked: torch.Tensor | None, prefixes: Prefixes | None, *tensors: torch.Tensor):
    """The tensors [T, ...] at the rows' tokens `picked` [M] (indices into the rows' own tokens,
    past the prefixes), or as they are when picked is None."""
    if picked is None:
        return tensors
    skip = prefixes.tokens if prefixes is not None else 0
    return tuple(tensor[skip:][picked] for tensor in tensors)


def delta_layer(layer, config, hidden, branch, rows: Segments, prefixes: Prefixes | None, checkpointed: bool,
                picked: torch.Tensor | None = None):
    """One gated delta-rule decoder layer over every packed token, from the residual stream
    hidden + branch (branch may be None). Returns the stream as (hidden, branch) [T, D] each;
    with `picked` (see `packed_forward`), [M, D] at those rows' tokens: what follows the token
    mixer runs there only.

    Under activation checkpointing, a batch of up to MIXER_KEEP_TOKENS tokens recomputes only
    the part after the delta rule (gated norm, output projection, MLP) in the backward pass.
    The norm, the projections, the convolution and the delta rule keep their activations:
    recomputing them would rerun their launches, and launches, not arithmetic, bound a
    training step (docs/design.md). A larger batch recomputes the whole layer, keeping memory
    bounded.
    """
    if checkpointed and hidden.shape[0] > MIXER_KEEP_TOKENS:
        return _recomputed(_delta_whole, layer, config, hidden, branch, rows, prefixes, picked)
    hidden, normed = input_norm(layer, config, hidden, branch)
    out, gate = _delta_mix(layer.linear_attn, config, normed, rows, prefixes)
    hidden, out, gate = _picked_tokens(picked, prefixes, hidden, out, gate)
    return (_recomputed if checkpointed else _run)(_delta_tail, layer, config, hidden, out, gate)


def _delta_whole(layer, config, hidden, branch, rows: Segments, prefixes: Prefixes | None, picked):
    return delta_layer(layer, config, hidden, branch, rows, prefixes, False, picked)


def attention_layer(layer, config, hidden, branch, cos, sin, rows: Segments, prefixes: Prefixes | None,
                    checkpointed: bool, picked: torch.Tensor | None = None):
    """One full-attention decoder layer over every packed token, from the residual stream
    hidden + branch (branch may be None). Returns the stream as (hidden, branch) [T, D] each,
    or [M, D] at the rows' tokens `picked`, as `delta_layer`.

    Under activation checkpointing, as a delta-rule layer: a batch of up to MIXER_KEEP_TOKENS
    tokens recomputes only what follows the attention core (the output gate and projection, the
    MLP); a larger one recomputes the whole layer.
    """
    if checkpointed and hidden.shape[0] > MIXER_KEEP_TOKENS:
        return _recomputed(_attention_whole, layer, config, hidden, branch, cos, sin, rows, prefixes, picked)
    hidden, normed = input_norm(layer, config, hidden, branch)
    query, key, value, gate = attention_inputs(layer.self_attn, config, normed, cos, sin)
    out = attention_core(config, query, key, value, rows, prefixes)
    hidden, out, gate = _picked_tokens(picked, prefixes, hidden, out, gate)
    return (_recomputed if checkpointed else _run)(_attention_tail, layer, config, hidden, out, gate)


def _attention_tail(layer, config, hidden, out, gate):
    return mlp_block(layer, config, hidden, attention_output(layer.self_attn, out, gate))


def _attention_whole(layer, config, hidden, branch, cos, sin, rows: Segments, prefixes: Prefixes | None, picked):
    return attention_layer(layer, config, hidden, branch, cos, sin, rows, prefixes, False, picked)


def packed_forward(language_model, inputs_embeds: torch.Tensor, position_ids: torch.Tensor,
                   cu_seqlens: torch.Tensor, activation_checkpointing: bool = False, prefixes: Prefixes | None = None,
                   cu_seqlens_cpu: torch.Tensor | None = None, chunk_indices: torch.Tensor | None = None,
                   max_seqlen: int | None = None, picked: torch.Tensor | None = None, lone: bool = False
                   ) -> torch.Tensor:
    """Final (normed) hidden states of packed rows, in one pass over the layers.

    Args:
        language_model: a Hugging Face Qwen3_5TextModel (LoRA may be injected).
        inputs_embeds: [P + S, D] the shared prefixes' embeddings (P = prefixes.tokens, 0
            without), then the rows' own, concatenated.
        position_ids: [3, P + S] M-RoPE positions (a row continuing a prefix continues its count).
        cu_seqlens: [N + 1] cumulative lengths of the rows' own tokens, cu_seqlens[-1] = S.
        activation_checkpointing: recompute each layer in the backward pass (the part after its
            token mixer, up to MIXER_KEEP_TOKENS tokens: see `delta_layer`).
        prefixes: the shared prefixes the rows continue, or None. Every token-wise map
            (norms, projections, MLP) runs once over prefixes and rows together; the token
            mixers run each prefix once and fork its states (attention keys, delta-rule conv
            and recurrent states) to its rows, within the layer, so gradients of every row
            flow back into its prefix and no state outlives the forward.
        cu_seqlens_cpu: a host copy of cu_seqlens, when the caller has one (saves a device sync).
        chunk_indices: [chunks, 2] (sequence, chunk) of every 64-token chunk (`chunk_plan`), so
            the fused kernels need not plan; a CUDA graph then owns the plan it replays.
        max_seqlen: a bound on the longest row, planned for instead of it (a bucket's graph).
        picked: [M] indices into the rows' own tokens (the candidate markers) whose states are
            wanted, or None for all. The last layer's keys and states come from every token, but
            what follows its token mixer (output projection, MLP) and the final norm run only
            at these, when they are fewer than the rows' tokens (`picks_early`).
        lone: one real row, then padding no candidate reads (`Segments.lone`).

    Returns:
        [S, D] hidden states of the rows' own tokens, or [M, D] at `picked`.
    """
    config = language_model.config
    rows = Segments.of(cu_seqlens, cu_seqlens_cpu, chunk_indices, max_seqlen, lone=lone)
    cos, sin = rotary_tables(config, position_ids, inputs_embeds.dtype)
    hidden, branch = inputs_embeds, None
    checkpointed = activation_checkpointing and torch.is_grad_enabled()
    prefix_tokens = prefixes.tokens if prefixes is not None else 0
    early = picks_early(picked, inputs_embeds.shape[0] - prefix_tokens)
    last = len(language_model.layers) - 1
    for index, (layer, kind) in enumerate(zip(language_model.layers, config.layer_types)):
        at = picked if index == last and early else None
        if kind == "linear_attention":
            hidden, branch = delta_layer(layer, config, hidden, branch, rows, prefixes, checkpointed, at)
        else:
            hidden, branch = attention_layer(layer, config, hidden, branch, cos, sin, rows, prefixes, checkpointed,
                                             at)
    if early:
        return final_norm(language_model, hidden, branch, 0)
    states = final_norm(language_model, hidden, branch, prefix_tokens)
    return states if picked is None else states[picked]


def final_norm(language_model, hidden: torch.Tensor, branch: torch.Tensor | None, prefix_tokens: int) -> torch.Tensor:
    """The last layer's residual stream hidden + branch past its first `prefix_tokens` tokens
    (the prefixes'; 0 when it holds the picked tokens only), normed: [S, D]."""
    rows = branch[prefix_tokens:] if branch is not None else None
    return _stream_norm(hidden[prefix_tokens:], rows, language_model.norm.weight, language_model.config.rms_norm_eps)[1]
