"""The public prediction API: a calibrated checkpoint answering typed questions about a state."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from ..config import ModelConfig
from ..inputs.batch import Batch, EncodedImage
from ..inputs.template import OverBudget
from ..model.decision import default_device
from ..model.decoder import pack_projections
from ..schema import Request, answer, parse_request
from ..scoring.calibrator import Calibrator
from ..scoring.metrics import normalised_entropy_confidence
from .checkpoint import load_merged
from .engine import EncodedRequest, Engine, Piece, request_shape, settle_heap

BATCHED_CONFIDENCE = 8  # rows from which the answers' confidences are computed together
# Requests `prepare_graphs` answers after the engine's own warm-up: the template, the answers and
# a one-question request of a long state's bucket, as a user's first request runs them.
WARM_UP = (("a short state", {"q": {"type": "choice", "instructions": "Which?", "options": ["a", "b", "c"]}}),
           ({"document": "a long state of plain words " * 200},
            {"q": {"type": "noul", "instructions": "Does the document mention a refund?"}}))


class Predictor:
    """Answers `predict(state, questions)` with calibrated probabilities in one forward pass.

    Safe to call from several threads: calls are serialised by a lock (the token cache, the
    image-feature cache and the CUDA graphs' buffers are shared state). To run concurrent
    requests together, batch them into one `predict_many` call, or serve them through an
    `engine.EngineLoop` over `self.engine` with `self.lock` (the server does). The requests run
    on `self.engine`, in invocations it plans by computed tokens.
    """

    def __init__(self, model, template, model_config, calibrator: Calibrator):
        self.model = model
        if pack_projections(model.backbone.language_model):
            model.changed()  # new weight storage: no captured graph or derived constant may outlive it
        self.template = template
        self.config = model_config
        self.calibrator = calibrator
        # CUDA graphs: of the shape buckets once `prepare_graphs` ran, and of layouts that recur.
        self.engine = Engine(model, pad_id=template.pad_id, image_pad_id=template.image_pad_id)
        self.scores = self.engine.scores
        self.lock = threading.RLock()

    @classmethod
    def from_checkpoint(cls, path, device: str | torch.device | None = None, graphs: bool = True) -> Predictor:
        """Load the deployable checkpoint folder the calibrate stage writes (hashes verified);
        with `graphs`, capture the shape buckets' CUDA graphs too (`prepare_graphs`), which a
        process that only trains the model does not need."""
        device = torch.device(device) if device is not None else default_device()
        model, template, config, calibrator = load_merged(Path(path), device, need_calibration=True)
        predictor = cls(model, template, config, calibrator)
        if graphs:
            predictor.prepare_graphs()
        return predictor

    def prepare_graphs(self, buckets=None) -> int:
        """Capture the CUDA graphs of the shape buckets (`dohnuts.model.buckets`; all by
        default) and of the vision tower's patch buckets (`vision_graphs.vision_buckets`, for
        the template's pixel policy), so that requests and image sizes met for the first time
        replay one: a few seconds, once, on a CUDA device; nothing on the CPU. On CUDA, then
        answer two requests of our own, a short one and a long one (`WARM_UP`), so the first
        user's finds every step of `predict` warm, and freeze the heap (`engine.settle_heap`).
        Returns how many of the language model's buckets are ready."""
        with self.lock:
            ready = self.engine.prepare(self.template.pixels, buckets)
            if self.model.device.type == "cuda":
                self.predict_many(WARM_UP, errors="return")  # a budget too small for one is no error
                settle_heap()
            return ready

    def encode(self, state, questions):
        """Validate and encode a request into a batch. Returns (batch, request)."""
        batch, requests, _ = self.encode_many([(state, questions)])
        return batch, requests[0]

    def encode_many(self, requests: Sequence[tuple[object, dict]]) -> tuple[Batch, list[Request], list[int]]:
        """Validate and encode several requests into one batch: their rows in request order,
        each request's own prefix shared among its rows, each distinct image once.

        Returns:
            (batch, the validated requests, each request's input tokens)

        Raises:
            TypeError, ValueError: an invalid request (see `dohnuts.schema.parse_request`).
        """
        with self.lock:
            encoded, parsed, tokens, _ = self._encode(requests, collect=False)
            return self.engine.collate(encoded, [Piece(index, list(range(len(request.rows))))
                                                 for index, request in enumerate(encoded)]), parsed, tokens

    def _encode(self, requests, collect: bool):
        """(encoded requests, validated requests, input tokens, {index: error}) of `requests`;
        with `collect`, an invalid request is left out and its error kept, else it raises."""
        encoded, parsed, tokens, failures = [], [], [], {}
        for index, pair in enumerate(requests):
            try:
                if not isinstance(pair, tuple | list) or len(pair) != 2:
                    raise TypeError(f"request {index} must be a (state, questions) pair, got {type(pair).__name__}"
                                    f"{f' of {len(pair)}' if isinstance(pair, tuple | list) else ''}")
                state, questions = pair
                request = parse_request(state, questions, self.template.reserved, self.template.max_images)
                own = self.encode_request(request)
            except (TypeError, ValueError) as error:
                if not collect:
                    raise
                failures[index] = error
                continue
            encoded.append(own)
            parsed.append(request)
            tokens.append(sum(len(row.input_ids) for row in own.rows))
        return encoded, parsed, tokens, failures

    def encode_request(self, request: Request) -> EncodedRequest:
        """A validated request as the engine takes it (`encode_request`); an image whose features
        are cached carries no pixels (nothing to preprocess)."""
        return encode_request(self.template, self.config, request, self.model.image_cache.grid)

    @torch.no_grad()
    def predict(self, state, questions, risk: float | None = None) -> dict:
        """Answer every question about `state`.

        Args:
            state: a string, or a mapping (rendered as JSON) holding PIL images anywhere in
                it, at most `model.max_images`; each image's vision block takes its place.
            questions: qid -> {"type": "choice" | "noul" | "score", "instructions", "criteria"}.
            risk: mark each answer "abstain": true where its confidence is below its type's
                threshold at this risk (one of `self.calibrator.risks`, fitted by the calibrate
                stage): the answers given then err at most at this rate (with the calibrate
                stage's stated chance, `calibrate.delta`).

        Returns:
            {"answers": {qid: answer}, "usage": {"input_tokens", "images"}}; see
            `dohnuts.schema.answer` for each answer's fields.

        Raises:
            TypeError, ValueError: invalid request (see `dohnuts.schema.parse_request`), or a
                risk the checkpoint has no threshold for.
        """
        return self.predict_many([(state, questions)], risk=risk)[0]

    @torch.no_grad()
    def predict_many(self, requests: Sequence[tuple[object, dict]], raw_logits: bool = False,
                     errors: str = "raise", risk: float | None = None) -> list:
        """Answer several requests in one forward pass; each gets what `predict` gives it alone
        (batched rows differ only by floating-point summation order).

        Args:
            requests: (state, questions) pairs, as `predict` takes them.
            raw_logits: also give each result "logits": {qid: the candidates' logits before the
                temperature}, for evaluation.
            errors: "raise" (an invalid request raises, nothing is run) or "return" (its place in
                the results holds its TypeError or ValueError; the others are answered).
            risk: as `predict`'s, for every request.

        Returns:
            One `predict` result per request, in order.

        Raises:
            TypeError, ValueError: an invalid request, with errors="raise"; ValueError: another
                `errors`.
        """
        if errors not in ("raise", "return"):
            raise ValueError(f'errors must be "raise" or "return", got {errors!r}')
        if risk is not None:
            self.calibrator.threshold("choice", risk)  # ValueError, before any work, for a risk not fitted
        with self.lock:
            encoded, parsed, tokens, failures = self._encode(requests, collect=errors == "return")
            # The logits come to the host at once: the few small operations after them cost less
            # there than as device launches, and the temperatures need no copy to the device.
            answered = answers_of(self.engine.run(encoded), candidate_mask(parsed), parsed, tokens, self.calibrator,
                                  raw_logits, risk) if encoded else []
        results = iter(answered)
        return [failures[index] if index in failures else next(results) for index in range(len(requests))]


def encode_request(template, config: ModelConfig, request: Request, cached_grid=None) -> EncodedRequest:
    """A validated request's rows and images as the engine takes them (each distinct image
    once); with `cached_grid(key)` (the grid of an image whose features are cached, else None),
    a cached image carries no pixels. A server's front end, which sees no cache, sends every
    image's bytes.

    Raises:
        OverBudget: a row over `config.max_tokens`, or the request's computed tokens (its shared
            beginning once, then each row's own) over `config.max_request_tokens`.
    """
    def encode(image, key, data):
        grid = cached_grid(key) if cached_grid is not None else None
        return EncodedImage(None, grid, key) if grid is not None else template.encode_image(image, key, data)

    images = []
    indices = template.encode_images(request, images, encode=encode)  # the same image twice: encoded once
    encoded = EncodedRequest(template.encode(request, config.max_tokens, indices, images), tuple(images))
    tokens = request_shape(encoded).tokens
    if tokens > config.max_request_tokens:
        raise OverBudget(f"the request is {tokens} tokens (its state once, then every question), over the "
                         f"budget of {config.max_request_tokens}; inputs are rejected, never truncated")
    return encoded


def candidate_mask(parsed: list[Request]) -> np.ndarray:
    """[rows, K] bool: which of K candidate places each question's row fills (K: the most
    candidates of a row), rows in request and question order."""
    counts = np.array([len(question.labels) for request in parsed for question in request.questions])
    return np.arange(int(counts.max()))[None, :] < counts[:, None]


def answers_of(logits: np.ndarray, mask: np.ndarray, parsed: list[Request], tokens: list[int],
               calibrator: Calibrator, raw_logits: bool = False, risk: float | None = None) -> list[dict]:
    """Each request's `predict` result from its rows' logits on the host.

    Args:
        logits: [B, K] float32, the rows of `parsed`'s questions in order; mask: [B, K] bool.
        parsed: the validated requests; tokens: each one's input tokens.
        calibrator: the checkpoint's (`scoring.calibrator.Calibrator`).
        raw_logits: also give each result "logits" (see `Predictor.predict_many`).
        risk: also mark each answer "abstain" at this risk (a fitted one: `Calibrator.threshold`).
    """
    kinds = [question.kind for request in parsed for question in request.questions]
    table = calibrator.probabilities(logits, mask, kinds)
    # Every row's confidence at once, where that pays (a few numpy calls cost about 5 us, a
    # question's own about 1 us): with fewer rows `answer` computes each.
    confidences = (normalised_entropy_confidence(table, mask).tolist() if len(table) >= BATCHED_CONFIDENCE
                   else [None] * len(table))
    probs = table.tolist()  # one conversion, not one a question
    raw = logits.tolist() if raw_logits else None
    results, row = [], 0
    for request, count in zip(parsed, tokens):
        answers = {}
        for question in request.questions:
            own = probs[row][: len(question.labels)]
            answers[question.qid] = answer(question, own, confidences[row])
            if risk is not None:
                answers[question.qid]["abstain"] = max(own) < calibrator.threshold(question.kind, risk)
            row += 1
        result = {"answers": answers, "usage": {"input_tokens": count, "images": len(request.images)}}
        if raw is not None:
            first = row - len(request.questions)
            result["logits"] = {question.qid: raw[first + index][: len(question.labels)]
                                for index, question in enumerate(request.questions)}
        results.append(result)
    return results
