"""The whole public mixture from fixtures of every source: prepare, the doctor, isolation, caps, guard."""

import json

import pandas as pd
import pytest

from dohnuts.config import DataConfig, ModelConfig
from dohnuts.data.guard import fingerprint
from dohnuts.data.public.sources import MissingSources, manifest
from dohnuts.pipeline.prepare import prepare

from .fixtures import SHARED_TEXT, write_mixture


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    root = tmp_path_factory.mktemp("public")
    expected = write_mixture(root / "cache")
    guard = root / "guard.txt"
    guard.write_text(f"# one typed-decisions case, as an external benchmark input\n"
                     f"{fingerprint('train case 3')}\n")
    data = DataConfig(source="public", cache=str(root / "cache"), guard=str(guard),
                      allow_untested_groups=True)  # a few fixture rows a source: some groups miss test
    result = prepare(ModelConfig(image_pixels=64 * 64), data, 2048, root / "runs" / "base", root / "runs",
                     train_cap=5)
    return root, expected, result


def test_the_fixture_mixture_yields_every_group_with_the_expected_counts(prepared):
    _, expected, result = prepared
    assert len(expected) == 26 == len({group for source in manifest().values() for group in source.groups})
    doctor = result["doctor"]
    assert doctor["problem_count"] == 0
    assert {group: report["records"] for group, report in doctor["groups"].items()} == expected
    public = result["public"]
    assert {group: entry["rows_kept"] for group, entry in public["groups"].items()} == expected
    assert set(public["sources"]) == set(manifest())
    assert all(entry["license"] for entry in public["sources"].values())


def test_official_splits_are_kept_and_calibration_is_its_own_partition(prepared):
    root, _, result = prepared
    rows = {name: json.loads((root / "runs" / name / "manifest.json").read_text())["counts"]["groups"]
            for name in ("train", "dev", "calibration", "test")}
    # MASSIVE pins validation as dev and test as test: 6 rows each, untouched by the hash.
    assert rows["dev"]["massive_en-US"] == rows["test"]["massive_en-US"] == 6
    # BoolQ's validation is the test partition; its training rows never reach test.
    assert rows["test"]["boolq"] == 6
    assert result["isolation"]["cross_partition"] == {"texts": 0, "images": 0}


def test_one_text_in_two_groups_and_one_photo_in_two_groups_share_a_partition(prepared):
    root, _, _ = prepared

    frames = [pd.read_parquet(root / "runs" / name / "records.parquet").assign(partition=name)
              for name in ("train", "dev", "calibration", "test")]
    rows = pd.concat(frames)
    shared = rows[rows.state.str.contains(SHARED_TEXT)]
    assert set(shared.group) == {"ag_news", "emotion"} and shared.partition.nunique() == 1
    photo = rows[(rows.group == "vqav2_yesno") & (rows.state_id == "0")]
    aokvqa = rows[(rows.group == "aokvqa") & (rows.state_id == "train0")]
    assert len(photo) == len(aokvqa) == 1  # the COCO photo 500, stored as two different JPEGs
    assert photo.partition.iloc[0] == aokvqa.partition.iloc[0]


def test_the_training_cap_and_the_guard_drop_rows_and_count_them(prepared):
    root, _, result = prepared
    train = json.loads((root / "runs" / "train" / "manifest.json").read_text())["counts"]["groups"]
    assert max(train.values()) <= 5
    drops = result["isolation"]["drops"]
    assert sum(drops["train_cap"].values()) > 0
    assert drops["guard"] == {"typed_decisions": 3}  # the case's three questions, wherever it landed
    for name in ("train", "dev", "calibration", "test"):
        text = (root / "runs" / name / "records.parquet").read_bytes()
        assert b"train case 3" not in text


def test_prepare_without_the_raw_files_names_them_all_and_writes_nothing(tmp_path):
    out = tmp_path / "runs"
    with pytest.raises(MissingSources) as caught:
        prepare(ModelConfig(), DataConfig(source="public", cache=str(tmp_path / "cache")), 2048, out / "base", out)
    assert all(f"  {name} (" in str(caught.value) for name in manifest())
    assert not out.exists()
