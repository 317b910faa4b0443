"""The single prompt template: request -> token rows with candidate markers, and batching."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import SPATIAL_MERGE, special_tokens
from .schema import Question, Request


@dataclass(frozen=True)
class Row:
    """One question of one request as token ids.

    `image` indexes the encoded images of the batch this row goes into (None: no image);
    `image_grid` is the merged (height, width) token grid of that image.
    """

    input_ids: tuple[int, ...]
    markers: tuple[int, ...]
    question: Question
    image: int | None = None
    image_grid: tuple[int, int] | None = None


@dataclass
class EncodedImage:
    pixel_values: torch.Tensor  # [patches, C * temporal * patch * patch]
    grid_thw: torch.Tensor  # [1, 3]


@dataclass
class Batch:
    """Right-padded rows ready for the model."""

    input_ids: torch.Tensor  # [B, T]
    attention_mask: torch.Tensor  # [B, T]
    position_ids: torch.Tensor  # [3, B, T] M-RoPE (temporal, height, width)
    markers: torch.Tensor  # [B, K] marker positions, 0 where the candidate is absent
    candidate_mask: torch.Tensor  # [B, K] bool
    pixel_values: torch.Tensor | None  # [patches, D] of the batch's distinct images
    image_grid_thw: torch.Tensor | None  # [images, 3]
    row_images: torch.Tensor  # [B] index into the batch's images, -1 for none

    def to(self, device) -> Batch:
        moved = {name: None if value is None else value.to(device, non_blocking=True)
                 for name, value in vars(self).items()}
        return Batch(**moved)


class Template:
    """Renders validated requests with the template of recipe.md and enforces the token budget.

        [<|vision_start|><|image_pad|>...<|vision_end|>\\n]State: {state}\\n
        {type} question: {instructions}\\nOptions:\\n- {candidate 1}<M>- {candidate 2}<M>...

    Every piece is tokenised on its own, so the shared beginning of a request's rows is the
    same token sequence in each row.
    """

    def __init__(self, tokenizer, image_processor, marker: str):
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        self.reserved = tuple(special_tokens(marker))
        ids = tokenizer.convert_tokens_to_ids(list(self.reserved))
        unknown = [token for token, index in zip(self.reserved, ids)
                   if index is None or tokenizer.convert_ids_to_tokens(index) != token]
        if unknown:
            raise ValueError(f"the tokenizer lacks the special tokens {unknown}")
        self.marker_id, self.vision_start_id, self.vision_end_id, self.image_pad_id = ids[:4]
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else ids[-1]
        self.newline_ids = tokenizer("\n", add_special_tokens=False)["input_ids"]

    def encode_image(self, image) -> EncodedImage:
        out = self.image_processor(images=[image], return_tensors="pt")
        return EncodedImage(out["pixel_values"], out["image_grid_thw"])

    def encode(self, request: Request, max_tokens: int, image_index: int | None = None,
               image: EncodedImage | None = None) -> list[Row]:
        """Token rows of a request, one per question, in question order.

        Args:
            request: the validated request.
            max_tokens: the budget; a longer row is rejected, never truncated.
            image_index: index the rows' image will have in its batch.
            image: the request's encoded image (required when the request has one).

        Raises:
            ValueError: a row is over the token budget.
        """
        texts = [f"State: {request.state_text}\n"]
        for question in request.questions:
            texts.append(f"{question.kind} question: {question.instructions}\nOptions:\n")
            texts.extend(f"- {candidate}" for candidate in question.candidates)
        # split_special_tokens: user text such as "<|im_start|>" stays text, never a control token.
        pieces = iter(self.tokenizer(texts, add_special_tokens=False, split_special_tokens=True)["input_ids"])
        prefix, grid = [], None
        if request.image is not None:
            thw = image.grid_thw[0].tolist()
            grid = (thw[1] // SPATIAL_MERGE, thw[2] // SPATIAL_MERGE)
            prefix = [self.vision_start_id] + [self.image_pad_id] * (grid[0] * grid[1]) + [self.vision_end_id]
            prefix = prefix + self.newline_ids
        prefix = prefix + next(pieces)
        rows = []
        for question in request.questions:
            ids = prefix + next(pieces)
            markers = []
            for _ in question.candidates:
                ids = ids + next(pieces) + [self.marker_id]
                markers.append(len(ids) - 1)
            if len(ids) > max_tokens:
                raise ValueError(
                    f"question {question.qid!r}: the input is {len(ids)} tokens, over the budget of "
                    f"{max_tokens}; inputs are rejected, never truncated"
                )
            rows.append(Row(tuple(ids), tuple(markers), question,
                            image_index if request.image is not None else None, grid))
        return rows

    def collate(self, rows: list[Row], images: list[EncodedImage]) -> Batch:
        """Right-pad rows into one batch; `images` are those the rows' `image` indices name."""
        length = max(len(row.input_ids) for row in rows)
        width = max(len(row.markers) for row in rows)
        input_ids = torch.full((len(rows), length), self.pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(rows), length), dtype=torch.long)
        position_ids = torch.zeros((3, len(rows), length), dtype=torch.long)
        markers = torch.zeros((len(rows), width), dtype=torch.long)
        candidate_mask = torch.zeros((len(rows), width), dtype=torch.bool)
        for index, row in enumerate(rows):
            n = len(row.input_ids)
            input_ids[index, :n] = torch.tensor(row.input_ids)
            attention_mask[index, :n] = 1
            position_ids[:, index, :] = mrope_positions(row, length, self.image_pad_id)
            markers[index, : len(row.markers)] = torch.tensor(row.markers)
            candidate_mask[index, : len(row.markers)] = True
        row_images = torch.tensor([-1 if row.image is None else row.image for row in rows])
        pixel_values = torch.cat([image.pixel_values for image in images]) if images else None
        grid_thw = torch.cat([image.grid_thw for image in images]) if images else None
        return Batch(input_ids, attention_mask, position_ids, markers, candidate_mask,
                     pixel_values, grid_thw, row_images)


def mrope_positions(row: Row, length: int, image_pad_id: int) -> torch.Tensor:
    """[3, length] M-RoPE positions: text advances all three axes together; image tokens take
    (start, start + h, start + w) and the text after them resumes at start + max(H, W).
    Padding positions continue the count (they are masked out)."""
    positions = torch.arange(length).expand(3, length).clone()
    if row.image_grid is None:
        return positions
    start = row.input_ids.index(image_pad_id)
    height, width = row.image_grid
    grid_h = torch.arange(height).repeat_interleave(width)
    grid_w = torch.arange(width).repeat(height)
    count = height * width
    positions[0, start:start + count] = start
    positions[1, start:start + count] = start + grid_h
    positions[2, start:start + count] = start + grid_w
    after = start + count
    positions[:, after:] = torch.arange(length - after) + start + max(height, width)
    return positions
