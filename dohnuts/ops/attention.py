"""Attention of packed sequences: torch's flash varlen kernel (its options by release) and the padded reference."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from .plain import unpack
from .plan import CHUNK


def _flash_grouped(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, causal):
    """Grouped-query attention through flash's own kernel (`aten._flash_attention_forward`,
    differentiable), which takes fewer key heads than query heads. On torch < 2.12 varlen_attn
    wants as many key heads, and repeating keys and values to them cost 12 copies of 23 us in
    the 50-question replay on the H200 (`h200-kernels-05c99b9.txt`). torch >= 2.12's
    varlen_attn(enable_gqa=True) calls the same kernel."""
    return torch.ops.aten._flash_attention_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                                   0.0, causal, False, scale=scale)[0]


@functools.cache
def _varlen(causal: bool = True):
    """torch's varlen_attn and the keyword arguments for (causal or full) grouped-query
    attention, which changed between torch releases (is_causal, then window_size; enable_gqa
    from 2.12)."""
    import inspect

    from torch.nn.attention.varlen import varlen_attn

    parameters = inspect.signature(varlen_attn).parameters
    if "window_size" in parameters:
        options = {"window_size": (-1, 0) if causal else (-1, -1)}
    else:
        options = {"is_causal": causal}
    if "enable_gqa" in parameters:
        options["enable_gqa"] = True
    return varlen_attn, options


# Whether a one-row bucket's attention runs as one causal sequence (`kernels.lone_row_attention`
# through `dense_causal`; `bench.settings` "attention.DENSE_LONE" turns it off to compare). On an
# H100 (bf16, 8 query and 2 key heads of 256) torch's varlen flash kernel took 80 us for a row of
# 1,500 tokens in a bucket of 1,536 and 200 us for 3,000 in 3,072; cuDNN's fused kernel over the
# whole bucket 40 and 102 us (the largest difference over the row 3.9e-3; ledger run
# 2026-12-05-a055b22-h100-lone-row-attention). On one H100, each setting in a process of its own in
# the order on, off, on (`trials.sh`, runs 2026-12-05-f56102e-h100-dense-1, -0 and -1-again), the
# one-row buckets' graphs of rows of 1,500 and 3,000 tokens replayed in 6.28 and 11.68-11.70 ms of
# device time with it against 6.51 and 12.13 without, and one-question requests of those lengths
# took 7.49-7.50 and 13.01-13.03 ms on first sight against 7.77 and 13.57. (Session 38's one A/B,
# on another machine and with it first, had found it slower.)
DENSE_LONE = True


def dense_causal(q, k, v, scale):
    """Causal attention of the whole token axis as one sequence on CUDA: q [T, H, D], k, v
    [T, HKV, D] (grouped-query heads) -> [T, H, D], through cuDNN's fused kernel, or flash's
    where cuDNN has none (put first: torch's own order puts flash first on some releases and
    devices). cuDNN's has erred on sequence lengths not a multiple of 128 (torch's issues);
    every one-row bucket's length is one."""
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION], set_priority=True):
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                             is_causal=True, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)


# Score entries (sequences x heads x queries x keys) the padded reference computes at once: a
# bucket's batch pads hundreds of short padding rows to its one long row (580 sequences of 3,000
# tokens wanted 144 GiB at once), so the sequences go through in slices of at most this much.
REFERENCE_SCORES = 1 << 28


def attention_reference(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, max_seqlen_q=None, max_seqlen_k=None,
                        causal=True):
    """Each sequence padded to the longest and masked: work grows with N * Lq * Lk, not T^2; the
    sequences run in slices of at most `REFERENCE_SCORES` scores (a static split: no device sync)."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    query, valid_q = unpack(q[None], cu_seqlens_q, max_seqlen_q)
    key, valid_k = unpack(k[None], cu_seqlens_k, max_seqlen_k)
    value, _ = unpack(v[None], cu_seqlens_k, max_seqlen_k)
    lead = (valid_k.sum(-1) - valid_q.sum(-1))[:, None, None]  # [N, 1, 1] keys before the first query
    rows = torch.arange(query.shape[1], device=q.device)[:, None]
    columns = torch.arange(key.shape[1], device=q.device)[None, :]
    step = max(1, REFERENCE_SCORES // max(1, q.shape[1] * query.shape[1] * key.shape[1]))
    pieces = []
    for first in range(0, max(1, query.shape[0]), step):
        part = slice(first, first + step)
        mask = valid_k[part, None, :].expand(-1, query.shape[1], -1)  # [n, Lq, Lk]
        if causal:
            mask = mask & (columns <= rows + lead[part])
        pieces.append(F.scaled_dot_product_attention(query[part].transpose(1, 2), key[part].transpose(1, 2),
                                                     value[part].transpose(1, 2), attn_mask=mask[:, None],
                                                     scale=scale).transpose(1, 2))
    out = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
    # Back to packed order by index, not by boolean mask (which would wait on the device).
    tokens = torch.arange(q.shape[0], device=q.device)
    row = torch.searchsorted(cu_seqlens_q[1:].to(tokens.dtype), tokens, right=True)
    return out[row, tokens - cu_seqlens_q[row].to(tokens.dtype)]


# -- a bucket's prefixes and rows by chunk (`plan.ChunkedFork`) --------------------------------


def chunked_fork_reference(q, k, v, fork, prefix_tokens: int, scale: float):
    """What `chunked_fork_partials` and their merge compute, as one masked softmax per query over
    the whole token axis: each token sees its chunk's own keys, causally, and a row's token its
    prefix's keys too. No device sync (capturable); the queries run in static slices of at most
    `REFERENCE_SCORES` scores. q [T, H, D], k, v [T, HKV, D] -> [T, H, D]."""
    total, heads = q.shape[0], q.shape[1]
    groups = heads // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    tokens = torch.arange(total, device=q.device)
    keys = tokens[None, :]
    own_q, own_k, own_used = (x.to(q.device, torch.long) for x in (fork.own_q, fork.own_k, fork.own_used))
    chunk = torch.searchsorted(own_q[1:].contiguous(), tokens, right=True).clamp(max=len(own_used) - 1)
    first, length = own_q[chunk], own_q[chunk + 1] - own_q[chunk]
    start, used = own_k[chunk], own_used[chunk]
    # Bottom-right causal: the chunk's query i sees its keys up to `used - length + i`.
    own = (keys >= start[:, None]) & (keys - start[:, None] <= (tokens - first + used - length)[:, None])
    cross_q, cross_k, cross_used = (x.to(q.device, torch.long) for x in (fork.cross_q, fork.cross_k, fork.cross_used))
    rows = (tokens - prefix_tokens).clamp(min=0)
    row_chunk = torch.searchsorted(cross_q[1:].contiguous(), rows, right=True).clamp(max=max(len(cross_used) - 1, 0))
    low, count = cross_k[row_chunk], cross_used[row_chunk]
    cross = ((tokens >= prefix_tokens)[:, None] & (keys < prefix_tokens) & (keys >= low[:, None])
             & (keys < (low + count)[:, None]))
    mask = own | cross
    step = max(1, REFERENCE_SCORES // max(1, heads * total))
    pieces = [F.scaled_dot_product_attention(q[part].transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                             attn_mask=mask[part][None], scale=scale).transpose(0, 1)
              for part in (slice(first, first + step) for first in range(0, max(1, total), step))]
    return torch.cat(pieces) if len(pieces) > 1 else pieces[0]


def chunked_fork_partials(q, k, v, fork, prefix_tokens: int, scale: float):
    """A bucket's attention by chunk (`plan.ChunkedFork`) on CUDA in two calls of flash
    attention's variable-length kernel, whose grid is the bucket's chunks times the heads: every
    chunk against its own keys, causally, then every row's chunk against its prefix. Returns
    (own [T, H, D], its log-sum-exp [H, T], cross [T - prefix_tokens, H, D], its log-sum-exp
    [H, T - prefix_tokens]), for the rows' two parts to be merged (`merge`)."""
    flash = torch.ops.aten._flash_attention_forward
    own, own_lse = flash(q, k, v, fork.own_q, fork.own_k, CHUNK, fork.max_keys, 0.0, True, False, scale=scale,
                         seqused_k=fork.own_used)[:2]
    if tuple(own_lse.shape) != (q.shape[1], q.shape[0]):
        raise RuntimeError(f"flash attention's log-sum-exp came as {tuple(own_lse.shape)}, not [heads, tokens] "
                           f"{(q.shape[1], q.shape[0])}: this torch release lays it out otherwise")
    cross, cross_lse = flash(q[prefix_tokens:], k[:prefix_tokens], v[:prefix_tokens], fork.cross_q, fork.cross_k,
                             CHUNK, max(fork.max_prefix, 1), 0.0, False, False, scale=scale,
                             seqused_k=fork.cross_used)[:2]
    return own, own_lse, cross, cross_lse
