"""The single prompt template: request -> token rows with candidate markers, and batching."""

from __future__ import annotations

import hashlib
import unicodedata
from collections import OrderedDict
from collections.abc import Sequence
from functools import lru_cache

from ..config import ModelConfig
from ..schema import MAX_IMAGES, Question, Request
from .batch import Batch, EncodedImage, Row, pack_rows
from .pixels import PixelSettings, content, qwen_pixels, rgb_bytes
from .tokens import SPATIAL_MERGE, special_tokens
from .vocabulary import tiktoken_encoder

PIECE_CACHE_CHARS = 4 * 2**20  # characters of recently tokenised text kept


class OverBudget(ValueError):
    """A row is longer than the token budget: inputs are rejected, never truncated."""


def pieces_of(request: Request, inline: bool = True) -> list[str]:
    """The texts the template tokenises, each on its own: the state (`inline`: its parts
    between images, one piece each; else its text with "<image>" in their places), then per
    question its header followed by its candidates."""
    parts = request.state_parts if inline else (request.state_text,)
    if len(parts) == 1:
        texts = [f"State: {parts[0]}\n"]
    else:
        texts = [f"State: {parts[0]}", *parts[1:-1], f"{parts[-1]}\n"]
    for question in request.questions:
        texts.append(f"{question.kind} question: {question.instructions}\nOptions:\n")
        texts.extend(f"- {candidate}" for candidate in question.candidates)
    return texts


@lru_cache(maxsize=2**16)
def _rank(salt: str, text: str) -> bytes:
    return hashlib.blake2b(text.encode(), digest_size=8, key=salt.encode()).digest()


def rendered_order(question: Question, salt: str | None) -> tuple[int, ...] | range:
    """The order a question's candidates are rendered in, as indices into its candidates.

    A choice's options go by a keyed hash of their text (their labels break a tie), a function
    of the set of options alone: the order a client sends them in cannot change a token of the
    rows, so it cannot change an answer, and across questions an option's position says nothing
    about its label. A score's levels and a noul's two sides keep their order (levels are
    ordinal; a noul's sides are fixed by the schema). `salt` None keeps every given order.
    """
    if salt is None or question.kind != "choice":
        return range(len(question.candidates))
    return _hashed_order(salt, question.candidates, question.labels)


@lru_cache(maxsize=2**14)
def _hashed_order(salt: str, candidates: tuple[str, ...], labels: tuple[str, ...]) -> tuple[int, ...]:
    """`rendered_order` of a choice, kept for the questions that recur (most of them do)."""
    return tuple(sorted(range(len(candidates)), key=lambda index: (_rank(salt, candidates[index]), labels[index])))


class Template:
    """Renders validated requests with the template of recipe.md and enforces the token budget.

        State: {state, each image's vision block in its place}\\n
        {type} question: {instructions}\\nOptions:\\n- {candidate 1}<M>- {candidate 2}<M>...

    An image's vision block is <|vision_start|><|image_pad|>...<|vision_end|>. In the "front"
    layout (`model.image_layout`, checkpoints from before several images) the blocks come first
    instead, each followed by a newline, and the state's text says "<image>" in their places.

    Every piece is tokenised on its own, so the shared beginning of a request's rows is the
    same token sequence in each row. A choice's candidates are rendered in `rendered_order`
    under `order_salt`; a row's markers stay in the question's candidate order, so its logits
    come out in label order whatever the rendering.
    """

    def __init__(self, tokenizer, image_processor, marker: str, order_salt: str | None = None,
                 image_layout: str = "inline", max_images: int = MAX_IMAGES):
        self.tokenizer = tokenizer
        self.max_images = max_images  # what `parse_request` takes for this template's requests
        self.order_salt = order_salt
        self.inline = image_layout == "inline"
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
        self.pixels = PixelSettings.of(image_processor)  # None: the processor preprocesses on the host
        self.pieces: OrderedDict[str, list[int]] = OrderedDict()
        self.piece_chars = 0
        # The most bytes of text one token stands for (as UTF-8 of its vocabulary entry: a byte-level
        # token's characters count two bytes from 0x80 up, so this is an upper bound): a text of B
        # bytes is at least B / this many tokens (`_surely_over`).
        self.longest_token_bytes = max((len(token.encode("utf-8")) for token in tokenizer.get_vocab()), default=1)
        self.fast = tiktoken_encoder(tokenizer)  # the same ids, about ten times sooner; None: the tokenizer's

    @classmethod
    def of(cls, tokenizer, image_processor, model: ModelConfig) -> Template:
        """The template of a model configuration: its marker, its choices' and images' layouts."""
        return cls(tokenizer, image_processor, model.marker_token, model.order_salt, model.image_layout,
                   model.max_images)

    def tokenize(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text on its own, through an LRU of recent pieces (questions and
        candidates recur across requests; the tokenizer runs once on the new ones). The lists
        are shared with the cache: read them, never modify them."""
        distinct = list(dict.fromkeys(texts))
        new = [text for text in distinct if text not in self.pieces]
        for text in distinct:
            if text in self.pieces:
                self.pieces.move_to_end(text)  # this call's pieces are the most recent
        if new:
            # split_special_tokens: user text such as "<|im_start|>" stays text, never a control token.
            encoded = ([self.fast(text) for text in new] if self.fast is not None else
                       self.tokenizer(new, add_special_tokens=False, split_special_tokens=True)["input_ids"])
            for text, ids in zip(new, encoded):
                self.pieces[text] = ids
                self.piece_chars += len(text)
        out = [self.pieces[text] for text in texts]
        # Evict the least recent, never a piece of this call (they sit at the end).
        while self.piece_chars > PIECE_CACHE_CHARS and len(self.pieces) > len(distinct):
            text, _ = self.pieces.popitem(last=False)
            self.piece_chars -= len(text)
        return out

    def image_tokens(self) -> int:
        """The most tokens an image's block takes under the processor's fixed pixel count (its
        patches merged 2x2, vision start and end, in the front layout the newline after), or 0
        without a processor: what a batch planner counts for an image it has not preprocessed."""
        processor = self.image_processor
        size = getattr(processor, "size", None) or {}
        pixels = getattr(size, "longest_edge", None) or (size.get("longest_edge") if isinstance(size, dict) else None)
        pixels = pixels or getattr(processor, "max_pixels", None)
        if processor is None or not pixels:
            return 0
        patch = getattr(processor, "patch_size", 16) * getattr(processor, "merge_size", SPATIAL_MERGE)
        return pixels // patch**2 + 2 + (0 if self.inline else len(self.newline_ids))

    def encode_image(self, image, key: str | None = None, data: bytes | None = None) -> EncodedImage:
        """Pixels and patch grid of a decoded image; `key` is its `image_key` and `data` its RGB
        bytes when known (`pixels.content`)."""
        if key is None:
            key, data = content(image)
        if self.pixels is None:  # a processor `pixels` does not know: it runs itself, here
            pixel_values, grid = qwen_pixels(image, self.image_processor)
            return EncodedImage(pixel_values, grid, key)
        rgb = rgb_bytes(image, data)  # the patches are made on the model's device (`Batch.patches`)
        return EncodedImage(rgb, self.pixels.grid(*rgb.shape[:2]), key, self.pixels)

    def encode_images(self, request: Request, images: list[EncodedImage] | None = None,
                      seen: dict[str, int] | None = None, encode=None) -> tuple[int, ...]:
        """Encode each distinct image of a request once (by `image_key`), appended to `images`.

        Args:
            images, seen: a list of encoded images and {image key: its index there} to extend (an
                image already there is not encoded again); new ones when None.
            encode: `encode(image, key, data)` -> EncodedImage (data: the image's RGB bytes,
                `pixels.content`), `encode_image` by default.

        Returns:
            Per image of the request, in order, the index of its encoding in `images`.
        """
        images = [] if images is None else images
        seen = {} if seen is None else seen
        encode = encode or self.encode_image
        indices = []
        for image in request.images:
            key, data = content(image)
            if key not in seen:
                seen[key] = len(images)
                images.append(encode(image, key, data))
            indices.append(seen[key])
        return tuple(indices)

    def image_block(self, image: EncodedImage) -> tuple[list[int], tuple[int, int]]:
        """An image's vision block and its merged (height, width) token grid."""
        thw = image.grid_thw[0].tolist()
        grid = (thw[1] // SPATIAL_MERGE, thw[2] // SPATIAL_MERGE)
        return [self.vision_start_id] + [self.image_pad_id] * (grid[0] * grid[1]) + [self.vision_end_id], grid

    def encode(self, request: Request, max_tokens: int, image_indices: tuple[int, ...] = (),
               images: Sequence[EncodedImage] = ()) -> list[Row]:
        """Token rows of a request, one per question, in question order.

        Args:
            request: the validated request.
            max_tokens: the budget; a longer row is rejected, never truncated.
            image_indices: per image of the request (in `request.images` order), the index of its
                encoded image in `images`, the index it keeps in its batch (the same image twice:
                the same index), as `encode_images` returns them.
            images: the encoded images the indices name (`encode_images`' list).

        Raises:
            OverBudget: a row is over the token budget (a ValueError).
        """
        if len(image_indices) != len(request.images):
            raise ValueError(f"the request has {len(request.images)} images; {len(image_indices)} batch indices "
                             f"were given")
        texts = pieces_of(request, self.inline)
        self._surely_over(texts, max_tokens)
        pieces = iter(self.tokenize(texts))
        blocks = [self.image_block(images[index]) for index in image_indices]
        prefix = []
        if self.inline:
            for block, _ in blocks:
                prefix.extend(next(pieces))
                prefix.extend(block)
        else:
            for block, _ in blocks:
                prefix.extend(block)
                prefix.extend(self.newline_ids)
        prefix.extend(next(pieces))
        grids = tuple(grid for _, grid in blocks)
        rows = []
        for question in request.questions:
            ids = prefix + next(pieces)
            candidates = [next(pieces) for _ in question.candidates]
            markers = [0] * len(candidates)
            for index in rendered_order(question, self.order_salt):
                ids.extend(candidates[index])
                ids.append(self.marker_id)
                markers[index] = len(ids) - 1
            if len(ids) > max_tokens:
                raise OverBudget(
                    f"question {question.qid!r}: the input is {len(ids)} tokens, over the budget of "
                    f"{max_tokens}; inputs are rejected, never truncated"
                )
            rows.append(Row(tuple(ids), tuple(markers), question, len(prefix), tuple(image_indices), grids))
        return rows

    def _surely_over(self, texts: list[str], max_tokens: int) -> None:
        """OverBudget, before any tokenising, when one text alone must be over the budget (every
        text is in some row): its NFC form's UTF-8 bytes over `longest_token_bytes` is a lower
        bound of its tokens. A 28 MB state took 42 s to tokenise before its 413."""
        for text in texts:
            if 4 * len(text) <= max_tokens * self.longest_token_bytes:  # at most 4 bytes a character
                continue
            least = -(-len(unicodedata.normalize("NFC", text).encode("utf-8")) // self.longest_token_bytes)
            if least > max_tokens:
                raise OverBudget(f"the input is at least {least} tokens (a text of {len(text)} characters), over "
                                 f"the budget of {max_tokens}; inputs are rejected, never truncated")

    def collate(self, rows: list[Row], images: list[EncodedImage]) -> Batch:
        """Pack rows into one batch; `images` are those the rows' `image` indices name."""
        return pack_rows(rows, images, self.image_pad_id)
