"""The roofline model: FLOPs and bytes hand-counted on a tiny shape, bounds and efficiency."""

import json

import pytest
import torch

from dohnuts.bench.roofline import (
    DEVICES,
    Geometry,
    Stage,
    bounds,
    efficiencies,
    efficiency,
    geometry_from_batch,
    language_parameters,
    stage_seconds,
    stages,
    total,
    useful_work,
    vision_parameters,
)
from dohnuts.bench.shapes import QWEN3_5_0_8B
from dohnuts.inputs.batch import EncodedImage, Row, pack_rows

# D 8, I 16; full attention H 2, Hkv 1, hd 4 (rotary on half: 2 channels); delta rule Hk 1,
# Hv 2, K = V = 4, conv kernel 4 over 2 * 1 * 4 + 2 * 4 = 16 channels.
TEXT = {
    "hidden_size": 8, "intermediate_size": 16, "layer_types": ["linear_attention", "full_attention"],
    "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4, "linear_num_key_heads": 1,
    "linear_num_value_heads": 2, "linear_key_head_dim": 4, "linear_value_head_dim": 4,
    "linear_conv_kernel_dim": 4, "rope_parameters": {"partial_rotary_factor": 0.5},
}
# Dv 8, Iv 16, 3 channels of 2 x 2 x 2 patches (24 values each), 2 x 2 merge into 8 wide tokens.
VISION = {
    "depth": 1, "hidden_size": 8, "num_heads": 2, "intermediate_size": 16, "in_channels": 3, "patch_size": 2,
    "temporal_patch_size": 2, "spatial_merge_size": 2, "out_hidden_size": 8, "num_position_embeddings": 4,
}

MATRIX_PER_TOKEN = 2 * (
    (8 * 16 + 8 * 4 + 8 * 4 + 8 * 8)  # full attention: q_proj (with its gate half), k_proj, v_proj, o_proj
    + (8 * 16 + 8 * 8 + 8 * 2 + 8 * 2 + 8 * 8)  # delta rule: in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, out_proj
    + 2 * (8 * 16 + 8 * 16 + 16 * 8)  # gate, up and down projections of both layers
)
ATTENTION_PER_PAIR = 2 * 2 * 2 * 4  # QK^T and PV, 2 heads of 4
RECURRENCE_PER_TOKEN = 7 * 2 * 4 * 4  # 2 value heads of a 4 x 4 state
VECTOR_PER_TOKEN = (
    2 * (2 * 4 * 8 + 2 * 8 + 4 * 16)  # per layer: two RMSNorms, two residual adds, SwiGLU
    + 4 * (8 + 4) + 3 * 2 * (2 + 1) + 4 * 8  # full: q/k norms, rotary of 2 channels on 3 heads, output gate
    + 2 * 4 * 16 + 4 * 16 + 4 * 8 + 4 * 2 * 2 + (4 + 4) * 8  # delta: conv, SiLU, q/k L2, beta and decay, gated norm
    + 4 * 8  # final norm
)
SOFTMAX_PER_PAIR = 4 * 2  # 2 heads
# The last layer (full attention) runs its output side at the candidate markers only: per other
# token, o_proj and the MLP are left out, and so are the output gate, both residual adds, the
# MLP's norm, SwiGLU and the final norm.
LAST_OUTPUT_MATRIX = 2 * (8 * 8 + 8 * 16 + 8 * 16 + 16 * 8)
LAST_OUTPUT_VECTOR = 4 * 8 + 8 + 4 * 8 + 8 + 4 * 16 + 4 * 8
HEAD_PER_CANDIDATE = 2 * 8
PARAMETERS = (
    (8 * 16 + 8 * 4 + 8 * 4 + 8 * 8) + 2 * 4 + 3 * 8 * 16 + 2 * 8  # full: maps, q/k norms, MLP, two layer norms
    + (8 * 16 + 8 * 8 + 8 * 2 + 8 * 2 + 8 * 8) + 16 * 4 + 2 + 2 + 4 + 3 * 8 * 16 + 2 * 8  # delta: maps, conv,
    # A_log, dt_bias, gated norm, MLP, two layer norms
    + 8  # final norm
)
WEIGHT_BYTES = 2 * PARAMETERS + 4 * 8  # bf16 layers, float32 head
STATE_BYTES = 2 * 4 * 4 * 4  # one float32 state of 2 heads of 4 x 4


def _flops(tokens, pairs, candidates, vision=0):
    unread = tokens - candidates  # tokens whose last-layer output nothing reads
    parts = {"matrix": tokens * MATRIX_PER_TOKEN - unread * LAST_OUTPUT_MATRIX, "attention": pairs * ATTENTION_PER_PAIR,
             "recurrence": tokens * RECURRENCE_PER_TOKEN,
             "vector": tokens * VECTOR_PER_TOKEN + pairs * SOFTMAX_PER_PAIR - unread * LAST_OUTPUT_VECTOR,
             "head": candidates * HEAD_PER_CANDIDATE, "vision": vision}
    return {**parts, "total": sum(parts.values())}


def test_one_row_of_five_tokens_matches_the_hand_count():
    work = useful_work(TEXT, None, Geometry((), (5,), (-1,), candidates=2, image_patches=0))
    assert work["flops"] == _flops(tokens=5, pairs=5 * 6 // 2, candidates=2)
    # Activations: the 5 tokens' hidden states in, the 2 markers' out.
    assert work["bytes"] == {"weights": WEIGHT_BYTES, "embedding": 5 * 8 * 2, "activations": (5 + 2) * 8 * 2,
                             "states": 0, "total": WEIGHT_BYTES + 5 * 8 * 2 + (5 + 2) * 8 * 2}
    assert work["tokens"]["useful_tokens"] == work["tokens"]["computed_tokens"] == 5


def test_shared_prefix_counts_once_and_its_keys_join_every_rows_attention():
    geometry = Geometry((4,), (3, 2), (0, 0), candidates=2, image_patches=0)
    work = useful_work(TEXT, None, geometry)
    # Prefix: 4 * 5 / 2 pairs; rows: 3 * 4 + 3 * 4 / 2 and 2 * 4 + 2 * 3 / 2.
    pairs = 10 + (12 + 6) + (8 + 3)
    assert work["flops"] == _flops(tokens=4 + 3 + 2, pairs=pairs, candidates=2)
    tokens_bytes = 9 * 8 * 2
    states = STATE_BYTES * (1 + 2)  # written once by the prefix, read by each of the two rows
    markers_bytes = 2 * 8 * 2
    assert work["bytes"] == {"weights": WEIGHT_BYTES, "embedding": tokens_bytes,
                             "activations": tokens_bytes + markers_bytes, "states": states,
                             "total": WEIGHT_BYTES + 2 * tokens_bytes + markers_bytes + states}
    unshared = useful_work(TEXT, None, Geometry((), (7, 6), (-1, -1), candidates=2, image_patches=0))
    # The prefix's 4 tokens computed again, none of them a marker.
    assert unshared["flops"]["matrix"] - work["flops"]["matrix"] == 4 * (MATRIX_PER_TOKEN - LAST_OUTPUT_MATRIX)
    assert unshared["flops"]["attention"] == work["flops"]["attention"] + 10 * ATTENTION_PER_PAIR


def test_image_cache_hit_has_no_vision_work_and_a_miss_counts_the_tower():
    hit = useful_work(TEXT, VISION, Geometry((), (5,), (-1,), candidates=1, image_patches=0))
    miss = useful_work(TEXT, VISION, Geometry((), (5,), (-1,), candidates=1, image_patches=8))
    text_only = useful_work(TEXT, None, Geometry((), (5,), (-1,), candidates=1, image_patches=0))
    assert hit == text_only
    vision_flops = (
        2 * 8 * 24 * 8  # patch embedding of 8 patches
        + 2 * 8 * (8 * 24 + 8 * 8 + 2 * 8 * 16)  # one block: qkv, proj, fc1, fc2
        + 2 * 2 * 8 * 8 * 8  # every patch attends to all 8
        + 2 * 2 * (32 * 32 + 32 * 8)  # merger over 8 / 4 tokens 32 wide
    )
    assert miss["flops"] == _flops(tokens=5, pairs=15, candidates=1, vision=vision_flops)
    vision_weights = (
        25 * 8 + 4 * 8  # patch embedding with bias, position table
        + 2 * 2 * 8 + 9 * 24 + 9 * 8 + 9 * 16 + 17 * 8  # two LayerNorms, qkv, proj, fc1, fc2 with biases
        + 2 * 8 + 33 * 32 + 33 * 8  # merger: LayerNorm, fc1, fc2 with biases
    )
    assert miss["bytes"]["weights"] == hit["bytes"]["weights"] + 2 * vision_weights
    assert miss["bytes"]["activations"] == hit["bytes"]["activations"] + (8 * 24 + 2 * 8) * 2  # patches in, out
    # Two images of 8 patches: each attends to its own, so twice one image's vision work, not one of 16.
    two = useful_work(TEXT, VISION, Geometry((), (5,), (-1,), candidates=1, image_patches=16, image_sizes=(8, 8)))
    assert two["flops"]["vision"] == 2 * vision_flops
    with pytest.raises(ValueError, match="do not sum to 12 patches"):
        Geometry((), (5,), (-1,), candidates=1, image_patches=12, image_sizes=(8, 8))


def test_padding_is_computed_but_adds_no_work():
    plain = useful_work(TEXT, None, Geometry((4,), (3, 2), (0, 0), candidates=2, image_patches=0))
    padded = useful_work(TEXT, None, Geometry((4,), (3, 2), (0, 0), candidates=2, image_patches=0, padding_tokens=7))
    assert padded["flops"] == plain["flops"] and padded["bytes"] == plain["bytes"]
    assert padded["tokens"]["useful_tokens"] == 9
    assert padded["tokens"]["computed_tokens"] == 16 and padded["tokens"]["padding_tokens"] == 7


def test_parameter_counts_match_the_qwen3_5_0_8b_checkpoint():
    """Counted by transformers' AutoModel.from_config on this shape: 752,393,024 language
    parameters (embedding table included) and 100,592,896 vision parameters."""
    text, vision = QWEN3_5_0_8B["text_config"], QWEN3_5_0_8B["vision_config"]
    assert language_parameters(text) + text["vocab_size"] * text["hidden_size"] == 752_393_024
    assert vision_parameters(vision) == 100_592_896


def test_geometry_rejects_inconsistent_layouts():
    with pytest.raises(ValueError, match="2 parents for 1 rows"):
        Geometry((4,), (3,), (0, 0), candidates=1, image_patches=0)
    with pytest.raises(ValueError, match=r"parents \(1,\)"):
        Geometry((4,), (3,), (1,), candidates=1, image_patches=0)
    with pytest.raises(ValueError, match="no vision config"):
        useful_work(TEXT, None, Geometry((), (3,), (-1,), candidates=1, image_patches=4))


CEILINGS = {"matrix_flops_per_s": 1e6, "vector_flops_per_s": 1e5, "bandwidth_bytes_per_s": 1e4,
            "transfer_bytes_per_s": 1e3}


def test_bounds_terms_and_their_combinations():
    work = useful_work(TEXT, None, Geometry((4,), (3, 2), (0, 0), candidates=2, image_patches=0))
    result = bounds(work, CEILINGS, transfer_bytes=500)
    flops = work["flops"]
    matrix = (flops["matrix"] + flops["attention"] + flops["head"]) / 1e6
    assert result["matrix_seconds"] == pytest.approx(matrix)
    assert result["vector_seconds"] == pytest.approx(flops["vector"] / 1e5)
    assert result["recurrence_seconds"] == pytest.approx(flops["recurrence"] / 1e5)  # float32 ceiling by default
    assert result["memory_seconds"] == pytest.approx(work["bytes"]["total"] / 1e4)
    assert result["transfer_seconds"] == pytest.approx(0.5)
    compute = result["matrix_seconds"] + result["vector_seconds"] + result["recurrence_seconds"]
    assert result["critical_path_seconds"] is None  # it needs the work per stage
    assert result["sum_seconds"] == pytest.approx(compute + result["memory_seconds"] + 0.5)
    assert result["t_lower_seconds"] == pytest.approx(max(flops["total"] / 1e6, work["bytes"]["total"] / 1e4))
    assert result["terms"] == ["matrix", "vector", "recurrence", "memory", "transfer"]
    faster = bounds(work, {**CEILINGS, "recurrence_flops_per_s": 1e6})
    assert faster["recurrence_seconds"] == pytest.approx(flops["recurrence"] / 1e6)
    assert faster["transfer_seconds"] is None and "transfer" not in faster["terms"]


def test_missing_ceilings_leave_bounds_absent_not_zero():
    work = useful_work(TEXT, None, Geometry((), (5,), (-1,), candidates=2, image_patches=0))
    no_vector = bounds(work, {"matrix_flops_per_s": 1e6, "bandwidth_bytes_per_s": 1e4})
    assert no_vector["vector_seconds"] is None and no_vector["recurrence_seconds"] is None
    assert no_vector["sum_seconds"] is None and no_vector["critical_path_seconds"] is None
    assert no_vector["t_lower_seconds"] is not None  # it needs only the matrix rate and bandwidth
    no_link = bounds(work, {key: value for key, value in CEILINGS.items() if key != "transfer_bytes_per_s"},
                     transfer_bytes=500)
    assert no_link["transfer_seconds"] is None and no_link["max_seconds"] is None
    no_bandwidth = bounds(work, {"matrix_flops_per_s": 1e6, "vector_flops_per_s": 1e5})
    assert no_bandwidth["memory_seconds"] is None and no_bandwidth["t_lower_seconds"] is None


def test_efficiency_is_the_lower_bound_over_the_measured_time():
    assert efficiency(0.5, 2.0) == 0.25
    assert efficiency(None, 2.0) is None
    with pytest.raises(ValueError, match="positive"):
        efficiency(0.5, 0.0)


def test_a_record_of_work_and_bounds_on_every_device_is_json():
    geometry = Geometry((128,), (20, 30), (0, 0), candidates=6, image_patches=1024)
    work = useful_work(QWEN3_5_0_8B["text_config"], QWEN3_5_0_8B["vision_config"], geometry)
    parts = stages(QWEN3_5_0_8B["text_config"], QWEN3_5_0_8B["vision_config"], geometry)
    for name, ceilings in DEVICES.items():
        result = bounds(work, ceilings, transfer_bytes=4 * 1024 * 1536, stage_list=parts)
        record = {"device": name, "source": ceilings["source"], "work": work, "bounds": result,
                  "efficiency": efficiency(result["t_lower_seconds"], 0.01)}
        assert json.loads(json.dumps(record)) == record
        assert set(result) == {"matrix_seconds", "vector_seconds", "recurrence_seconds", "memory_seconds",
                               "transfer_seconds", "sum_seconds", "max_seconds", "critical_path_seconds",
                               "t_lower_seconds", "terms"}
        assert all(result[key] > 0 for key in result if key.endswith("_seconds"))
    assert set(work) == {"flops", "bytes", "tokens"}
    assert set(work["flops"]) == {"matrix", "attention", "recurrence", "vector", "head", "vision", "total"}
    assert set(work["bytes"]) == {"weights", "embedding", "activations", "states", "total"}


def _row(ids, shared, markers, image=None):
    return Row(tuple(ids), tuple(markers), None, shared, () if image is None else (image,),
               () if image is None else ((2, 2),))


def test_geometry_from_a_packed_batch_with_a_shared_prefix():
    first = list(range(10, 80))  # 70 tokens in common: the prefix
    rows = [_row(first + [1, 0], 70, [71]), _row(first + [3, 4, 0], 70, [71, 72]), _row([7, 8, 0], 2, [2])]
    batch = pack_rows(rows, [], image_pad_id=-1)
    geometry = geometry_from_batch(batch)
    assert geometry == Geometry((70,), (72 - 70, 73 - 70, 3), (0, 0, -1), candidates=4, image_patches=0)
    assert geometry.useful_tokens == batch.computed_tokens


def test_geometry_from_a_batch_with_an_image_encoded_or_cached():
    rows = [_row([50, 77, 77, 77, 77, 51, 0], 6, [6], image=0)]
    image = EncodedImage(pixel_values=torch.zeros(16, 24), grid_thw=torch.tensor([[1, 4, 4]]))  # 4 merged tokens
    batch = pack_rows(rows, [image], image_pad_id=77)
    encoded = geometry_from_batch(batch)
    assert encoded == Geometry((), (7,), (-1,), candidates=1, image_patches=16, image_sizes=(16,))
    assert geometry_from_batch(batch, vision_encoded=False).image_patches == 0


def _geometry():
    return Geometry((64,), (5, 9), (0, 0), candidates=5, image_patches=16)


def test_stages_sum_to_the_useful_work_by_category():
    geometry = _geometry()
    work = useful_work(TEXT, VISION, geometry)
    parts = stages(TEXT, VISION, geometry)
    summed = total(parts)
    assert summed["flops"] == work["flops"]
    assert summed["bytes"]["total"] == work["bytes"]["total"]
    names = [stage.name for stage in parts]
    assert names[:2] == ["vision", "embedding"] and names[-2:] == ["final norm", "head"]
    assert names.index("0.delta.rule") < names.index("0.mlp") < names.index("1.attention.scores")


def test_checkpointing_recomputes_what_follows_each_token_mixer_or_whole_layers_past_the_bound():
    geometry = _geometry()
    parts = {stage.name: stage for stage in stages(TEXT, None, Geometry((64,), (5, 9), (0, 0), 5, 0))}
    recomputed = {name for name, stage in parts.items() if stage.recomputed}
    assert recomputed == {"0.delta.output", "0.mlp", "1.attention.output", "1.mlp"}
    again = total(stages(TEXT, None, Geometry((64,), (5, 9), (0, 0), 5, 0)), recomputed_only=True)
    tokens = geometry.useful_tokens
    # Hand count: the delta layer's out_proj and MLP over every token; the last layer's o_proj
    # and MLP at its 5 markers.
    matrix = 2 * tokens * (8 * 8 + (8 * 16 + 8 * 16 + 16 * 8)) + 2 * 5 * (8 * 8 + (8 * 16 + 8 * 16 + 16 * 8))
    assert again["flops"]["matrix"] == matrix and again["flops"]["recurrence"] == 0
    assert again["flops"].get("attention", 0) == 0
    whole = total(stages(TEXT, None, Geometry((64,), (5, 9), (0, 0), 5, 0), whole_layers=True), recomputed_only=True)
    assert whole["flops"]["recurrence"] == RECURRENCE_PER_TOKEN * tokens  # the delta rule itself is recomputed too
    assert whole["flops"]["attention"] > 0 and whole["flops"]["matrix"] > matrix


def test_the_critical_path_adds_each_stage_at_its_own_bound():
    # Two stages: one all compute (2 s at 1 FLOP/s), one all bytes (3 s at 1 B/s). Whole-work
    # overlap would say max(2, 3) = 3 s; one after another they take 5 s, plus the transfer.
    slow = {"matrix_flops_per_s": 1.0, "vector_flops_per_s": 1.0, "bandwidth_bytes_per_s": 1.0,
            "transfer_bytes_per_s": 1.0}
    parts = [Stage("compute", {"matrix": 2}, 0), Stage("memory", {}, 3)]
    work = {"flops": {**total(parts)["flops"]}, "bytes": {"total": 3}}
    result = bounds(work, slow, transfer_bytes=1, stage_list=parts)
    assert result["max_seconds"] == 3 and result["critical_path_seconds"] == 6 and result["sum_seconds"] == 6
    mixed = [Stage("a", {"matrix": 2}, 1), Stage("b", {"vector": 1}, 3)]  # a: 2 s compute; b: 3 s memory
    result = bounds({"flops": total(mixed)["flops"], "bytes": {"total": 4}}, slow, stage_list=mixed)
    assert result["critical_path_seconds"] == 5 and result["max_seconds"] == 4 and result["sum_seconds"] == 7
    assert stage_seconds(Stage("x", {"vector": 1}, 0), {"matrix_flops_per_s": 1.0}) is None  # a missing ceiling


def test_efficiency_against_each_bound():
    geometry = _geometry()
    work = useful_work(TEXT, VISION, geometry)
    result = bounds(work, CEILINGS, transfer_bytes=500, stage_list=stages(TEXT, VISION, geometry))
    shares = efficiencies(result, 2.0)
    assert set(shares) == {"matrix", "vector", "recurrence", "memory", "transfer", "critical_path", "t_lower"}
    for name, share in shares.items():
        assert share == pytest.approx(result[f"{name}_seconds"] / 2.0)
    assert result["max_seconds"] <= result["critical_path_seconds"] <= result["sum_seconds"]
