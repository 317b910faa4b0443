"""Compute kernels: fused Triton kernels on CUDA, plain PyTorch elsewhere.

On CUDA: flash-linear-attention's chunked gated delta rule, our own Triton kernels (a module
a family: `conv.fused`, the delta rule's convolution with its head split; `norm.fused`,
RMSNorm and its fused variants; `swiglu.fused`; `delta_rule.rows`, `delta_rule.scan` and
`delta_rule.backward`, the delta rule of short rows continuing forked states, of whole
sequences, and its gradient), and PyTorch's flash varlen attention. This is the only module
that imports `fla` or those kernel modules. Each public function chooses the fused kernel for CUDA tensors when it is
importable and otherwise runs the plain-PyTorch reference of the same math, which is also
the test oracle for the fused path (FLA keeps a naive.py beside every kernel for the same
reason). Argument names follow FLA.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
import threading
import types

import torch
from torch.utils.weak import WeakIdKeyDictionary

from .attention import _flash_grouped, _varlen, attention_reference
from .conv.naive import conv_split_heads_reference
from .delta_rule.naive import decay, gated_delta_rule_chunked
from .norm.naive import add_rms_norm_reference, norm_rotate_reference, rms_norm_gated_reference, rms_norm_reference
from .plain import fork_states, l2norm
from .plan import chunk_plan, cumulative
from .swiglu.naive import swiglu_reference

LOG = logging.getLogger(__name__)
TRITON_TESTED = (3, 6)  # the oldest Triton our kernels are tested on
# FLA may dispatch the delta rule to other backends (FlashQLA, intra-card context parallelism)
# that ignore the chunk plan we pass. The project sets these, whatever the environment says: a
# user's environment must not silently change which kernels run. FLA reads them on every call.
FLA_SETTINGS = {"FLA_FLASH_QLA": "0", "FLA_INTRACARD_CP": "0"}
_SLOW: dict[str, str] = {}


def slow_path(key: str, reason: str) -> None:
    """Record a slower path the runtime takes, and why; the first time per key it is logged as
    a warning. The benchmark's environment record lists them all (`slow_paths`)."""
    if key not in _SLOW:
        _SLOW[key] = reason
        LOG.warning("%s", reason)


def slow_paths() -> dict[str, str]:
    """Every slower path taken in this process so far: key -> why."""
    return dict(_SLOW)


@functools.cache
def _fla():
    """The FLA functions, or None when FLA (or a GPU for it) is not there."""
    for name, value in FLA_SETTINGS.items():
        if os.environ.get(name, value) != value:
            slow_path(f"env:{name}", f"{name}={os.environ[name]} in the environment is overridden with {value}: "
                                     f"that FLA backend ignores the chunk plan dohnuts passes")
        os.environ[name] = value
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError:
        return None
    return {"chunk_gated_delta_rule": chunk_gated_delta_rule}


@functools.cache
def _triton_ops():
    """Our own Triton kernels, a module a family (`conv`, `norm`, `swiglu`, and the delta rule's
    `rows` and `scan`), or None without Triton."""
    try:
        from .conv import fused as conv
        from .delta_rule import rows, scan
        from .norm import fused as norm
        from .swiglu import fused as swiglu
    except ImportError:
        return None
    import triton

    version = tuple(int(part) for part in triton.__version__.split(".")[:2] if part.isdigit())
    if version < TRITON_TESTED:
        slow_path("triton-version", f"Triton {triton.__version__} is older than {'.'.join(map(str, TRITON_TESTED))}, "
                                    f"the oldest our kernels are tested on")
    return types.SimpleNamespace(conv=conv, norm=norm, swiglu=swiglu, rows=rows, scan=scan)


def _ours(x: torch.Tensor):
    """Our Triton kernels for a CUDA tensor they serve (they compute in float32, so float64
    keeps its exact reference), else None."""
    if not x.is_cuda or x.dtype == torch.float64:
        return None
    ops = _triton_ops()
    if ops is None:
        slow_path("triton", "Triton is not importable on this CUDA machine: norms, SwiGLU, the delta rule's "
                            "convolution and its short rows run plain PyTorch (pip install -e '.[cuda]')")
    return ops


_PLANS_LOCK = threading.Lock()
_plans_depth = 0
_plans_before = False


@contextlib.contextmanager
def uncached_plans():
    """FLA without its memo of derived plans (chunk offsets and the like) for the duration.

    FLA memoises such tensors by the identity of the cu_seqlens they came from, in a small
    cache that later calls evict. A CUDA graph captured while a plan came from that memo would
    keep a pointer to memory freed at eviction; computed afresh inside the capture, the plan
    belongs to the graph. FLA reads this switch (its FLA_DISABLE_TENSOR_CACHE setting) on
    every call. The switch is process-wide: nested or concurrent users share it, and the
    first to enter and the last to leave set and restore it.
    """
    global _plans_depth, _plans_before
    utils = sys.modules.get("fla.utils") if _fla() is not None else None
    if utils is None:
        yield
        return
    with _PLANS_LOCK:
        if _plans_depth == 0:
            _plans_before = getattr(utils, "FLA_DISABLE_TENSOR_CACHE", False)
            utils.FLA_DISABLE_TENSOR_CACHE = True
        _plans_depth += 1
    try:
        yield
    finally:
        with _PLANS_LOCK:
            _plans_depth -= 1
            if _plans_depth == 0:
                utils.FLA_DISABLE_TENSOR_CACHE = _plans_before


_DERIVED = WeakIdKeyDictionary()
_HELD: list | None = None  # the kept constants `derived` handed out inside `holding_derived`


@contextlib.contextmanager
def holding_derived():
    """Collect (into the list it yields) every kept constant `derived` hands out inside the
    block. A CUDA graph captured there reads their memory at each replay, so it holds them for
    as long as it lives: when an in-place change of a weight has the cache replace one, a replay
    launched before the change is noticed (`GraphedScores` reads the weights' versions while its
    exact graphs replay) still reads memory it owns."""
    global _HELD
    previous, _HELD = _HELD, []
    try:
        yield _HELD
    finally:
        _HELD = previous



def derived(parameter: torch.Tensor, tag: str, make) -> torch.Tensor:
    """`make(parameter)`, kept while the parameter keeps its storage, dtype and version.

    Constants derived from frozen weights (RMSNorm's `1 + weight` in the input dtype) would
    otherwise cost two or three small kernels per layer per pass,
    about a third of the launches of a forward on the GPU. An in-place change of the parameter
    bumps its version and recomputes. A parameter that takes gradients computes afresh. Inside a
    CUDA graph capture a kept constant is read (the graph then reads its memory, which stays
    while the parameter is unchanged; `GraphedScores` drops graphs when a parameter changes),
    but a missing one is computed without being kept: a capture's kernels only run at replay.
    `tag` names the derivation, including anything else `make` depends on (such as a dtype).
    """
    if parameter.requires_grad and torch.is_grad_enabled():
        return make(parameter)
    stamp = (parameter._version, parameter.data_ptr(), parameter.dtype, parameter.device)
    entries = _DERIVED.setdefault(parameter, {})
    entry = entries.get(tag)
    if entry is None or entry[0] != stamp:
        value = make(parameter)
        if value is parameter or value._base is parameter:
            return value  # nothing to save, and keeping it would keep the parameter alive
        if parameter.is_cuda and torch.cuda.is_current_stream_capturing():
            return value
        entry = entries[tag] = (stamp, value)
    if _HELD is not None:
        _HELD.append(entry[1])
    return entry[1]


def fused(x: torch.Tensor):
    """The FLA functions when `x` lives on a CUDA device and FLA is installed, else None."""
    if not x.is_cuda:
        return None
    functions = _fla()
    if functions is None:
        slow_path("fla", "flash-linear-attention is not installed on this CUDA machine: the gated delta rule runs "
                         "its plain-PyTorch chunked reference, many times slower (pip install -e '.[cuda]')")
    return functions


# -- normalisation and activation -------------------------------------------------------------


def _norm_scale(weight: torch.Tensor) -> torch.Tensor:
    """Qwen3.5's RMSNorm scale `1 + weight` in float32, kept per weight (`derived`)."""
    return derived(weight, "1+w", lambda w: 1.0 + w.float())


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3.5 RMSNorm: x / rms(x) * (1 + weight), computed in float32.

    The `1 + weight` is the Qwen3.5 convention (weights are stored centred on zero).
    Args: x [..., D], weight [D]. Returns: [..., D] in x's dtype.
    """
    ops = _ours(x)
    if ops is not None:
        # Our Triton kernel: FLA's RMSNorm wrapper costs about 0.2 ms of host time a call, which
        # a host-bound training step pays about 160 times. The scale stays in float32, as in
        # Hugging Face's Qwen3.5 RMSNorm.
        return ops.norm.rms_norm(x, _norm_scale(weight), eps)
    return rms_norm_reference(x, weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + residual, Qwen3.5's RMSNorm of that sum, `rms_norm`): the residual stream and the
    next block's input. On CUDA one Triton kernel reads both once and writes both."""
    ops = _ours(x)
    if ops is not None:
        return ops.norm.add_rms_norm(x, residual, _norm_scale(weight), eps)
    return add_rms_norm_reference(x, residual, weight, eps)


def norm_rotate(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                eps: float) -> torch.Tensor:
    """Qwen3.5's RMSNorm of each attention head (`rms_norm`), then the partial rotary embedding of
    its first R channels. x: [T, H, D]; weight: [D]; cos, sin: [T, R] (each frequency in both
    halves). Returns [T, H, D] in x's dtype. On CUDA one Triton kernel (in float32 throughout)."""
    ops = _ours(x)
    if ops is not None:
        return ops.norm.norm_rotate(x, _norm_scale(weight), cos, sin, eps)
    return norm_rotate_reference(x, weight, cos, sin, eps)


def rms_norm_gated(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gated RMSNorm of the delta-rule output: rms-normalise x, scale by `weight` (not 1 + weight),
    multiply by silu(gate). Args: x, gate [..., V], weight [V]. Returns [..., V] in x's dtype."""
    ops = _ours(x)
    if ops is not None:
        return ops.norm.rms_norm_gated(x, gate, weight, eps)
    return rms_norm_gated_reference(x, gate, weight, eps)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up."""
    ops = _ours(gate)
    if ops is not None:
        return ops.swiglu.swiglu(gate, up)
    return swiglu_reference(gate, up)


# -- attention --------------------------------------------------------------------------------


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
              cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, scale: float,
              causal: bool = True) -> torch.Tensor:
    """Causal attention per packed sequence, aligned bottom-right: a sequence with Lq queries and
    Lk keys (its shared prefix first) lets query i see keys 0 .. Lk - Lq + i. With `causal`
    False every query sees every key of its sequence (the vision tower's attention).

    Args:
        q: [Tq, H, D]; k, v: [Tk, HKV, D] with H a multiple of HKV (grouped-query heads).
        cu_seqlens_q, cu_seqlens_k: [N + 1] int32 cumulative lengths of queries and keys.
        max_seqlen_q, max_seqlen_k: the longest sequences (host integers: no device sync).

    Returns:
        [Tq, H, D]
    """
    if q.is_cuda and q.dtype not in (torch.bfloat16, torch.float16):
        slow_path("attention-dtype", f"{q.dtype} on CUDA: attention runs the padded reference, since flash varlen "
                                     f"attention takes bfloat16 or float16 (set model.dtype: bfloat16)")
    if q.is_cuda and q.dtype in (torch.bfloat16, torch.float16):
        # Flash attention's variable-length kernel: no padding, bottom-right causal mask.
        varlen_attn, options = _varlen(causal)
        if "enable_gqa" not in options and k.shape[1] != q.shape[1]:
            return _flash_grouped(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, causal)
        return varlen_attn(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale=scale,
                           **options)
    return attention_reference(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, max_seqlen_q, max_seqlen_k, causal)


# -- gated delta rule -------------------------------------------------------------------------


def conv_split_heads(x: torch.Tensor, weight: torch.Tensor, initial_state: torch.Tensor | None,
                     output_final_state: bool, cu_seqlens: torch.Tensor, cu_seqlens_cpu: torch.Tensor,
                     chunk_indices: torch.Tensor | None, heads: int, key_dim: int, value_heads: int, value_dim: int,
                     parents: torch.Tensor | None = None, orphans: bool = True):
    """The delta rule's causal convolution (SiLU, `causal_conv1d_reference`) of packed sequences
    x [T, 2*H*K + HV*V], split into q, k [T, H, K], L2-normalised per head in float32 (Qwen3.5's
    delta rule), and v [T, HV, V]: returns (q, k, v, final state or None). On CUDA, one Triton
    kernel (`conv.fused.conv_split_heads`) reads x once and writes q, k and v contiguous, as
    the delta-rule kernel reads them.

    With `parents` [N], initial_state is [G, C, W] and sequence n continues row parents[n] (a
    zero state for -1, which `orphans` announces), as `fork_states` would give it. Without
    autograd the Triton kernel reads each state there; otherwise the states are forked first,
    so their gradient flows back to the G rows."""
    ops = _ours(x)
    if parents is not None and (ops is None or _differentiable(x, weight, initial_state)):
        initial_state, parents = fork_states(initial_state, parents, orphans), None
    if ops is not None:
        return ops.conv.conv_split_heads(x, weight, initial_state, output_final_state, cu_seqlens, cu_seqlens_cpu,
                                         chunk_indices, heads, key_dim, value_heads, value_dim, parents)
    return conv_split_heads_reference(x, weight, initial_state, output_final_state, cu_seqlens, heads, key_dim,
                                      value_heads, value_dim)


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                           beta: torch.Tensor, initial_state: torch.Tensor | None = None,
                           output_final_state: bool = False, cu_seqlens: torch.Tensor | None = None,
                           use_qk_l2norm_in_kernel: bool = True, cu_seqlens_cpu: torch.Tensor | None = None,
                           chunk_indices: torch.Tensor | None = None, A_log: torch.Tensor | None = None,
                           dt_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gated delta rule: S_t = exp(g_t) S_{t-1} + k_t (beta_t (v_t - exp(g_t) S_{t-1}^T k_t))^T,
    o_t = S_t^T q_t / sqrt(K).

    Args:
        q, k: [B, T, H, K]; v: [B, T, HV, V] (HV a multiple of H); g (log decay), beta: [B, T, HV].
            With `cu_seqlens` [N + 1], B is 1 and the sequences are packed along T.
        initial_state: [N, HV, K, V] float32 states before each sequence.
        output_final_state: also return the [N, HV, K, V] float32 states after each sequence.
        use_qk_l2norm_in_kernel: L2-normalise q and k first (Qwen3.5 does).
        cu_seqlens_cpu: a host copy of cu_seqlens (no device synchronisation to plan chunks).
        chunk_indices: the plan itself, [chunks, 2] (sequence, 64-token chunk), when known.
        A_log, dt_bias: [HV]; when given, g is the raw gate input and the log decay is
            `decay(g, A_log, dt_bias)`, which the fused kernel computes as it reads g.

    On CUDA, FLA's chunked kernels; elsewhere the plain-PyTorch chunked reference. (The decoder
    calls `delta_rule`, which takes our own kernels where they serve and this otherwise.)

    Returns:
        ([B, T, HV, V] output in v's dtype, final states or None)
    """
    kernels = fused(q)
    if kernels is not None:
        gate = {} if A_log is None else {"use_gate_in_kernel": True, "A_log": A_log, "dt_bias": dt_bias}
        _tune_delta_rule(kernels["chunk_gated_delta_rule"], q, v, gate, use_qk_l2norm_in_kernel)
        return kernels["chunk_gated_delta_rule"](
            q, k, v, g, beta, initial_state=initial_state, output_final_state=output_final_state,
            cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu, chunk_indices=chunk_indices,
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, **gate)
    if A_log is not None:
        g = decay(g, A_log, dt_bias)
    return gated_delta_rule_chunked(q, k, v, g, beta, initial_state, output_final_state, cu_seqlens,
                                    use_qk_l2norm_in_kernel)


def delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               cu_seqlens: torch.Tensor, cu_seqlens_cpu: torch.Tensor, longest: int, chunk_indices: torch.Tensor | None,
               A_log: torch.Tensor, dt_bias: torch.Tensor, states: torch.Tensor | None = None,
               parents: torch.Tensor | None = None, orphans: bool = False,
               output_final_state: bool = False, out: torch.Tensor | None = None, beta_logits: bool = False
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gated delta rule of packed sequences, the decoder's entry point: tensors [T, ...]
    with no batch axis, so autograd records no select or unsqueeze around the kernels.

    Args:
        q, k: [T, H, K] L2-normalised; v: [T, HV, V]; g: [T, HV] the raw gate input (the decay
            is `decay(g, A_log, dt_bias)`); beta: [T, HV], or with `beta_logits` the input of
            its sigmoid (Qwen3.5's b), which the Triton forward kernels take as they read it,
            a launch a layer fewer; the other paths take the sigmoid first.
        cu_seqlens: [N + 1] on q's device, cu_seqlens_cpu its host copy; longest: the longest
            sequence, or a bound on it; chunk_indices: the 64-token chunk plan, or None.
        states: [G, HV, K, V] float32 states sequence n continues through parents[n] (a zero
            state for parent -1, which `orphans` announces), or None for zero states.
        output_final_state: also return the [N, HV, K, V] float32 final states.
        out: [T, HV, V] contiguous in v's dtype, to hold o (a part of a larger output, which then
            needs no concatenation), or None. Forward only: autograd does not see the write. The
            Triton forward kernels write there; the other paths copy their output in.

    On CUDA, with A_log and dt_bias frozen and sequences of at most `SCAN_TOKENS`: rows that
    continue states, need no gradient and no final states, and hold at most 64 tokens run
    `delta_rule.rows.delta_rule_rows`; the rest `delta_rule.scan.delta_rule_scan` (reading each
    state in place), with `delta_rule.backward`'s gradient when autograd needs one. Otherwise FLA's chunked
    kernels, or the plain-PyTorch chunked reference off CUDA.

    Returns:
        (o [T, HV, V] in v's dtype, final states or None)
    """
    if out is not None and _differentiable(q, k, v, g, beta, states, A_log, dt_bias):
        raise ValueError("delta_rule: out is for forward passes only; autograd would not see the write")
    ours = _ours(q)
    walks = ours is not None and not _differentiable(A_log, dt_bias) and longest <= ours.scan.SCAN_TOKENS
    if walks and not _differentiable(q, k, v, g, beta, states):
        if states is not None and not output_final_state and longest <= ours.rows.ROW_TOKENS:
            return ours.rows.delta_rule_rows(q, k, v, g, beta, states, parents, cu_seqlens, longest, A_log, dt_bias,
                                             out=out, beta_logits=beta_logits), None
        return ours.scan.delta_rule_scan(q, k, v, g, beta, states, parents, cu_seqlens, output_final_state, A_log,
                                         dt_bias, out=out, beta_logits=beta_logits)
    if beta_logits:
        beta = torch.sigmoid(beta)
    if walks:
        from .delta_rule import backward  # the same walk with its gradient

        return backward.delta_rule(q, k, v, g, beta, states, parents, cu_seqlens, output_final_state, A_log,
                                   dt_bias)
    initial = fork_states(states, parents, orphans) if states is not None else None
    o, final = chunk_gated_delta_rule(q[None], k[None], v[None], g[None], beta[None], initial, output_final_state,
                                      cu_seqlens, False, cu_seqlens_cpu, chunk_indices, A_log, dt_bias)
    if out is not None:
        return out.copy_(o[0]), final
    return o[0], final


def _differentiable(*tensors) -> bool:
    """Whether autograd would record an operation on these tensors."""
    return torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in tensors)



# FLA tunes each delta-rule kernel on its first call for a head shape (the autotune key holds the
# head counts and widths, not the number of tokens or sequences) and keeps that choice, in memory
# and in Triton's disk cache, for every later call. Left to chance, the first call may be a
# 64-token prefix, whose choice then serves a batch of 50 rows poorly: on the H200 the
# 50-question request (Qwen3.5-0.8B shape) took 13.9 ms after tuning on its prefix and 11.9 ms
# after tuning on the batch below (docs/runtime-history.md, the sixth session's sweeps). So the
# first fused call of each head shape in a process first runs one packed batch of TUNING_ROWS
# rows of TUNING_LENGTH tokens continuing carried states, the shape of evaluation batches and
# training updates. At inference, rows of up to 64 tokens now run `delta_rule_rows` instead;
# whether another tuning batch would serve the prefixes better is not measured.
TUNING_ROWS, TUNING_LENGTH = 48, 40
_TUNED: set = set()


def _tune_delta_rule(function, q: torch.Tensor, v: torch.Tensor, gate: dict, normalise: bool):
    """Run `function` (FLA's chunked delta rule) once on the tuning batch, the first time it
    meets q's and v's head shape, dtype and device; not inside a CUDA graph capture."""
    heads, key_dim = q.shape[-2:]
    value_heads, value_dim = v.shape[-2:]
    signature = (heads, key_dim, value_heads, value_dim, q.dtype, v.dtype, q.device)
    if signature in _TUNED or (q.is_cuda and torch.cuda.is_current_stream_capturing()):
        return
    _TUNED.add(signature)
    total = TUNING_ROWS * TUNING_LENGTH
    generator = torch.Generator(device=q.device).manual_seed(0)  # the global generator stays untouched

    def rand(*shape, dtype=q.dtype):
        return torch.randn(*shape, generator=generator, device=q.device, dtype=torch.float32).to(dtype)

    lengths = [TUNING_LENGTH] * TUNING_ROWS
    bounds, plan = cumulative(lengths), chunk_plan(lengths)
    with torch.no_grad():
        query, key = l2norm(rand(1, total, heads, key_dim)), l2norm(rand(1, total, heads, key_dim))
        extra = {name: torch.zeros_like(value) if torch.is_tensor(value) else value for name, value in gate.items()}
        function(query, key, rand(1, total, value_heads, value_dim, dtype=v.dtype),
                 -torch.rand(1, total, value_heads, generator=generator, device=q.device).to(q.dtype),
                 torch.rand(1, total, value_heads, generator=generator, device=q.device).to(q.dtype),
                 initial_state=rand(TUNING_ROWS, value_heads, key_dim, value_dim, dtype=torch.float32),
                 output_final_state=False, cu_seqlens=bounds.to(q.device), cu_seqlens_cpu=bounds,
                 chunk_indices=plan.to(q.device), use_qk_l2norm_in_kernel=normalise, **extra)


