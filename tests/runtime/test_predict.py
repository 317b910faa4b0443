"""The deployable checkpoint: calibrate writes it, Predictor loads it and applies its calibrator."""

import concurrent.futures
import dataclasses
import math

import pytest
import torch
from helpers import encoded
from PIL import Image

from dohnuts import Predictor
from dohnuts.inputs.template import OverBudget
from dohnuts.runtime.engine import request_shape
from dohnuts.runtime.predict import encode_request
from dohnuts.schema import parse_request

QUESTIONS = {
    "colour": {"type": "choice", "instructions": "What colour is the square?", "criteria": ["red", "green", "blue"]},
    "warm": {"type": "noul", "instructions": "Is the colour warm?"},
    "size": {"type": "score", "instructions": "How big?", "criteria": ["small", "medium", "large"]},
}


def test_calibrate_writes_a_calibrator_that_predict_applies(deployable):
    root, metrics = deployable
    predictor = Predictor.from_checkpoint(root / "checkpoint", device="cpu")
    assert predictor.calibrator.to_json()["cells"] == metrics["cells"]
    assert predictor.calibrator.risks == [0.01, 0.05, 0.1]
    state = {"note": "a square", "image": Image.new("RGB", (64, 64), (220, 20, 20))}
    result = predictor.predict(state, QUESTIONS)
    batch, request = predictor.encode(state, QUESTIONS)
    with torch.no_grad():
        logits = predictor.model(batch).double()
    for index, question in enumerate(request.questions):
        count = len(question.labels)
        cell = predictor.calibrator.cell(question.kind, count)
        expected = torch.softmax(logits[index, :count] / cell.temperature + torch.tensor(cell.bias or [0.0] * count,
                                                                                         dtype=torch.float64), -1)
        expected = expected.tolist()
        answer = result["answers"][question.qid]
        assert list(answer["probabilities"].values()) == pytest.approx(expected, abs=1e-9)
    score = result["answers"]["size"]
    assert score["score"] == pytest.approx(sum(i * p for i, p in enumerate(score["probabilities"].values())))
    warm = result["answers"]["warm"]
    assert warm["noul"] == pytest.approx(warm["probabilities"]["true"])
    template = predictor.template
    rows, _ = encoded(template, request)
    assert result["usage"] == {"input_tokens": sum(len(row.input_ids) for row in rows), "images": 1}


def test_calibration_raises_no_groups_ece_on_the_calibration_partition(deployable):
    _, metrics = deployable
    assert set(metrics["families"]) == {"choice", "noul", "score"}
    for entry in metrics["families"].values():
        assert entry["chosen"] in entry["held_out_nll"] and all(map(math.isfinite, entry["held_out_nll"].values()))
    for group, entry in metrics["groups"].items():
        if entry["rows"] >= 2:  # the fixture's calibrate.min_rows
            assert entry["ece_calibrated"] <= entry["ece_raw"] + 1e-12, group


def test_predict_marks_abstentions_at_a_fitted_risk_and_refuses_another(deployable):
    root, _ = deployable
    predictor = Predictor.from_checkpoint(root / "checkpoint", device="cpu")
    state = {"note": "a square", "image": Image.new("RGB", (64, 64), (220, 20, 20))}
    plain = predictor.predict(state, QUESTIONS)
    assert all("abstain" not in answer for answer in plain["answers"].values())  # a plain request: as before
    for risk in predictor.calibrator.risks:
        marked = predictor.predict(state, QUESTIONS, risk=risk)
        for qid, answer in marked["answers"].items():
            assert {key: value for key, value in answer.items() if key != "abstain"} == plain["answers"][qid]
            threshold = predictor.calibrator.threshold(answer["type"], risk)
            assert answer["abstain"] is (max(answer["probabilities"].values()) < threshold)
    with pytest.raises(ValueError, match="risk 0.2 was not fitted for this checkpoint"):
        predictor.predict(state, QUESTIONS, risk=0.2)


def test_an_uncalibrated_merged_folder_is_refused_with_a_clear_message(deployable):
    root, _ = deployable
    with pytest.raises(ValueError, match="merged model without calibration: run the calibrate stage"):
        Predictor.from_checkpoint(root / "merged", device="cpu")


def test_invalid_requests_reach_the_caller_as_value_errors(deployable):
    root, _ = deployable
    predictor = Predictor.from_checkpoint(root / "checkpoint", device="cpu")
    with pytest.raises(ValueError, match="questions is empty"):
        predictor.predict("state", {})
    with pytest.raises(ValueError, match="over the budget of 32768"):
        predictor.predict("word " * 40000, QUESTIONS)


def test_a_request_is_held_to_its_own_budget_besides_each_rows(deployable):
    """A row holds the state and one question (model.max_tokens); the request, its state once
    and every question (model.max_request_tokens): each refused by name, never truncated."""
    root, _ = deployable
    predictor = Predictor.from_checkpoint(root / "checkpoint", device="cpu")
    request = parse_request("word " * 100, QUESTIONS, predictor.template.reserved)
    shape = request_shape(encode_request(predictor.template, predictor.config, request))
    longest = max(len(row.input_ids) for row in encode_request(predictor.template, predictor.config, request).rows)
    exact = dataclasses.replace(predictor.config, max_tokens=longest, max_request_tokens=shape.tokens)
    assert len(encode_request(predictor.template, exact, request).rows) == 3  # both budgets just met
    with pytest.raises(OverBudget, match=f"the request is {shape.tokens} tokens .* budget of {shape.tokens - 1}"):
        encode_request(predictor.template, dataclasses.replace(exact, max_request_tokens=shape.tokens - 1), request)
    with pytest.raises(OverBudget, match=f"over the budget of {longest - 1}"):
        encode_request(predictor.template, dataclasses.replace(exact, max_tokens=longest - 1), request)


def test_a_cached_image_skips_preprocessing_and_the_vision_tower(deployable):
    root, _ = deployable
    predictor = Predictor.from_checkpoint(root / "checkpoint", device="cpu")
    template, preprocessed, encoded = predictor.template, [], []
    encode_image = template.encode_image
    template.encode_image = lambda *args, **kwargs: preprocessed.append(1) or encode_image(*args, **kwargs)
    predictor.model.backbone.visual.merger.register_forward_hook(lambda *args: encoded.append(1))
    state = {"note": "a square", "image": Image.new("RGB", (64, 64), (220, 20, 20))}
    first = predictor.predict(state, QUESTIONS)
    second = predictor.predict(state, QUESTIONS)
    assert first == second
    assert preprocessed == [1] and encoded == [1]  # the second call did neither


def test_a_state_of_several_images_encodes_each_once_and_answers_as_alone_in_a_batch(deployable):
    """Four images in one state, one of them twice: three preprocessed and encoded in one tower
    call; asked again, none; in a batch with other requests, the answers it gets alone."""
    root, _ = deployable
    predictor = Predictor.from_checkpoint(root / "checkpoint", device="cpu")
    red, green, blue = (Image.new("RGB", (48 + 16 * index, 64), colour)
                        for index, colour in enumerate([(220, 20, 20), (20, 220, 20), (20, 20, 220)]))
    state = {"photos": [red, green], "note": "a listing", "detail": {"label": blue, "again": red}}
    stats = predictor.model.image_cache.stats
    alone = predictor.predict(state, QUESTIONS)
    assert alone["usage"]["images"] == 4
    assert stats["misses"] == 3 and stats["vision_calls"] == 1 and stats["hits"] == 0
    assert predictor.predict(state, QUESTIONS) == alone
    assert stats["misses"] == 3 and stats["vision_calls"] == 1
    predictor.model.image_cache.clear()
    together = predictor.predict_many([*_requests(4), (state, QUESTIONS)])[-1]
    for qid, answer in together["answers"].items():
        expected = list(alone["answers"][qid]["probabilities"].values())
        assert list(answer["probabilities"].values()) == pytest.approx(expected, abs=1e-5)
    # The order of the images in the state is part of it: swapped, the answers move.
    swapped = predictor.predict({**state, "photos": [green, red]}, QUESTIONS)
    assert swapped["answers"] != alone["answers"]


def _requests(count):
    return [({"note": f"request {index}", "image": Image.new("RGB", (64, 64), (20 * index % 255, 40, 200))}
             if index % 3 == 0 else f"text request number {index}",
             dict(list(QUESTIONS.items())[: 1 + index % 3])) for index in range(count)]


def test_predictor_called_from_many_threads_gives_the_sequential_answers(deployable):
    root, _ = deployable
    predictor = Predictor.from_checkpoint(root / "checkpoint", device="cpu")
    requests = _requests(24)
    expected = [predictor.predict(*request) for request in requests]
    predictor.model.image_cache.clear()
    with concurrent.futures.ThreadPoolExecutor(max_workers=8) as pool:
        results = list(pool.map(lambda request: predictor.predict(*request), requests))
    assert results == expected  # the lock serialises calls: the same single-request batches


def test_predict_many_answers_each_request_as_alone_and_returns_each_invalid_ones_error(deployable):
    root, _ = deployable
    predictor = Predictor.from_checkpoint(root / "checkpoint", device="cpu")
    requests = _requests(6)
    broken = [*requests[:2], ("s", {}), *requests[2:4], ({"image": object()}, QUESTIONS), *requests[4:]]
    results = predictor.predict_many(broken, errors="return")
    assert isinstance(results[2], ValueError) and "questions is empty" in str(results[2])
    assert isinstance(results[5], TypeError)
    alone = [predictor.predict(*request) for request in requests]
    for result, reference in zip([r for r in results if isinstance(r, dict)], alone):
        assert result["usage"] == reference["usage"]
        for qid, answer in result["answers"].items():
            expected = list(reference["answers"][qid]["probabilities"].values())
            assert list(answer["probabilities"].values()) == pytest.approx(expected, abs=1e-5)
    with pytest.raises(ValueError, match="questions is empty"):
        predictor.predict_many(broken)
    odd = predictor.predict_many([requests[0], ("only a state",), "neither"], errors="return")
    assert isinstance(odd[0], dict) and "request 1 must be a (state, questions) pair, got tuple of 1" in str(odd[1])
    assert isinstance(odd[2], TypeError) and "got str" in str(odd[2])
    with pytest.raises(ValueError, match='errors must be "raise" or "return"'):
        predictor.predict_many(requests, errors="ignore")
