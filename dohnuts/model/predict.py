"""The public prediction API: a calibrated checkpoint answering typed questions about a state."""

from __future__ import annotations

from pathlib import Path

import torch

from ..schema import answer, parse_request
from ..scoring.calibration import apply_temperatures
from ..scoring.metrics import masked_softmax
from .batch import EncodedImage
from .checkpoint import load_merged
from .cuda_graphs import GraphedScores
from .decision import default_device
from .features import image_key


class Predictor:
    """Answers `predict(state, questions)` with calibrated probabilities in one forward pass.

    One Predictor serves one caller at a time: its image-feature cache and CUDA graphs are
    not shared safely between threads (use one Predictor per thread)."""

    def __init__(self, model, template, model_config, temperatures: dict[str, float]):
        self.model = model
        self.template = template
        self.config = model_config
        self.temperatures = temperatures
        self.scores = GraphedScores(model)  # CUDA graphs for repeated request layouts; eager elsewhere

    @classmethod
    def from_checkpoint(cls, path, device: str | torch.device | None = None) -> Predictor:
        """Load the deployable checkpoint folder the calibrate stage writes (hashes verified)."""
        device = torch.device(device) if device is not None else default_device()
        model, template, config, temperatures = load_merged(Path(path), device, need_temperatures=True)
        return cls(model, template, config, temperatures)

    def encode(self, state, questions):
        """Validate and encode a request into a batch. Returns (batch, request)."""
        request = parse_request(state, questions, self.template.reserved)
        image = None
        if request.image is not None:
            key = image_key(request.image)
            grid = self.model.image_cache.grid(key)
            # A cached image needs no preprocessing: its features and grid are known.
            if grid is not None:
                image = EncodedImage(None, grid, key)
            else:
                image = self.template.encode_image(request.image, key)
        rows = self.template.encode(request, self.config.max_tokens, 0, image)
        batch = self.template.collate(rows, [image] if image is not None else [])
        return batch, request

    @torch.no_grad()
    def predict(self, state, questions) -> dict:
        """Answer every question about `state`.

        Args:
            state: a string, or a mapping (rendered as JSON) with at most one PIL image
                under "image".
            questions: qid -> {"type": "choice" | "noul" | "score", "instructions", "criteria"}.

        Returns:
            {"answers": {qid: answer}, "usage": {"input_tokens", "images"}}; see
            `dohnuts.schema.answer` for each answer's fields.

        Raises:
            TypeError, ValueError: invalid request (see `dohnuts.schema.parse_request`).
        """
        batch, request = self.encode(state, questions)
        # The logits [B, K] come to the host at once (the call's one synchronisation): the few
        # small operations after them cost less there than as device launches, each a host
        # round trip once the forward has finished, and the temperatures need no copy to the device.
        logits = self.scores(batch.to(self.model.device)).cpu()
        logits = apply_temperatures(logits.double(), [q.kind for q in request.questions], self.temperatures)
        probs = masked_softmax(logits, batch.candidate_mask).tolist()  # one conversion, not one a question
        answers = {q.qid: answer(q, probs[index][: len(q.labels)]) for index, q in enumerate(request.questions)}
        usage = {"input_tokens": batch.input_tokens, "images": int(request.image is not None)}
        return {"answers": answers, "usage": usage}
