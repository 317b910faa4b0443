"""Our packed Qwen3.5 language forward against Hugging Face's padded one."""

import importlib.util

import pytest
import torch

from dohnuts.config import LoraConfig
from dohnuts.model import decoder
from dohnuts.model.base import load_backbone
from dohnuts.model.decoder import Prefixes, Segments, packed_forward, project
from dohnuts.ops import kernels
from dohnuts.ops.plan import plan_fork
from dohnuts.runtime.checkpoint import build_training_model
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


# Hugging Face's CPU reference is reachable only without flash-linear-attention: once FLA is
# importable, transformers sends its delta rule to FLA's Triton kernels whatever the device, and
# they refuse CPU tensors. Machines with FLA have CUDA; there the *_on_cuda tests below compare
# against Hugging Face's forward on the GPU.
HUGGING_FACE_ON_CPU = pytest.mark.skipif(importlib.util.find_spec("fla") is not None,
                                         reason="transformers runs its CPU reference through FLA's GPU kernels")


@HUGGING_FACE_ON_CPU
def test_packed_forward_matches_hugging_face_padded_forward(tiny):
    language_model = load_backbone(tiny.base, torch.float32).language_model.eval()
    rows = _rows(tiny)
    embeds, positions, cu = _packed_inputs(language_model, rows)
    with torch.no_grad():
        ours = packed_forward(language_model, embeds, positions, cu)
        reference = _hugging_face(language_model, rows)
    assert (ours - reference).abs().max().item() <= TOLERANCE


@HUGGING_FACE_ON_CPU
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


def test_packed_attention_with_prefix_keys_equals_attention_of_each_row_alone():
    """Bottom-right causal attention: queries [5, 1, 9] after [3, 0, 4] prefix keys, 4 query heads
    on 2 key heads, against per-row SDPA with an explicit mask."""
    queries, prefixes = [5, 1, 9], [3, 0, 4]
    keys = [q + p for q, p in zip(queries, prefixes)]
    cu_q = torch.tensor([0] + queries).cumsum(0).int()
    cu_k = torch.tensor([0] + keys).cumsum(0).int()
    query = torch.randn(sum(queries), 4, 8)
    key, value = torch.randn(sum(keys), 2, 8), torch.randn(sum(keys), 2, 8)
    out = kernels.attention(query, key, value, cu_q, cu_k, max(queries), max(keys), 0.5)
    for index, (count, lead) in enumerate(zip(queries, prefixes)):
        q = query[cu_q[index]:cu_q[index + 1]].transpose(0, 1)
        k, v = (x[cu_k[index]:cu_k[index + 1]].repeat_interleave(2, dim=1).transpose(0, 1) for x in (key, value))
        mask = torch.ones(count, count + lead, dtype=torch.bool).tril(diagonal=lead)
        expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.5)
        torch.testing.assert_close(out[cu_q[index]:cu_q[index + 1]], expected.transpose(0, 1))


def test_packed_projection_weights_keep_names_and_values_and_change_no_output(tiny):
    """`pack_projections` lays each group's weights out in one matrix (views, same names and
    values), after which each group runs as one product: the forward is unchanged (float32)."""
    language_model = load_backbone(tiny.base, torch.float32).language_model.eval()
    rows = _rows(tiny)
    embeds, positions, cu = _packed_inputs(language_model, rows)
    before = {name: tensor.clone() for name, tensor in language_model.state_dict().items()}
    with torch.no_grad():
        unpacked = packed_forward(language_model, embeds, positions, cu)
    layers = language_model.config.num_hidden_layers
    assert decoder.pack_projections(language_model) == 2 * layers  # a token mixer's and the MLP's
    assert decoder.pack_projections(language_model) == 0  # already packed
    after = language_model.state_dict()
    assert list(after) == list(before)
    assert all(torch.equal(after[name], before[name]) for name in before)
    mlp = language_model.layers[0].mlp
    assert mlp.up_proj.weight.data_ptr() == mlp.gate_proj.weight.data_ptr() + mlp.gate_proj.weight.nbytes
    products = []
    with torch.no_grad(), _counting(products):
        packed = packed_forward(language_model, embeds, positions, cu)
    assert len(products) == 4 * layers  # input side, output projection, MLP in and out
    torch.testing.assert_close(packed, unpacked, rtol=1e-5, atol=1e-5)


class _counting(torch.overrides.TorchFunctionMode):
    """Counts F.linear calls into a list."""

    def __init__(self, calls):
        super().__init__()
        self.calls = calls

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.nn.functional.linear:
            self.calls.append(args[1].shape)
        return func(*args, **(kwargs or {}))


@pytest.mark.gpu
@pytest.mark.parametrize("packed", [False, True])
def test_packed_forward_matches_hugging_face_on_cuda(tiny, packed):
    """Fused kernels and packing on the GPU against Hugging Face's padded forward (float32); with
    `packed`, projection groups as one product whose column blocks the kernels read in place."""
    language_model = load_backbone(tiny.base, torch.float32).language_model.cuda().eval()
    if packed:
        assert decoder.pack_projections(language_model) > 0
    rows = _rows(tiny)
    embeds, positions, cu = _packed_inputs(language_model, rows)
    with torch.no_grad():
        ours = packed_forward(language_model, embeds, positions.cuda(), cu.cuda())
        reference = _hugging_face(language_model, rows, device="cuda")
    assert (ours - reference).abs().max().item() <= 2e-3  # TF32 matmuls and chunked kernels


@pytest.mark.gpu
def test_packed_projections_match_unpacked_in_bf16_on_cuda(tiny):
    """In bf16 on the GPU (flash attention reading the value heads as a strided view of one
    product's output, the fused kernels reading column blocks), a packed frozen model gives the
    unpacked one's outputs and input gradients, within bf16 rounding (2% of the largest)."""
    import copy

    language_model = load_backbone(tiny.base, torch.bfloat16).language_model.cuda().eval().requires_grad_(False)
    packed = copy.deepcopy(language_model)
    assert decoder.pack_projections(packed) > 0
    rows = _rows(tiny)
    embeds, positions, cu = _packed_inputs(language_model, rows)
    results = []
    for model in (language_model, packed):
        leaf = embeds.detach().clone().requires_grad_()
        out = packed_forward(model, leaf, positions.cuda(), cu.to("cuda", torch.int32))  # as a Batch holds it
        probe = torch.randn(out.shape, device="cuda", generator=torch.Generator("cuda").manual_seed(5))
        results.append((out.float(), torch.autograd.grad((out.float() * probe).sum(), leaf)[0].float()))
    (plain, plain_grad), (ours, ours_grad) = results
    assert (ours - plain).abs().max().item() <= 2e-2 * plain.abs().max().item()
    assert (ours_grad - plain_grad).abs().max().item() <= 2e-2 * plain_grad.abs().max().item()


def _shared_case(tiny, language_model):
    """Two requests (3 and 2 questions) as full rows and as shared prefixes plus suffixes."""
    template = tiny.template()
    first = parse_request({"customer": "Mina", "plan": "business", "note": "billed twice"}, {
        "plan": {"type": "choice", "instructions": "Which plan?", "criteria": ["free", "business", "enterprise"]},
        "angry": {"type": "noul", "instructions": "Is the customer angry?"},
        "urgent": {"type": "score", "instructions": "How urgent?", "criteria": ["low", "mid", "high"]},
    }, template.reserved)
    second = parse_request("Customer: the app crashes at login.", {
        "topic": {"type": "choice", "instructions": "Topic?", "criteria": ["login", "billing"]},
        "angry": {"type": "noul", "instructions": "Is the customer angry?"},
    }, template.reserved)
    groups = [template.encode(first, 4096), template.encode(second, 4096)]
    embed = language_model.get_input_embeddings()
    full, prefixes, suffixes, parents = [], [], [], []
    for parent, rows in enumerate(groups):
        split = min(next(i for i, (a, b) in enumerate(zip(rows[0].input_ids, rows[1].input_ids)) if a != b),
                    min(min(row.markers) for row in rows))
        prefixes.append(torch.tensor(rows[0].input_ids[:split]))
        for row in rows:
            full.append(torch.tensor(row.input_ids))
            suffixes.append(torch.tensor(row.input_ids[split:]))
            parents.append(parent)
        assert all(row.input_ids[:split] == rows[0].input_ids[:split] for row in rows)

    def packed(sequences, offsets=None):
        ids = torch.cat(sequences)
        starts = offsets or [0] * len(sequences)
        positions = torch.cat([torch.arange(len(s)) + start for s, start in zip(sequences, starts)]).expand(3, -1)
        cu = torch.tensor([0] + [len(s) for s in sequences]).cumsum(0)
        return embed(ids), positions, cu

    split_of = [len(prefixes[p]) for p in parents]
    fork = plan_fork([len(p) for p in prefixes], [len(s) for s in suffixes], parents)
    (head, head_positions, head_cu), (tail, tail_positions, tail_cu) = packed(prefixes), packed(suffixes, split_of)
    shared = (torch.cat([head, tail]), torch.cat([head_positions, tail_positions], dim=1), tail_cu)
    return packed(full), shared, Prefixes(len(head), Segments.of(head_cu), fork), split_of


def _float64_lora_model(tiny):
    """(language model in float64 and train mode, its LoRA parameters), B matrices non-zero."""
    model, _ = build_training_model(tiny.base, "float32", LoraConfig(), 0.01, seed=0)
    model.double()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0.0, 0.05)
    language_model = model.backbone.language_model.train()
    return language_model, [p for name, p in language_model.named_parameters() if "lora_" in name]


def test_shared_prefixes_match_unshared_rows_in_outputs_and_gradients(tiny):
    # float64 so that the comparison sees the algorithm, not float32 rounding, at 1e-5 relative.
    language_model, lora = _float64_lora_model(tiny)
    full, shared_inputs, prefixes, split_of = _shared_case(tiny, language_model)

    unshared = packed_forward(language_model, *full, activation_checkpointing=True)
    # The suffix tokens of each full row, in row order.
    keep = torch.cat([torch.arange(start + split, end) for start, end, split
                      in zip(full[2][:-1].tolist(), full[2][1:].tolist(), split_of)])
    unshared = unshared[keep]
    shared = packed_forward(language_model, *shared_inputs, activation_checkpointing=True, prefixes=prefixes)
    scale = unshared.abs().max()
    assert ((shared - unshared).abs().max() / scale).item() <= 1e-5

    weights = torch.randn(unshared.shape, dtype=unshared.dtype)
    expected = torch.autograd.grad((unshared * weights).sum(), lora, retain_graph=True)
    actual = torch.autograd.grad((shared * weights).sum(), lora)
    for ours, reference in zip(actual, expected):
        assert ((ours - reference).abs().max() / reference.abs().max().clamp_min(1e-12)).item() <= 1e-5


@pytest.mark.parametrize("keep_tokens", [8192, 1])
@pytest.mark.parametrize("shared", [True, False])
def test_picked_tokens_equal_the_whole_forward_at_them_in_outputs_and_gradients(tiny, monkeypatch, shared,
                                                                                keep_tokens):
    """With `picked`, the last layer's output side and the final norm run at those rows' tokens
    only (when fewer than the rows' tokens); in float64 the states equal the whole forward's at
    them (to 1e-12 relative), and so do the LoRA gradients, with prefixes or without, with the
    layers' tails or whole layers recomputed under checkpointing. A picked token may repeat (a
    padded marker reads token 0)."""
    monkeypatch.setattr(decoder, "MIXER_KEEP_TOKENS", keep_tokens)
    language_model, lora = _float64_lora_model(tiny)
    full_inputs, shared_inputs, prefixes, _ = _shared_case(tiny, language_model)
    inputs, prefixes = (shared_inputs, prefixes) if shared else (full_inputs, None)
    whole = packed_forward(language_model, *inputs, activation_checkpointing=True, prefixes=prefixes)
    tokens = whole.shape[0]
    # Fewer than the rows' tokens: the last layer's output side runs at them only. As many or
    # more (padded markers can be): the whole layer runs, and the states are picked after it.
    for picked, early in ((torch.tensor([0, 3, 4, 4, tokens - 1, 0]), True),
                          (torch.arange(tokens + 3) % tokens, False)):
        assert decoder.picks_early(picked, tokens) == early
        ours = packed_forward(language_model, *inputs, activation_checkpointing=True, prefixes=prefixes,
                              picked=picked)
        expected = whole[picked]
        assert ours.shape == expected.shape
        assert ((ours - expected).abs().max() / expected.abs().max()).item() <= 1e-12

        weights = torch.randn(expected.shape, dtype=expected.dtype, generator=torch.Generator().manual_seed(3))
        reference = torch.autograd.grad((expected * weights).sum(), lora, retain_graph=True)
        actual = torch.autograd.grad((ours * weights).sum(), lora)
        for mine, theirs in zip(actual, reference):
            assert ((mine - theirs).abs().max() / theirs.abs().max().clamp_min(1e-12)).item() <= 1e-10


def _lora_linear(dtype, dropout=0.0, lora_bias=False):
    """A peft LoRA Linear (adapters in float32, as peft keeps them) with a non-zero B."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    torch.manual_seed(0)
    outer = torch.nn.Sequential(torch.nn.Linear(24, 40, bias=False)).to(dtype)
    config = PeftLoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, target_modules=["0"], lora_bias=lora_bias)
    peft_model = get_peft_model(outer, config)
    module = peft_model.base_model.model[0]
    with torch.no_grad():
        module.lora_B["default"].weight.normal_(0.0, 0.5)
        if lora_bias:
            module.lora_B["default"].bias.normal_(0.0, 0.5)
    return peft_model, module


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-6), (torch.bfloat16, 2e-2)])
def test_project_equals_peft_lora_in_outputs_and_gradients(dtype, tolerance):
    """Max abs error relative to the largest value: 1e-6 in float32, where both run the same
    math; bf16 tolerance in bfloat16, where ours keeps the adapter in bf16 and peft in float32."""
    _, module = _lora_linear(dtype)
    adapter = [module.lora_A["default"].weight, module.lora_B["default"].weight]
    x = torch.randn(2, 7, 24, dtype=dtype, requires_grad=True)
    weights = torch.randn(2, 7, 40)
    results = []
    for run in (project, lambda m, h: m(h)):
        out = run(module, x)
        results.append((out, *torch.autograd.grad((out.float() * weights).sum(), [x] + adapter)))
    assert results[0][0].dtype == dtype
    for ours, reference in zip(*results):
        scale = reference.float().abs().max()
        assert scale > 0 and ((ours.float() - reference.float()).abs().max() / scale).item() <= tolerance


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_projections_of_one_input_equal_each_peft_module_in_outputs_and_gradients(dtype, tolerance):
    """A delta-rule layer's four input projections' widths (48, 3, 3, 16) as one group against
    each peft LoRA module's own forward: outputs, and gradients of the input and of every A and
    B, as in the single-module test."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    torch.manual_seed(0)
    widths = [48, 3, 3, 16]
    outer = torch.nn.Sequential(*[torch.nn.Linear(24, width, bias=False) for width in widths]).to(dtype)
    peft_model = get_peft_model(outer, PeftLoraConfig(r=4, lora_alpha=8, target_modules=["0", "1", "2", "3"]))
    modules = list(peft_model.base_model.model)
    with torch.no_grad():
        for module in modules:
            module.lora_B["default"].weight.normal_(0.0, 0.5)
    adapters = [weight for module in modules for weight in (module.lora_A["default"].weight,
                                                             module.lora_B["default"].weight)]
    x = torch.randn(2, 7, 24, dtype=dtype, requires_grad=True)
    weights = [torch.randn(2, 7, width) for width in widths]
    results = []
    for run in (decoder.projections, lambda group, h: [module(h) for module in group]):
        outs = run(modules, x)
        loss = sum((out.float() * weight).sum() for out, weight in zip(outs, weights))
        results.append((*outs, *torch.autograd.grad(loss, [x] + adapters)))
    assert all(out.dtype == dtype and out.shape == (2, 7, width) for out, width in zip(results[0], widths))
    for ours, reference in zip(*results):
        scale = reference.float().abs().max()
        assert scale > 0 and ((ours.float() - reference.float()).abs().max() / scale).item() <= tolerance


def test_a_mixed_group_runs_its_plain_lora_projections_together_and_the_rest_alone(monkeypatch):
    """A group of a plain LoRA module, one with LoRA dropout and a plain Linear: the plain LoRA
    one takes the one-node path, the others their own forwards (the same dropout mask as peft's
    for the same seed); outputs and every gradient equal the modules' own. In eval mode the
    dropout is inactive, so that module takes the one-node path too."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    torch.manual_seed(0)
    models = [get_peft_model(torch.nn.Sequential(torch.nn.Linear(24, width, bias=False)),
                             PeftLoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=dropout, target_modules=["0"]))
              for width, rank, dropout in ((8, 4, 0.0), (5, 2, 0.3))]
    first, second = (model.base_model.model[0] for model in models)
    plain = torch.nn.Linear(24, 3)
    for module in (first, second):
        with torch.no_grad():
            module.lora_B["default"].weight.normal_(0.0, 0.5)
    adapters = [weight for module in (first, second)
                for weight in (module.lora_A["default"].weight, module.lora_B["default"].weight)]
    calls = []
    lora_linear = decoder.lora_linear
    monkeypatch.setattr(decoder, "lora_linear", lambda x, bases, *rest: calls.append(len(bases)) or
                        lora_linear(x, bases, *rest))
    x = torch.randn(6, 24, requires_grad=True)
    modules = [first, second, plain]
    for training, expected_calls in ((True, [1]), (False, [2])):
        for model in models:
            model.train(training)
        calls.clear()
        results = []
        for run in (decoder.projections, lambda group, h: [module(h) for module in group]):
            torch.manual_seed(1)
            outs = run(modules, x)
            loss = sum((out * (index + 1)).sum() for index, out in enumerate(outs))
            results.append((*outs, *torch.autograd.grad(loss, [x] + adapters)))
        assert calls == expected_calls
        for ours, reference in zip(*results):
            assert torch.allclose(ours, reference, atol=1e-5)


def test_project_runs_modules_own_forward_when_merged_disabled_or_plain():
    peft_model, module = _lora_linear(torch.float32, dropout=0.3)
    x = torch.randn(5, 24)
    torch.manual_seed(1)
    dropped = project(module, x)  # training mode: the same dropout mask as peft's for the same seed
    torch.manual_seed(1)
    assert torch.allclose(dropped, module(x), atol=1e-6)
    module.eval()  # dropout off: merged and unmerged outputs agree
    unmerged = project(module, x)
    with peft_model.disable_adapter():
        assert torch.equal(project(module, x), module.base_layer(x))
    module.merge()
    merged = project(module, x)
    assert torch.equal(merged, module.base_layer(x)) and torch.allclose(merged, unmerged, atol=1e-5)
    plain = torch.nn.Linear(24, 3)
    assert torch.equal(project(plain, x), plain(x))
    _, biased = _lora_linear(torch.float32, lora_bias=True)  # a LoRA bias: peft's own forward
    assert torch.equal(project(biased, x), biased(x))


@pytest.mark.parametrize("keep_tokens", [8192, 1])
def test_checkpointing_recomputes_only_what_follows_each_mixer_and_changes_no_gradient(tiny, monkeypatch,
                                                                                     keep_tokens):
    """float64, shared prefixes: outputs and LoRA and input gradients with and without activation
    checkpointing agree to rounding. In the backward, each MLP reruns once more; a layer's input
    projections (hence its convolution and delta rule, or its attention) rerun only when the
    batch is over MIXER_KEEP_TOKENS (here forced to 1)."""
    monkeypatch.setattr(decoder, "MIXER_KEEP_TOKENS", keep_tokens)
    language_model, lora = _float64_lora_model(tiny)
    _, (embeds, positions, cu), prefixes, _ = _shared_case(tiny, language_model)
    embeds = embeds.detach().requires_grad_()
    calls = {"mlp": 0, "delta": 0, "attention": 0}
    layers = list(zip(language_model.layers, language_model.config.layer_types))
    assert {"linear_attention", "full_attention"} <= {kind for _, kind in layers}
    watched = {id(layer.mlp.gate_proj): "mlp" for layer, _ in layers}
    watched.update({id(layer.linear_attn.in_proj_qkv): "delta" for layer, kind in layers if kind == "linear_attention"})
    watched.update({id(layer.self_attn.q_proj): "attention" for layer, kind in layers if kind == "full_attention"})
    projections = decoder.projections

    def counted(modules, x):
        if id(modules[0]) in watched:
            calls[watched[id(modules[0])]] += 1
        return projections(modules, x)

    monkeypatch.setattr(decoder, "projections", counted)
    deltas = sum(kind == "linear_attention" for _, kind in layers)
    attentions = len(layers) - deltas
    results = {}
    for checkpointed in (False, True):
        calls.update(mlp=0, delta=0, attention=0)
        out = packed_forward(language_model, embeds, positions, cu, checkpointed, prefixes)
        weights = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(0))
        grads = torch.autograd.grad((out * weights).sum(), lora + [embeds])
        results[checkpointed] = (out.detach(), grads)
        recomputed_mixers = checkpointed and embeds.shape[0] > keep_tokens
        again = 2 if recomputed_mixers else 1
        expected = {"mlp": len(layers) * (2 if checkpointed else 1), "delta": deltas * again,
                    "attention": attentions * again}
        assert calls == expected
    (plain, plain_grads), (recomputed, recomputed_grads) = results[False], results[True]
    assert ((plain - recomputed).abs().max() / plain.abs().max()).item() <= 1e-12
    for ours, reference in zip(recomputed_grads, plain_grads):
        assert ((ours - reference).abs().max() / reference.abs().max().clamp_min(1e-30)).item() <= 1e-12


def test_plan_fork_lays_out_each_rows_keys_as_its_prefix_then_its_own_tokens():
    # Token axis: prefix 0 = 0..2, prefix 1 = 3..4, then rows of 2, 1 and 2 tokens (5..6, 7, 8..9)
    # continuing prefix 1, none and prefix 0.
    fork = plan_fork([3, 2], [2, 1, 2], [1, -1, 0])
    assert fork.key_index.tolist() == [0, 1, 2, 3, 4, 3, 4, 5, 6, 7, 0, 1, 2, 8, 9]
    assert fork.cu_seqlens_q.tolist() == [0, 3, 5, 7, 8, 10] and fork.cu_seqlens_k.tolist() == [0, 3, 5, 9, 10, 15]
    assert fork.parents.tolist() == [1, -1, 0] and fork.plan() == (3, 5, True)
    assert fork.key_index.dtype == torch.long and fork.cu_seqlens_k.dtype == torch.int32
    assert plan_fork([4], [1, 2], [0, 0]).plan() == (4, 6, False)


def test_plan_fork_equals_a_plain_layout_of_every_sequences_keys():
    """Random prefixes (empty ones too, as a bucket's padding has), rows of any length and
    parents: the keys, counts and plan `plan_fork` makes in numpy equal those laid out one
    sequence at a time."""
    import random

    generator = random.Random(5)
    for _ in range(300):
        prefixes = [generator.choice((0, 0, 1, 64, 200)) for _ in range(generator.choice((0, 1, 3, 9)))]
        rows = [generator.choice((0, 1, 30, 64, 65)) for _ in range(generator.choice((1, 2, 7, 40)))]
        parents = [generator.randrange(-1, len(prefixes)) for _ in rows]
        starts = [sum(prefixes[:index]) for index in range(len(prefixes) + 1)]
        keys, key_counts = [], []
        for start, length in zip(starts, prefixes):
            keys += range(start, start + length)
            key_counts.append(length)
        at = starts[-1]
        for parent, length in zip(parents, rows):
            inherited = range(starts[parent], starts[parent] + prefixes[parent]) if parent >= 0 else range(0)
            keys += [*inherited, *range(at, at + length)]
            key_counts.append(len(inherited) + length)
            at += length
        queries = prefixes + rows
        fork = plan_fork(prefixes, rows, parents)
        assert fork.key_index.tolist() == keys and fork.parents.tolist() == parents
        assert fork.cu_seqlens_q.tolist() == [sum(queries[:index]) for index in range(len(queries) + 1)]
        assert fork.cu_seqlens_k.tolist() == [sum(key_counts[:index]) for index in range(len(key_counts) + 1)]
        assert fork.plan() == (max(queries), max(key_counts), -1 in parents)
