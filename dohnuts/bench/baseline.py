"""The baseline: Hugging Face's own padded forward on a request, and the tokens it computes."""

from __future__ import annotations

import inspect

import torch

from ..schema import parse_request


def baseline_rows(predictor, state, questions):
    """(the encoded image of each vision block, rows) of a request, always preprocessed (no
    feature cache)."""
    template = predictor.template
    request = parse_request(state, questions, template.reserved, template.max_images)
    images = []
    indices = template.encode_images(request, images)
    placed = tuple(images[index] for index in indices)
    return placed, template.encode(request, predictor.config.max_tokens, indices, images)

@torch.no_grad()
def hugging_face_logits(predictor, state, questions) -> torch.Tensor:
    """The baseline on the same inputs: Hugging Face's own `Qwen3_5Model` forward over the
    request's rows padded to the longest (no packing, no shared prefix), then the same
    marker gather and head. Returns logits [B, K]."""
    template, backbone, device = predictor.template, predictor.model.backbone, predictor.model.device
    images, rows = baseline_rows(predictor, state, questions)
    length = max(len(row.input_ids) for row in rows)
    ids = torch.full((len(rows), length), template.pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for index, row in enumerate(rows):
        ids[index, : len(row.input_ids)] = torch.tensor(row.input_ids)
        mask[index, : len(row.input_ids)] = 1
    ids, mask = ids.to(device), mask.to(device)
    kwargs = {}
    if images:  # each row's blocks, in order, row after row
        kwargs = {"pixel_values": torch.cat([image.patches(device) for image in images]).repeat(len(rows), 1),
                  "image_grid_thw": torch.cat([image.grid_thw for image in images]).repeat(len(rows), 1).to(device)}
        if "mm_token_type_ids" in inspect.signature(backbone.forward).parameters:  # transformers >= 5.23
            kwargs["mm_token_type_ids"] = (ids == template.image_pad_id).int()
    hidden = backbone(input_ids=ids, attention_mask=mask, use_cache=False, **kwargs).last_hidden_state
    markers = torch.zeros((len(rows), max(len(row.markers) for row in rows)), dtype=torch.long)
    for index, row in enumerate(rows):
        markers[index, : len(row.markers)] = torch.tensor(row.markers)
    picked = hidden[torch.arange(len(rows), device=device)[:, None], markers.to(device)]
    return predictor.model.head(picked.to(predictor.model.head.weight.dtype)).squeeze(-1)

def distinct_tokens(rows) -> int:
    """Tokens that are distinct computations: a token is the same computation in two rows when
    the rows' images and every token up to it are the same (the model is causal). The size of
    a trie of the rows, one root per set of images."""
    nodes: set = set()
    for row in rows:
        node = ("images", row.images)
        for token in row.input_ids:
            node = (hash(node), token)
            nodes.add(node)
    return len(nodes)

def padded_baseline(rows) -> dict:
    """Tokens the padded, unshared baseline computes: beyond the useful ones, its padding, and
    the tokens it computes more than once (the shared beginning of a request's rows, once per
    row after the first)."""
    lengths = [len(row.input_ids) for row in rows]
    computed = len(rows) * max(lengths)
    return {"computed_tokens": computed, "padding_tokens": computed - sum(lengths),
            "repeated_prefix_tokens": sum(lengths) - distinct_tokens(rows)}
