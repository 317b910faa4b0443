"""Isolation by content: no normalised text, image or source id in two partitions."""

import dataclasses

import pandas as pd
import pytest
from PIL import Image

from dohnuts.data import synthetic
from dohnuts.data.isolation import PARTITIONS, Unit, assign, components, cross_partition, normalise_text
from dohnuts.data.records import load_records, write_mixture
from dohnuts.inputs.pixels import image_key

FRACTIONS = {"train": 0.7, "dev": 0.1, "calibration": 0.1, "test": 0.1}


def test_texts_are_compared_after_unicode_case_and_space_normalisation():
    assert normalise_text("  The  Invoice\tis WRONG \n") == normalise_text("the invoice is wrong")
    assert normalise_text("ﬁle №5") == normalise_text("file No5")  # NFKC folds ligatures and the numero sign
    assert normalise_text("") is None and normalise_text("{}") is None and normalise_text(None) is None
    assert normalise_text("a b") != normalise_text("ab")


def test_states_sharing_a_text_an_image_or_a_source_are_joined_across_groups():
    units = [Unit("a", "Hello there"), Unit("b", "hello  THERE"),  # one text, two groups
             Unit("c", "{}", images=("pixels-1",)), Unit("d", "a caption", images=("pixels-1",)),  # one image
             Unit("d", "another caption", source="record-7"), Unit("e", "third", source="record-7"),
             Unit("e", "{}", images=("pixels-2",)), Unit("f", "{}", images=("pixels-3",))]  # empty texts join nothing
    roots = components(units)
    assert roots[0] == roots[1] and roots[2] == roots[3] and roots[4] == roots[5]
    assert len({roots[0], roots[2], roots[4], roots[6], roots[7]}) == 5


def test_a_shared_caption_over_different_images_joins_nothing_and_a_shared_document_does():
    caption = '{"caption": "a scanned form"}'
    document = "The agreement between the parties covers delivery, payment and returns. " * 4  # over 256 characters
    units = [Unit("forms", caption, images=(f"pixels-{index}",)) for index in range(3)]
    units += [Unit("claims", document, images=("photo-1",)), Unit("claims", document, images=("photo-2",))]
    units += [Unit("tickets", "short"), Unit("tickets", "SHORT")]  # no image: any shared text joins
    roots = components(units)
    assert len({roots[0], roots[1], roots[2]}) == 3
    assert roots[3] == roots[4] and roots[5] == roots[6]
    rows = zip(["train", "test", "train", "test", "train", "test"],
               [caption, caption, document, document, "short", "short"],
               [("pixels-0",), ("pixels-1",), ("photo-1",), ("photo-2",), (), ()])
    assert cross_partition(rows) == {"texts": 2, "images": 0}  # the document and the text state, not the caption
    assert cross_partition([("train", "{}", ("a", "b")), ("test", "{}", ("c", "b"))]) == {"texts": 0, "images": 1}


def test_one_photo_stored_with_different_bytes_by_two_groups_is_joined_by_a_link_to_the_photo():
    units = [Unit("aokvqa", '{"question": "What is on it?"}', images=("jpeg-bytes-a",), links=("photo:coco:397133",)),
             Unit("vqav2", '{"question": "Is it sunny?"}', images=("jpeg-bytes-b",), links=("photo:coco:397133",)),
             Unit("vqav2", '{"question": "Is it raining?"}', images=("jpeg-bytes-c",), links=("photo:coco:42",))]
    roots = components(units)
    assert roots[0] == roots[1] != roots[2]
    for seed in range(10):
        placed, _ = assign(units, seed, FRACTIONS)
        assert placed[0] == placed[1]


def test_training_rows_of_a_source_with_official_splits_are_hashed_only_among_the_partitions_it_allows():
    train_and_calibration = ("train", "calibration")
    units = [Unit("g", f"train row {i}", among=train_and_calibration) for i in range(400)]
    placed, _ = assign(units, 0, FRACTIONS)
    assert set(placed) == {"train", "calibration"}
    assert 0.05 < placed.count("calibration") / len(placed) < 0.25  # 0.1 of the 0.8 the two share
    # A component joins the restriction of every member: shared with an unrestricted state, still two.
    joined = [Unit("g", f"row {i}", among=train_and_calibration) for i in range(100)] + [
        Unit("h", f"ROW {i}") for i in range(100)]
    placed, _ = assign(joined, 0, FRACTIONS)
    assert set(placed) <= {"train", "calibration"} and placed[:100] == placed[100:]
    with pytest.raises(ValueError, match="among must hold train and calibration"):
        Unit("g", "x", among=("dev", "test"))


def test_joins_are_transitive_and_a_component_lands_whole_in_one_partition():
    document = "a document long enough to identify its state beside an image. " * 5
    units = [Unit("g", document if i == 1 else f"text {i}", images=(f"image {i // 2}",)) for i in range(6)]  # pairs
    units += [Unit("g", document, source="s"), Unit("h", "other", source="s")]  # a chain: 1 - 6 - 7
    roots = components(units)
    assert roots[0] == roots[1] == roots[6] == roots[7]
    for seed in range(20):
        placed, report = assign(units, seed, FRACTIONS)
        assert placed[0] == placed[1] == placed[6] == placed[7]
        assert placed[2] == placed[3] and placed[4] == placed[5]
        assert report["drops"] == {} and report["components"] == 3 and report["joined_states"] == 8


def test_pinned_splits_win_by_priority_and_conflicting_pins_are_dropped():
    units = [Unit("g", "shared", split="train"), Unit("g", "shared", split="test"), Unit("g", "shared"),
             Unit("g", "alone", split="dev"), Unit("h", "SHARED", split="calibration")]
    placed, report = assign(units, 0, FRACTIONS)
    assert placed == [None, "test", "test", "dev", None]
    assert report["drops"] == {"pinned_split_conflict": {"g": 1, "h": 1}}
    with pytest.raises(ValueError, match="split must be one of"):
        Unit("g", "x", split="validation")


def test_the_partition_depends_on_content_not_on_the_order_of_states():
    units = [Unit("g", f"state {i}") for i in range(200)]
    placed, _ = assign(units, 0, FRACTIONS)
    reversed_placed, _ = assign(units[::-1], 0, FRACTIONS)
    assert placed == reversed_placed[::-1]
    shares = pd.Series(placed).value_counts(normalize=True)
    assert shares["train"] == pytest.approx(0.7, abs=0.1)


def _written(root):
    return pd.concat([load_records(root / name) for name in PARTITIONS], ignore_index=True)


def test_a_prepared_mixture_has_no_text_and_no_image_in_two_partitions(tmp_path):
    states = synthetic.generate(seed=0, states_per_group=60, image_size=32)
    result = write_mixture(states, tmp_path, seed=0, fractions=FRACTIONS)
    rows = _written(tmp_path)
    # Checked here from the written rows, independently of the isolation's own report.
    per_text = rows.assign(text=[normalise_text(s) for s in rows.state]).dropna(subset=["text"])
    assert per_text.groupby("text").partition.nunique().max() == 1
    assert rows.explode("image_keys").dropna(subset=["image_keys"]).groupby("image_keys").partition.nunique().max() == 1
    assert result["isolation"]["cross_partition"] == {"texts": 0, "images": 0}
    # At 32 pixels two colour states may draw the same square: their rows repeat exactly.
    assert set(result["isolation"]["drops"]) <= {"exact_duplicate_rows"}
    dropped = sum(result["isolation"]["drops"].get("exact_duplicate_rows", {}).values())
    assert len(rows) == sum(len(state.questions) for state in states) - dropped
    assert set(rows.partition) == set(PARTITIONS)


def test_duplicated_and_re_encoded_states_are_isolated_and_exact_duplicates_dropped(tmp_path):
    states = synthetic.generate(seed=0, states_per_group=30, image_size=32)
    text_state = next(s for s in states if s.group == "message_tone")
    image_state = next(s for s in states if s.group == "image_color")
    # Same pixels, other PNG bytes: an RGBA copy (opaque) encodes differently but decodes alike.
    rgba = image_state.state["image"].convert("RGBA")
    assert image_key(rgba) == image_key(image_state.state["image"])
    extra = [
        dataclasses.replace(text_state, state_id="copy-exact"),  # an exact duplicate: its rows are dropped
        dataclasses.replace(text_state, group="ticket_fields", state_id="copy-group",
                            state=text_state.state.upper()),  # the same text, case changed, in another group
        dataclasses.replace(image_state, state_id="copy-pixels", state={"note": "re-encoded", "image": rgba}),
        dataclasses.replace(image_state, group="captioned_image", state_id="copy-captioned",
                            state={"caption": "a new caption", "image": Image.frombytes(
                                "RGB", image_state.state["image"].size, image_state.state["image"].tobytes())}),
    ]
    result = write_mixture(states + extra, tmp_path, seed=3, fractions=FRACTIONS)
    rows = _written(tmp_path)
    where = rows.groupby("state_id").partition.first()
    assert where["copy-group"] == where[text_state.state_id]
    assert where["copy-pixels"] == where["copy-captioned"] == where[image_state.state_id]
    assert "copy-exact" not in where
    assert result["isolation"]["drops"] == {"exact_duplicate_rows": {"message_tone": len(text_state.questions)}}
    assert result["isolation"]["cross_partition"] == {"texts": 0, "images": 0}
    png_files = {name for names in rows[rows.state_id.isin(["copy-pixels", image_state.state_id])].images
                 for name in names}
    assert len(png_files) == 2  # two files on disk, one image by content
