"""Partitions, record folders and encoding of examples."""

import pandas as pd
import pytest

from dohnuts.data import synthetic
from dohnuts.data.isolation import PARTITIONS, hashed_partition
from dohnuts.data.records import hash_order, load_records, write_mixture
from dohnuts.io import IntegrityError

FRACTIONS = {"train": 0.7, "dev": 0.1, "calibration": 0.1, "test": 0.1}


def test_partition_is_a_stable_salted_hash_with_the_configured_shares():
    keys = [f"s{i}" for i in range(4000)]
    first = [hashed_partition(0, key, FRACTIONS) for key in keys]
    assert first == [hashed_partition(0, key, FRACTIONS) for key in keys]
    shares = pd.Series(first).value_counts(normalize=True)
    for name, fraction in FRACTIONS.items():
        assert shares[name] == pytest.approx(fraction, abs=0.03)
    assert first != [hashed_partition(1, key, FRACTIONS) for key in keys]


def test_every_state_lands_whole_in_exactly_one_partition(tmp_path):
    states = synthetic.generate(seed=0, states_per_group=30, image_size=32)
    counts = write_mixture(states, tmp_path, seed=0, fractions=FRACTIONS)["partitions"]
    tables = {name: load_records(tmp_path / name) for name in PARTITIONS}
    seen = {}
    for name, table in tables.items():
        assert (table.partition == name).all() and counts[name]["rows"] == len(table)
        for state_id in table.state_id.unique():
            assert state_id not in seen, f"{state_id} in {seen.get(state_id)} and {name}"
            seen[state_id] = name
    assert len(seen) == len(states)
    expected_rows = sum(len(state.questions) for state in states)
    assert sum(len(table) for table in tables.values()) == expected_rows
    images = tables["test"].images.explode().dropna()
    assert len(images) and all((tmp_path / "test" / name).is_file() for name in images)


def test_a_changed_record_file_is_refused(tmp_path):
    write_mixture(synthetic.generate(0, 8, 32), tmp_path, seed=0, fractions=FRACTIONS)
    with open(tmp_path / "dev" / "records.parquet", "ab") as handle:
        handle.write(b"x")
    with pytest.raises(IntegrityError, match="records.parquet has SHA-256"):
        load_records(tmp_path / "dev")


def test_hash_order_caps_each_group_and_is_fixed():
    rows = pd.DataFrame({"group": ["a"] * 10 + ["b"] * 3, "state_id": [str(i) for i in range(13)],
                         "qid": ["q"] * 13})
    picked = hash_order(rows, 4)
    assert picked.group.value_counts().to_dict() == {"a": 4, "b": 3}
    assert picked.equals(hash_order(rows.sample(frac=1.0, random_state=1), 4))
