"""Training: resume equivalence, init from a verified checkpoint, abort on non-finite loss, sampling."""


import numpy as np
import pytest
import torch
from helpers import state_of_tokens
from safetensors.torch import load_file

from dohnuts.config import LoraConfig, TrainConfig
from dohnuts.data.records import Example, GroupSampler, load_records, shuffled_choice
from dohnuts.io import IntegrityError, read_json, write_json, write_manifest
from dohnuts.model.adapters import adapter_state
from dohnuts.pipeline.publish import publish
from dohnuts.pipeline.schedule import lr_factor
from dohnuts.pipeline.train import RUN_MARKER, Trainer, TrainRun, source_digests, train
from dohnuts.runtime.checkpoint import ADAPTER, build_training_model, write_adapter_checkpoint
from dohnuts.scoring.objective import rlcd_loss


def _run(tiny, out, steps=5, parent=None, lora=None):
    config = TrainConfig(steps=steps, eval_every=2, rows_per_microbatch=4, microbatches_per_update=2,
                         lora_lr=1e-3, head_lr=5e-3, activation_checkpointing=True)
    return TrainRun(tiny.model, lora or LoraConfig(), config, seed=3, base=tiny.base, data=tiny.partition("train"),
                    out=out, parent=parent)


def _final(out, step):
    return load_file(str(out / "checkpoints" / f"step-{step:06d}" / ADAPTER))


class Killed(Exception):
    pass


@pytest.fixture(scope="module")
def uninterrupted(tiny, tmp_path_factory):
    out = tmp_path_factory.mktemp("whole") / "train"
    trainer = train(_run(tiny, out), resume=False)
    return out, trainer


def test_checkpoints_at_zero_every_interval_and_end_with_a_step_log(uninterrupted):
    out, trainer = uninterrupted
    names = sorted(path.name for path in (out / "checkpoints").iterdir())
    assert names == ["step-000000", "step-000002", "step-000004", "step-000005"]
    assert [row["step"] for row in trainer.log] == [1, 2, 3, 4, 5]
    header = (out / "log.csv").read_text().splitlines()[0]
    assert header == "step,loss,reward,cross_entropy,accuracy,lr,grad_norm,seconds"
    first, last = _final(out, 0), _final(out, 5)
    assert not torch.equal(first["head.weight"], last["head.weight"])  # it trained


def test_resume_after_a_kill_matches_the_uninterrupted_run(tiny, tmp_path, uninterrupted):
    whole, _ = uninterrupted
    _kill_and_resume(tiny, tmp_path / "train", whole, LoraConfig())


def test_resume_is_exact_with_lora_dropout(tiny, tmp_path):
    """Dropout masks come from the global generator: a resumed run continues its stream only if
    nothing else (the loader, when its stream reopens) draws from it."""
    lora = LoraConfig(dropout=0.1)
    whole = tmp_path / "whole"
    train(_run(tiny, whole, lora=lora), resume=False)
    _kill_and_resume(tiny, tmp_path / "train", whole, lora)


def _kill_and_resume(tiny, out, whole, lora):

    def kill(update):
        if update == 3:  # after the checkpoint at 2, before the one at 4
            raise Killed

    with pytest.raises(Killed):
        train(_run(tiny, out, lora=lora), resume=False, on_update=kill)
    assert not (out / "checkpoints" / "step-000004").exists()
    resumed = train(_run(tiny, out, lora=lora), resume=True)
    assert resumed.update == 5 and [row["step"] for row in resumed.log] == [1, 2, 3, 4, 5]
    expected, actual = _final(whole, 5), _final(out, 5)
    assert expected.keys() == actual.keys()
    for key in expected:
        torch.testing.assert_close(actual[key], expected[key], rtol=0, atol=1e-6, msg=key)


def test_resume_of_another_configuration_starts_fresh(tiny, tmp_path, uninterrupted):
    whole, _ = uninterrupted
    out = tmp_path / "train"
    train(_run(tiny, out, steps=2), resume=False)
    other = _run(tiny, out, steps=2, lora=LoraConfig(rank=4))
    trainer = train(other, resume=True)
    assert trainer.update == 2 and len(trainer.log) == 2
    assert _final(out, 2)[next(k for k in _final(out, 2) if "lora_A" in k)].shape[0] == 4


def test_init_from_checkpoint_starts_from_the_parent_weights_with_a_fresh_optimizer(tiny, tmp_path, uninterrupted):
    whole, _ = uninterrupted
    parent = tmp_path / "parent"
    publish(whole / "checkpoints" / "step-000005", parent)
    trainer = Trainer(_run(tiny, tmp_path / "child", parent=parent))
    start = load_file(str(parent / ADAPTER))
    current = adapter_state(trainer.model, trainer.peft_model)
    for key in start:
        torch.testing.assert_close(current[key].cpu(), start[key], rtol=0, atol=0)
    assert trainer.update == 0 and not trainer.optimizer.state


def test_init_from_checkpoint_refuses_a_missing_parent(tiny, tmp_path):
    with pytest.raises(FileNotFoundError, match="holds no adapter.safetensors"):
        Trainer(_run(tiny, tmp_path / "child", parent=tmp_path / "empty"))


def test_init_from_checkpoint_refuses_a_tampered_parent(tiny, tmp_path, uninterrupted):
    whole, _ = uninterrupted
    parent = tmp_path / "parent"
    publish(whole / "checkpoints" / "step-000005", parent)
    data = bytearray((parent / ADAPTER).read_bytes())
    data[-1] ^= 1
    (parent / ADAPTER).write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match="SHA-256"):
        Trainer(_run(tiny, tmp_path / "child", parent=parent))


def test_init_from_checkpoint_refuses_weights_of_another_shape(tiny, tmp_path):
    parent = tmp_path / "parent"
    parent.mkdir()
    model, peft_model = build_training_model(tiny.base, "float32", LoraConfig(rank=4), 0.01, seed=0)
    write_adapter_checkpoint(parent, model, peft_model, tiny.adapter_config())  # it says rank 8
    with pytest.raises(ValueError, match="does not fit this model"):
        Trainer(_run(tiny, tmp_path / "child", parent=parent))


def _published(whole, parent):
    publish(whole / "checkpoints" / "step-000005", parent)
    return parent


def test_init_from_checkpoint_refuses_a_parent_that_does_not_state_its_settings(tiny, tmp_path, uninterrupted):
    whole, _ = uninterrupted
    parent = _published(whole, tmp_path / "parent")
    config = read_json(parent / "config.json")
    write_json(parent / "config.json", {key: value for key, value in config.items() if key != "lora"})
    write_manifest(parent)
    with pytest.raises(ValueError, match="does not state its LoRA settings"):
        Trainer(_run(tiny, tmp_path / "child", parent=parent))
    (parent / "config.json").unlink()
    write_manifest(parent)
    with pytest.raises(IntegrityError, match="does not list required file 'config.json'"):
        Trainer(_run(tiny, tmp_path / "child", parent=parent))


def test_init_from_checkpoint_refuses_a_parent_of_another_base(tiny, tmp_path, uninterrupted):
    whole, _ = uninterrupted
    parent = _published(whole, tmp_path / "parent")
    config = read_json(parent / "config.json")
    write_json(parent / "config.json", {**config, "base": "0" * 64})
    write_manifest(parent)
    with pytest.raises(ValueError, match="was trained on another base"):
        Trainer(_run(tiny, tmp_path / "child", parent=parent))


def test_init_from_checkpoint_refuses_a_file_the_manifest_does_not_list(tiny, tmp_path, uninterrupted):
    whole, _ = uninterrupted
    parent = _published(whole, tmp_path / "parent")
    (parent / "README.md").write_text("kept: a README is not loaded\n")
    Trainer(_run(tiny, tmp_path / "child", parent=parent))  # accepted
    (parent / "extra.safetensors").write_bytes(b"unverified")
    with pytest.raises(IntegrityError, match="does not list: extra.safetensors"):
        Trainer(_run(tiny, tmp_path / "child", parent=parent))


def test_init_from_checkpoint_refuses_other_lora_settings_with_the_same_shapes(tiny, tmp_path, uninterrupted):
    whole, _ = uninterrupted
    parent = tmp_path / "parent"
    publish(whole / "checkpoints" / "step-000005", parent)
    with pytest.raises(ValueError, match="lora.alpha: checkpoint 16.0, params 32.0"):
        Trainer(_run(tiny, tmp_path / "child", parent=parent, lora=LoraConfig(alpha=32.0)))


def test_non_finite_loss_aborts_before_the_optimizer_step(tiny, tmp_path):
    trainer = Trainer(_run(tiny, tmp_path / "train"))
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters() if p.requires_grad}
    with torch.no_grad():
        trainer.model.head.weight.fill_(float("nan"))
    with pytest.raises(FloatingPointError, match="aborting before the optimizer step"):
        trainer.step()
    assert trainer.update == 0 and not trainer.optimizer.state
    for name, p in trainer.model.named_parameters():
        if p.requires_grad and name != "head.weight":
            assert torch.equal(p, before[name]), name


def test_sampler_draws_depend_only_on_the_microbatch_index(tiny):
    rows = load_records(tiny.partition("train"))
    sampler = GroupSampler(rows, seed=3, rows_per_microbatch=6, group_cap=6000)
    again = GroupSampler(rows, seed=3, rows_per_microbatch=6, group_cap=6000)
    first, _ = sampler.draw(7)
    sampler.draw(1)
    assert first.equals(again.draw(7)[0])
    assert first.group.nunique() == 1  # one group per microbatch
    groups = {sampler.draw(index)[0].group.iloc[0] for index in range(60)}
    assert groups == set(rows.group.unique())  # every group is drawn


def test_choice_shuffle_moves_targets_with_their_candidates():
    example = Example("s", {"type": "choice", "instructions": "x", "criteria": ["a", "b", "c", "d"]},
                      "q", [0.0, 0.0, 1.0, 0.0])
    seen = set()
    for seed in range(20):
        shuffled = shuffled_choice(example, np.random.default_rng(seed))
        criteria = shuffled.question["criteria"]
        assert sorted(criteria) == ["a", "b", "c", "d"]
        assert criteria[int(np.argmax(shuffled.target))] == "c"
        seen.add(tuple(criteria))
    assert len(seen) > 5
    noul = Example("s", {"type": "noul", "instructions": "x"}, "q", [0.2, 0.8])
    assert shuffled_choice(noul, np.random.default_rng(0)) is noul


def _trainer_and_microbatch_gradients(tiny, tmp_path, grad_clip: float):
    """A fresh trainer at `grad_clip`, its trainable parameters, and each microbatch of its first
    update's gradient, taken one microbatch at a time (the reference of the packed update)."""
    run = _run(tiny, tmp_path / "train")
    run = TrainRun(run.model, run.lora, TrainConfig(**{**vars(run.train), "grad_clip": grad_clip}), run.seed,
                   run.base, run.data, run.out)
    trainer = Trainer(run)
    parameters = [p for group in trainer.optimizer.param_groups for p in group["params"]]
    trainer.model.train()
    separate = []
    for micro in range(run.train.microbatches_per_update):
        batch, targets, ordinal = trainer.microbatch(micro)
        loss = rlcd_loss(trainer.model(batch), batch.candidate_mask, targets, ordinal, run.train.objective,
                         trainer.noise(micro)).loss
        separate.append(torch.autograd.grad(loss, parameters))
    return trainer, parameters, separate


def test_an_update_averages_its_microbatch_gradients_at_one_snapshot_and_sets_the_scheduled_lr(tiny, tmp_path):
    trainer, parameters, separate = _trainer_and_microbatch_gradients(tiny, tmp_path, grad_clip=1e9)
    run = trainer.run
    captured = []
    trainer.optimizer.step = lambda: captured.append([p.grad.clone() for p in parameters])
    trainer.step()
    assert len(captured) == 1  # one optimizer step per update
    for index, grad in enumerate(captured[0]):
        mean = sum(grads[index] for grads in separate) / len(separate)
        torch.testing.assert_close(grad, mean, rtol=1e-5, atol=1e-7)
    factor = lr_factor(0, run.train.steps, run.train.horizon_cap, run.train.warmup_fraction, run.train.lr_floor)
    assert [g["lr"] for g in trainer.optimizer.param_groups] == pytest.approx(
        [run.train.lora_lr * factor, run.train.head_lr * factor])


def test_an_update_clips_the_global_gradient_once_when_the_clip_binds(tiny, tmp_path):
    """The mean gradient of the update's microbatches is clipped once, as one vector: with a
    clip far below its norm, the step sees exactly that gradient scaled to the clip's norm (not
    each microbatch clipped, nor each parameter)."""
    clip = 1e-3
    trainer, parameters, separate = _trainer_and_microbatch_gradients(tiny, tmp_path, grad_clip=clip)
    mean = [sum(grads[index] for grads in separate) / len(separate) for index in range(len(parameters))]
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in mean]))
    assert norm > 100 * clip  # the clip binds
    captured = []
    trainer.optimizer.step = lambda: captured.append([p.grad.clone() for p in parameters])
    record = trainer.step()
    assert record["grad_norm"] == pytest.approx(float(norm), rel=1e-5)  # the norm before clipping
    clipped = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in captured[0]]))
    assert float(clipped) == pytest.approx(clip, rel=1e-4)
    for grad, expected in zip(captured[0], mean):
        torch.testing.assert_close(grad, expected * (clip / (norm + 1e-6)), rtol=1e-4, atol=1e-10)


def test_an_update_packs_its_microbatches_rows_in_order_with_each_ones_targets_and_width(tiny):
    from dohnuts.data.records import GroupSampler, RecordReader, load_records
    from dohnuts.pipeline.train import TrainingBatches, TrainingUpdates

    folder = tiny.partition("train")
    template = tiny.template()
    microbatches = TrainingBatches(template, RecordReader(folder), GroupSampler(load_records(folder), 0, 8, 100), 2048)
    item = TrainingUpdates(microbatches, 3)(1)  # update 1: microbatches 3, 4 and 5
    targets, ordinal = item.tensors
    start, keys = 0, []
    sizes, indices = item.meta
    assert indices == [3, 4, 5]
    for micro, (count, width) in zip(indices, sizes):
        rows, images, own_targets, own_ordinal = microbatches.parts(micro)
        assert (count, width) == (len(rows), own_targets.shape[1])
        torch.testing.assert_close(targets[start:start + count, :width], own_targets, rtol=0, atol=0)
        assert not targets[start:start + count, width:].any()
        assert torch.equal(ordinal[start:start + count], own_ordinal)
        # Each row, rebuilt from the packed batch, is that microbatch's row.
        alone = template.collate(rows, images)
        for index in range(count):
            assert _row_tokens(item.batch, start + index) == _row_tokens(alone, index)
        keys += [image.key for image in images]
        start += count
    assert start == len(targets)
    assert len(keys) > len(set(keys)) == len(item.batch.image_keys)  # an image of several microbatches: once


def _row_tokens(batch, index):
    """Row `index` of a packed batch: its shared prefix's tokens (if any), then its own."""
    own = batch.input_ids[batch.prefix_tokens:][batch.cu_seqlens[index]:batch.cu_seqlens[index + 1]].tolist()
    if batch.fork is None or batch.fork.parents[index] < 0:
        return own
    parent = int(batch.fork.parents[index])
    begin, end = batch.prefix_cu_seqlens[parent], batch.prefix_cu_seqlens[parent + 1]
    return batch.input_ids[begin:end].tolist() + own


class _OneStateMicrobatches:
    """Microbatches whose rows all continue one 127-token state, with their own questions and
    candidate widths, so an update's prefix groups span its microbatches."""

    def __init__(self, template, state):
        self.template, self.state = template, state

    def parts(self, index, images=None, seen=None):  # text only: `images` stays as given
        from dohnuts.schema import parse_request

        questions = {f"q{index}-{n}": {"type": "choice", "instructions": f"Question {n} of microbatch {index}?",
                                       "criteria": [f"c{c}" for c in range(2 + (index + n) % 3)]} for n in range(3)}
        rows = self.template.encode(parse_request(self.state, questions, self.template.reserved), 4096)
        width = max(len(row.markers) for row in rows)
        targets = torch.nn.functional.one_hot(torch.arange(len(rows)) % 2, width).float()
        return rows, [] if images is None else images, targets, torch.zeros(len(rows), dtype=torch.bool)


def test_prefixes_shared_across_an_updates_microbatches_give_each_rows_own_logits(tiny):
    """Rows of different microbatches with the same beginning share one prefix in the packed
    update; each microbatch's logits equal those of the microbatch run alone (float64, 1e-9)."""
    from dohnuts.pipeline.train import TrainingUpdates

    template = tiny.template()
    source = _OneStateMicrobatches(template, state_of_tokens(template, 127))
    item = TrainingUpdates(source, 3)(0)
    batch = item.batch
    assert batch.fork is not None and batch.fork.parents.tolist() == [0] * 9  # one prefix, all 9 rows
    model, _ = build_training_model(tiny.base, "float32", LoraConfig(), 0.01, seed=0)
    model.double().eval()
    start = 0
    with torch.no_grad():
        logits = model(batch)
        for micro, (count, width) in enumerate(item.meta[0]):
            rows, images, targets, _ = source.parts(micro)
            alone = model(template.collate(rows, images))
            assert width == targets.shape[1] == alone.shape[1]
            torch.testing.assert_close(logits[start:start + count, :width], alone, rtol=1e-9, atol=1e-9)
            start += count


def test_the_resume_fingerprint_covers_what_training_runs_and_nothing_else():
    digests = source_digests()
    assert {"dohnuts/ops/kernels.py", "dohnuts/ops/delta_rule/scan.py", "dohnuts/model/decoder.py",
            "dohnuts/runtime/training.py", "dohnuts/runtime/checkpoint.py", "dohnuts/pipeline/train.py",
            "dohnuts/__init__.py", "dohnuts/ops/__init__.py"} <= set(digests)
    unrelated = {"dohnuts/bench/stage.py", "dohnuts/bench/roofline.py", "dohnuts/runtime/predict.py"}
    assert not unrelated & set(digests)  # an edit to the benchmark keeps a run's checkpoints
    assert all(len(digest) == 64 for digest in digests.values())


def test_train_refuses_to_clear_a_folder_it_did_not_create(tiny, tmp_path):
    out = tmp_path / "train"
    out.mkdir()
    (out / "thesis.tex").write_text("a user's file")
    with pytest.raises(FileExistsError, match="not a training run's folder"):
        train(_run(tiny, out, steps=1), resume=True)
    assert [path.name for path in out.iterdir()] == ["thesis.tex"]
    made = tmp_path / "made"
    train(_run(tiny, made, steps=1), resume=False)
    assert (made / RUN_MARKER).is_file()
    (made / "scratch.txt").write_text("inside a run's folder")
    train(_run(tiny, made, steps=1, lora=LoraConfig(rank=4)), resume=True)  # another run: cleared and rerun
    assert not (made / "scratch.txt").exists() and (made / "checkpoints" / "step-000001").is_dir()


def test_publish_refuses_a_target_holding_other_files(tmp_path, uninterrupted):
    whole, _ = uninterrupted
    target = tmp_path / "parent"
    target.mkdir()
    (target / "README.md").write_text("kept")
    publish(whole / "checkpoints" / "step-000005", target)
    publish(whole / "checkpoints" / "step-000004", target)  # a published checkpoint is replaced
    assert (target / "README.md").read_text() == "kept" and read_json(target / "manifest.json")["step"] == 4
    (target / ".gitattributes").write_text("*.safetensors filter=lfs")  # a hidden file at the top: kept
    publish(whole / "checkpoints" / "step-000005", target)
    assert (target / ".gitattributes").is_file() and read_json(target / "manifest.json")["step"] == 5
    for theirs in ("mine.bin", "notes/README.md", ".git/config"):  # anything else, hidden or nested: refused
        (target / theirs).parent.mkdir(exist_ok=True)
        (target / theirs).write_bytes(b"x")
        with pytest.raises(FileExistsError, match=theirs.replace(".", "\\.")):
            publish(whole / "checkpoints" / "step-000004", target)
        assert (target / theirs).read_bytes() == b"x" and read_json(target / "manifest.json")["step"] == 5
        (target / theirs).unlink()


def test_the_saved_state_holds_no_pickle(uninterrupted):
    out, _ = uninterrupted
    names = sorted(path.name for path in (out / "state").iterdir())
    assert names == ["adapter.safetensors", "generators.json", "generators.safetensors", "manifest.json",
                     "optimizer.pt", "progress.json"]  # no rng.pt
    # optimizer.pt is tensors and numbers: it loads without unpickling arbitrary objects.
    state = torch.load(out / "state" / "optimizer.pt", weights_only=True)
    assert set(state) == {"state", "param_groups"}
