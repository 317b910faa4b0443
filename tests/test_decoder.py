"""Our packed Qwen3.5 language forward against Hugging Face's padded one."""

import pytest
import torch

from dohnuts.base import load_backbone
from dohnuts.config import LoraConfig
from dohnuts.decoder import causal_attention, packed_forward
from dohnuts.model import build_training_model
from dohnuts.schema import parse_request

TOLERANCE = 1e-4  # float32, max abs error on final hidden states
# Gradients: max abs error relative to the largest gradient. Hugging Face's chunked delta rule
# runs in float32 whatever the model dtype, so even float64 models differ by about 2e-4.
GRADIENT_TOLERANCE = 1e-3


def _rows(tiny):
    """Two text requests of different lengths: three rows."""
    template = tiny.template()
    first = parse_request({"customer": "Mina", "plan": "business"}, {
        "plan": {"type": "choice", "instructions": "Which plan?", "criteria": ["free", "business", "enterprise"]},
        "angry": {"type": "noul", "instructions": "Is the customer angry?"},
    }, template.reserved)
    second = parse_request("Customer: I was billed twice and want a refund today.", {
        "urgent": {"type": "score", "instructions": "How urgent?", "criteria": ["low", "high"]}}, template.reserved)
    return template.encode(first, 4096) + template.encode(second, 4096)


def _packed_inputs(language_model, rows):
    ids = torch.tensor([token for row in rows for token in row.input_ids], device=language_model.device)
    positions = torch.cat([torch.arange(len(row.input_ids)) for row in rows]).expand(3, -1)
    cu = torch.tensor([0] + [len(row.input_ids) for row in rows]).cumsum(0)
    return language_model.get_input_embeddings()(ids), positions, cu


def _hugging_face(language_model, rows, device="cpu"):
    """Reference: Hugging Face's padded batch forward, unpadded afterwards."""
    length = max(len(row.input_ids) for row in rows)
    ids = torch.zeros((len(rows), length), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for index, row in enumerate(rows):
        ids[index, : len(row.input_ids)] = torch.tensor(row.input_ids)
        mask[index, : len(row.input_ids)] = 1
    hidden = language_model(input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=False).last_hidden_state
    return torch.cat([hidden[index, : len(row.input_ids)] for index, row in enumerate(rows)])


def test_packed_forward_matches_hugging_face_padded_forward(tiny):
    language_model = load_backbone(tiny.base, torch.float32).language_model.eval()
    rows = _rows(tiny)
    embeds, positions, cu = _packed_inputs(language_model, rows)
    with torch.no_grad():
        ours = packed_forward(language_model, embeds, positions, cu)
        reference = _hugging_face(language_model, rows)
    assert (ours - reference).abs().max().item() <= TOLERANCE


def test_packed_forward_gradients_match_hugging_face_with_lora_and_checkpointing(tiny):
    model, _ = build_training_model(tiny.base, "float32", LoraConfig(), 0.01, seed=0)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0.0, 0.05)
    language_model = model.backbone.language_model.train()
    rows = _rows(tiny)
    weights = torch.randn(sum(len(row.input_ids) for row in rows), language_model.config.hidden_size)
    lora = [p for name, p in language_model.named_parameters() if "lora_" in name]

    embeds, positions, cu = _packed_inputs(language_model, rows)
    ours = torch.autograd.grad((packed_forward(language_model, embeds, positions, cu, True) * weights).sum(), lora)
    reference = torch.autograd.grad((_hugging_face(language_model, rows) * weights).sum(), lora)
    for ours_grad, reference_grad in zip(ours, reference):
        scale = reference_grad.abs().max().clamp_min(1e-8)
        assert ((ours_grad - reference_grad).abs().max() / scale).item() <= GRADIENT_TOLERANCE


def test_packed_attention_equals_causal_attention_of_each_row_alone():
    lengths = [5, 1, 9]
    cu = torch.tensor([0] + lengths).cumsum(0)
    query, key, value = (torch.randn(sum(lengths), 2, 4) for _ in range(3))
    out = causal_attention(query, key, value, cu, 0.5)
    for begin, end in zip(cu[:-1].tolist(), cu[1:].tolist()):
        q, k, v = (x[begin:end].transpose(0, 1) for x in (query, key, value))
        expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.5)
        torch.testing.assert_close(out[begin:end], expected.transpose(0, 1))


@pytest.mark.gpu
def test_packed_forward_matches_hugging_face_on_cuda(tiny):
    """Fused kernels and packing on the GPU against Hugging Face's padded forward (float32)."""
    language_model = load_backbone(tiny.base, torch.float32).language_model.cuda().eval()
    rows = _rows(tiny)
    embeds, positions, cu = _packed_inputs(language_model, rows)
    with torch.no_grad():
        ours = packed_forward(language_model, embeds, positions.cuda(), cu.cuda())
        reference = _hugging_face(language_model, rows, device="cuda")
    assert (ours - reference).abs().max().item() <= 2e-3  # TF32 matmuls and chunked kernels
