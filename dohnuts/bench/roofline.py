"""The useful-work (roofline) model of one invocation: FLOPs and bytes from shapes, bounds from ceilings."""

from __future__ import annotations

from dataclasses import dataclass

# Which ceiling each FLOP category runs against. Projections, attention, the head and the vision
# tower are bf16 matrix work (tensor cores); norms, activations, gates and the causal conv are
# element-wise float32 work; the delta-rule recurrence gets a ceiling of its own, which defaults
# to the float32 one because its state is kept in float32.
MATRIX_CATEGORIES = ("matrix", "attention", "head", "vision")
VECTOR_CATEGORIES = ("vector",)
RECURRENCE_CATEGORIES = ("recurrence",)

# Element-wise FLOP constants (rough, per element unless said otherwise).
NORM_FLOPS = 4  # RMSNorm or L2 norm: square, sum, scale by 1/rms, scale by the weight
GATE_FLOPS = 4  # sigmoid or SiLU (exp, add, divide) and the product with what it gates
ROTARY_FLOPS = 3  # per rotated channel: two products and a sum
SOFTMAX_FLOPS = 4  # per attention score and head: scale, running max, exp, sum
RESIDUAL_FLOPS = 1  # per element of each residual add
DELTA_RULE_FLOPS = 7  # per K x V state element, head and token: decay 1, k^T S 2, rank-1 update 2, q^T S 2

STATE_BYTES = 4  # delta-rule states are float32
HEAD_BYTES = 4  # the head is float32

DEVICES = {
    "NVIDIA H200": {
        "matrix_flops_per_s": 989.5e12,  # dense BF16 tensor; the 1,979 TFLOPS figure assumes sparsity
        "vector_flops_per_s": 67e12,
        "bandwidth_bytes_per_s": 4.8e12,  # HBM3e
        "transfer_bytes_per_s": 64e9,  # PCIe Gen5 x16
        "source": "datasheet",
    },
    "AMD Radeon RX 7900 XTX": {
        "matrix_flops_per_s": 122.88e12,  # 96 CUs x 2.5 GHz x 512 BF16 FLOPs per clock per CU
        "vector_flops_per_s": 61.44e12,
        "bandwidth_bytes_per_s": 960e9,
        "transfer_bytes_per_s": 32e9,  # PCIe Gen4 x16
        "source": "upstream analysis",
    },
}


@dataclass(frozen=True)
class Geometry:
    """The token layout of one model invocation.

    prefix_lengths: each shared prefix, computed once; row_lengths: each row's own tokens after
    its prefix; parents: the prefix each row continues (-1: none); candidates: marker positions
    the head scores; image_patches: vision patches encoded in this call (0 on an image-feature
    cache hit or without an image); padding_tokens: tokens computed beyond the useful ones;
    image_sizes: the patches of each image encoded (they sum to image_patches; empty: one image
    of image_patches), each attending only to its own.
    """

    prefix_lengths: tuple[int, ...]
    row_lengths: tuple[int, ...]
    parents: tuple[int, ...]
    candidates: int
    image_patches: int
    padding_tokens: int = 0
    image_sizes: tuple[int, ...] = ()

    def __post_init__(self):
        if len(self.parents) != len(self.row_lengths):
            raise ValueError(f"{len(self.parents)} parents for {len(self.row_lengths)} rows: {self.parents}")
        if any(parent < -1 or parent >= len(self.prefix_lengths) for parent in self.parents):
            raise ValueError(f"parents {self.parents} must lie in [-1, {len(self.prefix_lengths)})")
        counts = (*self.prefix_lengths, *self.row_lengths, self.candidates, self.image_patches, self.padding_tokens,
                  *self.image_sizes)
        if any(count < 0 for count in counts):
            raise ValueError(f"negative count in {self}")
        if self.image_sizes and sum(self.image_sizes) != self.image_patches:
            raise ValueError(f"image sizes {self.image_sizes} do not sum to {self.image_patches} patches")

    @property
    def images(self) -> tuple[int, ...]:
        """The patches of each image encoded."""
        return self.image_sizes or ((self.image_patches,) if self.image_patches else ())

    @property
    def useful_tokens(self) -> int:
        """Tokens the language model must run: each prefix once, then the rows' own tokens."""
        return sum(self.prefix_lengths) + sum(self.row_lengths)


def geometry_from_batch(batch, vision_encoded: bool = True) -> Geometry:
    """The `Geometry` of a packed `dohnuts.model.batch.Batch`.

    Read it from the batch as packed on the host (before `Batch.to`): the fork's parents and
    the candidate mask are then host tensors and nothing waits on the device.
    Each image encoded is counted on its own (its patches attend to each other only).

    Args:
        batch: the packed batch.
        vision_encoded: False when the image features came from the cache (no patch encoded).

    Returns:
        Geometry with no padding.
    """
    prefix = batch.prefix_cu_seqlens_cpu.tolist()
    rows = batch.cu_seqlens_cpu.tolist()
    row_lengths = tuple(end - start for start, end in zip(rows, rows[1:]))
    parents = tuple(batch.fork.parents.tolist()) if batch.fork is not None else (-1,) * len(row_lengths)
    sizes = ()
    if vision_encoded and batch.image_keys:
        # Only images that carry pixels can be encoded; the others were cache hits when built.
        counts = batch.image_grid_thw_cpu.prod(dim=-1).tolist()
        sizes = tuple(count for count, present in zip(counts, batch.image_has_pixels) if present)
    return Geometry(prefix_lengths=tuple(end - start for start, end in zip(prefix, prefix[1:])),
                    row_lengths=row_lengths, parents=parents, candidates=int(batch.candidate_mask.sum()),
                    image_patches=sum(sizes), image_sizes=sizes)


def attention_pairs(geometry: Geometry) -> int:
    """Causal (query, key) pairs of one attention head: a prefix of L tokens has L(L+1)/2; a row
    of q own tokens continuing a prefix of p tokens has q*p + q(q+1)/2."""
    pairs = sum(length * (length + 1) // 2 for length in geometry.prefix_lengths)
    for length, parent in zip(geometry.row_lengths, geometry.parents):
        keys = geometry.prefix_lengths[parent] if parent >= 0 else 0
        pairs += length * keys + length * (length + 1) // 2
    return pairs


def _text_shape(config: dict) -> dict:
    """Named widths of the language model's maps."""
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim", config["hidden_size"] // heads)
    rotary_factor = config.get("rope_parameters", {}).get("partial_rotary_factor", 1.0)
    key_width = config["linear_num_key_heads"] * config["linear_key_head_dim"]
    value_heads = config["linear_num_value_heads"]
    return {
        "hidden": config["hidden_size"], "intermediate": config["intermediate_size"], "heads": heads,
        "kv_heads": config["num_key_value_heads"], "head_dim": head_dim, "rotary": int(head_dim * rotary_factor),
        "key_width": key_width, "value_heads": value_heads, "key_dim": config["linear_key_head_dim"],
        "value_dim": config["linear_value_head_dim"], "value_width": value_heads * config["linear_value_head_dim"],
        "conv_channels": 2 * key_width + value_heads * config["linear_value_head_dim"],
        "conv_kernel": config["linear_conv_kernel_dim"], "bias": bool(config.get("attention_bias", False)),
        "full": sum(kind == "full_attention" for kind in config["layer_types"]),
        "linear": sum(kind == "linear_attention" for kind in config["layer_types"]),
    }


def _linear_maps(shape: dict) -> dict[str, list[tuple[int, int]]]:
    """(in, out) of every linear map of one layer of each kind, MLP included."""
    hidden, attention_width = shape["hidden"], shape["heads"] * shape["head_dim"]
    kv_width = shape["kv_heads"] * shape["head_dim"]
    mlp = [(hidden, shape["intermediate"]), (hidden, shape["intermediate"]), (shape["intermediate"], hidden)]
    return {
        # q_proj's second half is the attention output gate.
        "full_attention": [(hidden, 2 * attention_width), (hidden, kv_width), (hidden, kv_width),
                           (attention_width, hidden)] + mlp,
        "linear_attention": [(hidden, shape["conv_channels"]), (hidden, shape["value_width"]),
                             (hidden, shape["value_heads"]), (hidden, shape["value_heads"]),
                             (shape["value_width"], hidden)] + mlp,
    }


def language_parameters(text_config: dict) -> int:
    """Parameters of the language layers and final norm: every linear map, norm weight, conv
    weight, A_log and dt_bias; not the embedding table (only its looked-up rows are read)."""
    shape = _text_shape(text_config)
    maps = _linear_maps(shape)
    hidden, head_dim = shape["hidden"], shape["head_dim"]
    biases = 2 * shape["heads"] * head_dim + 2 * shape["kv_heads"] * head_dim + hidden if shape["bias"] else 0
    full = sum(a * b for a, b in maps["full_attention"]) + biases + 2 * head_dim + 2 * hidden
    linear = (sum(a * b for a, b in maps["linear_attention"]) + shape["conv_channels"] * shape["conv_kernel"]
              + 2 * shape["value_heads"] + shape["value_dim"] + 2 * hidden)
    return shape["full"] * full + shape["linear"] * linear + hidden


def vision_parameters(vision_config: dict) -> int:
    """Parameters of the vision tower: patch embedding, position table, blocks, merger."""
    hidden, inner = vision_config["hidden_size"], vision_config["intermediate_size"]
    merged, out = hidden * vision_config["spatial_merge_size"] ** 2, vision_config["out_hidden_size"]
    # Two LayerNorms (weight and bias), then qkv, proj, fc1 and fc2 with their biases.
    block = (2 * 2 * hidden + (hidden + 1) * 3 * hidden + (hidden + 1) * hidden + (hidden + 1) * inner
             + (inner + 1) * hidden)
    merger = 2 * hidden + (merged + 1) * merged + (merged + 1) * out
    embedding = (_patch_width(vision_config) + 1) * hidden + vision_config["num_position_embeddings"] * hidden
    return embedding + vision_config["depth"] * block + merger


def _patch_width(vision_config: dict) -> int:
    return (vision_config["in_channels"] * vision_config["temporal_patch_size"] * vision_config["patch_size"] ** 2)


def _vision_flops(vision_config: dict, patches: int) -> int:
    """Matrix FLOPs of encoding `patches` patches of one image (every patch attends to all)."""
    hidden, inner = vision_config["hidden_size"], vision_config["intermediate_size"]
    unit = vision_config["spatial_merge_size"] ** 2
    if patches % unit:
        raise ValueError(f"{patches} image patches do not merge into groups of {unit}")
    merged = hidden * unit
    block = 2 * patches * (hidden * 3 * hidden + hidden * hidden + 2 * hidden * inner) + 2 * 2 * hidden * patches**2
    merger = 2 * (patches // unit) * (merged * merged + merged * vision_config["out_hidden_size"])
    return 2 * patches * _patch_width(vision_config) * hidden + vision_config["depth"] * block + merger


def _vector_flops(shape: dict, tokens: int, pairs: int) -> int:
    """Element-wise FLOPs of the language layers over `tokens` tokens and `pairs` causal pairs."""
    hidden = shape["hidden"]
    every = 2 * NORM_FLOPS * hidden + 2 * RESIDUAL_FLOPS * hidden + GATE_FLOPS * shape["intermediate"]
    query_width, key_width = shape["heads"] * shape["head_dim"], shape["kv_heads"] * shape["head_dim"]
    rotated = shape["rotary"] * (shape["heads"] + shape["kv_heads"])
    full = NORM_FLOPS * (query_width + key_width) + ROTARY_FLOPS * rotated + GATE_FLOPS * query_width
    # Conv taps and SiLU, q/k L2 norms, beta and decay gates, then the gated RMSNorm of the output.
    linear = (2 * shape["conv_kernel"] * shape["conv_channels"] + GATE_FLOPS * shape["conv_channels"]
              + NORM_FLOPS * 2 * shape["key_width"] + 2 * GATE_FLOPS * shape["value_heads"]
              + (NORM_FLOPS + GATE_FLOPS) * shape["value_width"])
    per_token = (shape["full"] + shape["linear"]) * every + shape["full"] * full + shape["linear"] * linear
    return tokens * (per_token + NORM_FLOPS * hidden) + shape["full"] * SOFTMAX_FLOPS * shape["heads"] * pairs


def _output_side(shape: dict, kind: str) -> tuple[int, int]:
    """(matrix, vector) FLOPs per token of a layer of `kind` after its token mixer: the output
    projection with its gate or gated norm, the residual adds, the MLP with its norm; counted
    at the last layer's candidate markers only, the one place its output is read."""
    hidden, inner = shape["hidden"], shape["intermediate"]
    matrix = 2 * sum(a * b for a, b in _linear_maps(shape)[kind][-4:])  # the output projection, then the MLP's three
    mlp_vector = NORM_FLOPS * hidden + RESIDUAL_FLOPS * hidden + GATE_FLOPS * inner
    if kind == "full_attention":
        return matrix, GATE_FLOPS * shape["heads"] * shape["head_dim"] + RESIDUAL_FLOPS * hidden + mlp_vector
    return matrix, (NORM_FLOPS + GATE_FLOPS) * shape["value_width"] + RESIDUAL_FLOPS * hidden + mlp_vector


def useful_work(text_config: dict, vision_config: dict | None, geometry: Geometry, dtype_bytes: int = 2) -> dict:
    """FLOPs and necessary bytes of one invocation, from the configuration and the geometry alone.

    A multiply-add is 2 FLOPs. Tokens T = sum(prefix_lengths) + sum(row_lengths): each shared
    prefix counts once, and padding counts nowhere (it is reported, never useful). The last
    layer's output side (what follows its token mixer: output projection, residual adds, MLP)
    and the final norm count at the C candidate markers only, where the head reads them.

    FLOPs:
        matrix: 2 * T * in * out over every linear map of every layer. Full attention: q_proj
            (D -> 2 * H * hd, half of it the output gate), k_proj, v_proj (D -> Hkv * hd),
            o_proj. Gated delta rule: in_proj_qkv (D -> 2 * Hk * K + Hv * V), in_proj_z
            (D -> Hv * V), in_proj_b, in_proj_a (D -> Hv), out_proj. MLP: gate, up, down.
        attention: 2 * 2 * H * hd per causal pair (QK^T and PV) per full-attention layer, pairs
            from `attention_pairs` (a row's pairs include its prefix's keys).
        recurrence: 7 * Hv * K * V per token per delta-rule layer (decay K*V, k^T S 2*K*V,
            rank-1 update 2*K*V, readout q^T S 2*K*V): the recurrent form, not the chunked
            kernel's extra intra-chunk products.
        vector: per token, 4 per element of each RMSNorm or L2 norm, 4 per gated element (SwiGLU
            on the intermediate width, attention output gate, conv SiLU, gated output norm,
            beta and decay per value head), 1 per residual element, 3 per rotated channel of
            q and k, 2 * conv_kernel per conv channel; 4 per attention score and head (softmax).
        head: 2 * D * candidates; there is no vocabulary projection; the embedding lookup is no
            matmul (0 FLOPs, its rows are bytes).
        vision (each image encoded, of N patches): patch embedding 2 * N * (C * t * p * p) * Dv;
            per block 2 * N * (3 Dv^2 + Dv^2 + 2 Dv * Iv) and attention 2 * 2 * Dv * N^2; the
            merger's two linears on N / m^2 tokens (m^2 Dv -> m^2 Dv -> out). Its element-wise
            work (LayerNorm, GELU, rotary, softmax) is left out: under 1% of its matrix work.
    Bytes:
        weights: `language_parameters` (and `vision_parameters` when patches are encoded) at
            dtype_bytes, once per invocation, plus the float32 head.
        embedding: the looked-up rows, T * D * dtype_bytes.
        activations: the hidden states in and out, (T + C) * D * dtype_bytes; with vision,
            the patches in and the merged features out.
        states: float32 delta-rule states, Hv * K * V * 4 per delta-rule layer, written once per
            prefix and read once per row that forks it. Prefix keys and values are not counted.

    Args:
        text_config: the language config (`QWEN3_5_0_8B["text_config"]` keys).
        vision_config: the vision config, or None (then image_patches must be 0).
        geometry: the invocation's token layout.
        dtype_bytes: bytes per weight and activation element (2 for bf16).

    Returns:
        {"flops": {category: int, "total"}, "bytes": {category: int, "total"},
         "tokens": {"useful_tokens", "computed_tokens", "padding_tokens", ...}}.
    """
    if geometry.image_patches and vision_config is None:
        raise ValueError(f"{geometry.image_patches} image patches but no vision config")
    shape = _text_shape(text_config)
    tokens, pairs, hidden = geometry.useful_tokens, attention_pairs(geometry), shape["hidden"]
    layer = {kind: sum(a * b for a, b in maps) for kind, maps in _linear_maps(shape).items()}
    state = shape["value_heads"] * shape["key_dim"] * shape["value_dim"]
    # Tokens past the markers skip the last layer's output side and the final norm.
    skipped = tokens - geometry.candidates
    side_matrix, side_vector = _output_side(shape, text_config["layer_types"][-1])
    flops = {
        "matrix": 2 * tokens * (shape["full"] * layer["full_attention"] + shape["linear"] * layer["linear_attention"])
        - skipped * side_matrix,
        "attention": shape["full"] * 2 * 2 * shape["heads"] * shape["head_dim"] * pairs,
        "recurrence": shape["linear"] * DELTA_RULE_FLOPS * state * tokens,
        "vector": _vector_flops(shape, tokens, pairs) - skipped * (side_vector + NORM_FLOPS * hidden),
        "head": 2 * hidden * geometry.candidates,
        "vision": sum(_vision_flops(vision_config, patches) for patches in geometry.images),
    }
    flops["total"] = sum(flops.values())
    weights = language_parameters(text_config) * dtype_bytes + hidden * HEAD_BYTES
    activations = (tokens + geometry.candidates) * hidden * dtype_bytes
    if geometry.image_patches:
        weights += vision_parameters(vision_config) * dtype_bytes
        merged = geometry.image_patches // vision_config["spatial_merge_size"] ** 2
        activations += (geometry.image_patches * _patch_width(vision_config)
                        + merged * vision_config["out_hidden_size"]) * dtype_bytes
    forked = sum(parent >= 0 for parent in geometry.parents)
    data = {"weights": weights, "embedding": tokens * hidden * dtype_bytes, "activations": activations,
            "states": shape["linear"] * state * STATE_BYTES * (len(geometry.prefix_lengths) + forked)}
    data["total"] = sum(data.values())
    return {"flops": flops, "bytes": data, "tokens": {
        "useful_tokens": tokens, "computed_tokens": tokens + geometry.padding_tokens,
        "padding_tokens": geometry.padding_tokens, "prefix_tokens": sum(geometry.prefix_lengths),
        "rows": len(geometry.row_lengths), "candidates": geometry.candidates,
        "image_patches": geometry.image_patches}}


def bounds(work: dict, ceilings: dict, transfer_bytes: int | None = None,
           stage_list: list[Stage] | None = None) -> dict:
    """Time bounds of `work` (from `useful_work`) under device `ceilings`.

    Terms: matrix (MATRIX_CATEGORIES at matrix_flops_per_s), vector (at vector_flops_per_s),
    recurrence (at recurrence_flops_per_s, else vector_flops_per_s), memory (bytes total at
    bandwidth_bytes_per_s) and, when `transfer_bytes` is given, transfer (at
    transfer_bytes_per_s). They combine as `sum` (no overlap) and `max` (ideal overlap).
    `critical_path` comes from the work per stage (`stages`): stages run one after another,
    each as long as the longer of its compute and its bytes, then the transfer; it needs
    `stage_list`. t_lower = max(all FLOPs at the matrix rate, bytes / bandwidth), the issue's
    lower bound. A term whose ceiling is missing is None, and so is every combination that needs
    it (absent, never 0).

    Args:
        work: a `useful_work` result.
        ceilings: matrix_flops_per_s, vector_flops_per_s, bandwidth_bytes_per_s, optional
            recurrence_flops_per_s and transfer_bytes_per_s (a DEVICES entry fits).
        transfer_bytes: host-device bytes of the invocation, if known.
        stage_list: the same work stage by stage, for the critical path.

    Returns:
        {"matrix_seconds", "vector_seconds", "recurrence_seconds", "memory_seconds",
         "transfer_seconds", "sum_seconds", "max_seconds", "critical_path_seconds",
         "t_lower_seconds", "terms": names of the terms combined}.
    """
    flops = work["flops"]
    transfer_rate = ceilings.get("transfer_bytes_per_s")
    vector_rate = ceilings.get("vector_flops_per_s")
    recurrence_rate = ceilings.get("recurrence_flops_per_s") or vector_rate
    times = {
        "matrix": _seconds(sum(flops[name] for name in MATRIX_CATEGORIES), ceilings.get("matrix_flops_per_s")),
        "vector": _seconds(sum(flops[name] for name in VECTOR_CATEGORIES), vector_rate),
        "recurrence": _seconds(sum(flops[name] for name in RECURRENCE_CATEGORIES), recurrence_rate),
        "memory": _seconds(work["bytes"]["total"], ceilings.get("bandwidth_bytes_per_s")),
        "transfer": _seconds(transfer_bytes, transfer_rate) if transfer_bytes is not None else None,
    }
    terms = ["matrix", "vector", "recurrence", "memory"] + (["transfer"] if transfer_bytes is not None else [])
    result = {f"{name}_seconds": value for name, value in times.items()}
    result.update({"sum_seconds": None, "max_seconds": None, "critical_path_seconds": None, "terms": terms})
    if all(times[name] is not None for name in terms):
        transfer = times["transfer"] or 0.0
        compute = times["matrix"] + times["vector"] + times["recurrence"]
        result["sum_seconds"] = compute + times["memory"] + transfer
        result["max_seconds"] = max(times[name] for name in terms)
        if stage_list is not None:
            per_stage = [stage_seconds(stage, ceilings) for stage in stage_list]
            if all(value is not None for value in per_stage):
                result["critical_path_seconds"] = sum(per_stage) + transfer
    result["t_lower_seconds"] = _lower(flops["total"], work["bytes"]["total"], ceilings)
    return result


def _seconds(amount: int, rate: float | None) -> float | None:
    return amount / rate if rate else None


def _lower(flops: int, data: int, ceilings: dict) -> float | None:
    matrix, bandwidth = ceilings.get("matrix_flops_per_s"), ceilings.get("bandwidth_bytes_per_s")
    if not matrix or not bandwidth:
        return None
    return max(flops / matrix, data / bandwidth)


def efficiencies(bound: dict, measured_seconds: float) -> dict:
    """Each bound of `bounds` over the measured time: the fraction of the time that term alone
    explains (matrix, vector, recurrence, memory, transfer), the critical path's, and t_lower's
    (the roofline efficiency); None where the bound is."""
    names = ("matrix", "vector", "recurrence", "memory", "transfer", "critical_path", "t_lower")
    return {name: efficiency(bound.get(f"{name}_seconds"), measured_seconds) for name in names}


def efficiency(t_lower: float | None, measured_seconds: float) -> float | None:
    """The fraction of the roofline reached: t_lower / measured (None when t_lower is)."""
    if measured_seconds <= 0:
        raise ValueError(f"measured time must be positive, got {measured_seconds}")
    return None if t_lower is None else t_lower / measured_seconds


@dataclass(frozen=True)
class Stage:
    """One step of an invocation that must finish before the next can start (a layer's part):
    its FLOPs by category, its necessary bytes, and whether activation checkpointing
    recomputes it in the backward pass (the part of a layer after its token mixer; with
    `whole_layers`, every part: `dohnuts.model.decoder.MIXER_KEEP_TOKENS`)."""

    name: str
    flops: dict
    bytes: int
    recomputed: bool = False


def stages(text_config: dict, vision_config: dict | None, geometry: Geometry, dtype_bytes: int = 2,
           whole_layers: bool = False) -> list[Stage]:
    """`useful_work` stage by stage, in the order the forward runs them: vision, embedding, per
    layer its mixer's parts and its MLP, the final norm and the head. Summed over the stages,
    FLOPs per category and bytes equal `useful_work`'s (each stage carries its own weights and
    states; the hidden states in and out are the embedding's and the final norm's). Like it,
    they count the last layer's output side at the candidates: a batch whose padded markers
    outnumber its row tokens (`decoder.picks_early`) runs, and under checkpointing recomputes,
    that side over every row token, so its recomputed work is understated by that much."""
    shape = _text_shape(text_config)
    tokens, pairs, hidden = geometry.useful_tokens, attention_pairs(geometry), shape["hidden"]
    state = shape["value_heads"] * shape["key_dim"] * shape["value_dim"]
    maps = _linear_maps(shape)
    inner, value_width = shape["intermediate"], shape["value_width"]
    query_width, key_width = shape["heads"] * shape["head_dim"], shape["kv_heads"] * shape["head_dim"]
    rotated = shape["rotary"] * (shape["heads"] + shape["kv_heads"])

    def work(name, recomputed=False, weights=0, data=0, **flops):
        return Stage(name, {key: int(value) for key, value in flops.items()}, int(weights * dtype_bytes + data),
                     recomputed)

    mlp_weights = sum(a * b for a, b in maps["full_attention"][4:])

    def mlp(count):  # the MLP with its norm and residual add over `count` tokens
        return dict(matrix=2 * count * mlp_weights, weights=mlp_weights + hidden,
                    vector=count * (NORM_FLOPS * hidden + RESIDUAL_FLOPS * hidden + GATE_FLOPS * inner))

    last, picked = len(text_config["layer_types"]) - 1, geometry.candidates
    forked = sum(parent >= 0 for parent in geometry.parents)
    result = []
    if geometry.image_patches:
        merged = geometry.image_patches // vision_config["spatial_merge_size"] ** 2
        result.append(work("vision", weights=vision_parameters(vision_config),
                           data=(geometry.image_patches * _patch_width(vision_config)
                                 + merged * vision_config["out_hidden_size"]) * dtype_bytes,
                           vision=_vision_flops(vision_config, geometry.image_patches)))
    result.append(work("embedding", data=2 * tokens * hidden * dtype_bytes))  # the rows looked up, the hidden in
    for index, kind in enumerate(text_config["layer_types"]):
        out = picked if index == last else tokens  # the last layer's output side runs at the markers
        if kind == "linear_attention":
            projections = maps["linear_attention"][:4]
            result += [
                work(f"{index}.delta.projections", whole_layers, weights=sum(a * b for a, b in projections) + hidden,
                     matrix=2 * tokens * sum(a * b for a, b in projections), vector=tokens * NORM_FLOPS * hidden),
                work(f"{index}.delta.convolution", whole_layers,
                     weights=shape["conv_channels"] * shape["conv_kernel"] + 2 * shape["value_heads"],
                     vector=tokens * (2 * shape["conv_kernel"] * shape["conv_channels"]
                                      + GATE_FLOPS * shape["conv_channels"] + NORM_FLOPS * 2 * shape["key_width"]
                                      + 2 * GATE_FLOPS * shape["value_heads"])),
                work(f"{index}.delta.rule", whole_layers, recurrence=DELTA_RULE_FLOPS * state * tokens,
                     data=state * STATE_BYTES * (len(geometry.prefix_lengths) + forked)),
                work(f"{index}.delta.output", True, weights=value_width * hidden + shape["value_dim"],
                     matrix=2 * out * value_width * hidden,
                     vector=out * ((NORM_FLOPS + GATE_FLOPS) * value_width + RESIDUAL_FLOPS * hidden)),
            ]
        else:
            projections = maps["full_attention"][:3]
            biases = (2 * query_width + 2 * key_width + hidden) if shape["bias"] else 0
            result += [
                work(f"{index}.attention.projections", whole_layers,
                     weights=sum(a * b for a, b in projections) + biases + 2 * shape["head_dim"] + hidden,
                     matrix=2 * tokens * sum(a * b for a, b in projections),
                     vector=tokens * (NORM_FLOPS * hidden + NORM_FLOPS * (query_width + key_width)
                                      + ROTARY_FLOPS * rotated)),
                work(f"{index}.attention.scores", whole_layers, attention=2 * 2 * query_width * pairs,
                     vector=SOFTMAX_FLOPS * shape["heads"] * pairs),
                work(f"{index}.attention.output", True, weights=query_width * hidden,
                     matrix=2 * out * query_width * hidden,
                     vector=out * (GATE_FLOPS * query_width + RESIDUAL_FLOPS * hidden)),
            ]
        result.append(work(f"{index}.mlp", True, **mlp(out)))
    result.append(work("final norm", weights=hidden, data=picked * hidden * dtype_bytes,
                       vector=picked * NORM_FLOPS * hidden))
    result.append(work("head", data=hidden * HEAD_BYTES, head=2 * hidden * geometry.candidates))
    return result


def stage_seconds(stage: Stage, ceilings: dict) -> float | None:
    """A stage's bound: its compute (each category at its ceiling) or its bytes at the
    bandwidth, whichever is longer; None when a ceiling it needs is missing."""
    vector = ceilings.get("vector_flops_per_s")
    rates = {**dict.fromkeys(MATRIX_CATEGORIES, ceilings.get("matrix_flops_per_s")),
             **dict.fromkeys(VECTOR_CATEGORIES, vector),
             **dict.fromkeys(RECURRENCE_CATEGORIES, ceilings.get("recurrence_flops_per_s") or vector)}
    compute = 0.0
    for name, amount in stage.flops.items():
        if amount:
            if not rates.get(name):
                return None
            compute += amount / rates[name]
    bandwidth = ceilings.get("bandwidth_bytes_per_s")
    if stage.bytes and not bandwidth:
        return None
    return max(compute, stage.bytes / bandwidth if stage.bytes else 0.0)


def total(stage_list: list[Stage], recomputed_only: bool = False) -> dict:
    """FLOPs by category and bytes summed over stages (those recomputed only, if asked): the
    shape of `useful_work`'s flops and bytes totals."""
    chosen = [stage for stage in stage_list if stage.recomputed or not recomputed_only]
    flops = {name: sum(stage.flops.get(name, 0) for stage in chosen)
             for name in ("matrix", "attention", "recurrence", "vector", "head", "vision")}
    return {"flops": {**flops, "total": sum(flops.values())}, "bytes": {"total": sum(stage.bytes for stage in chosen)}}
