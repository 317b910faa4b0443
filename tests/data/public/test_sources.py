"""The manifest, finding raw files in the local cache, the offline error, and pinned digests."""

from dataclasses import replace

import pytest

from dohnuts.data.public.mixture import public_states
from dohnuts.data.public.sources import (
    OFFICIAL_SPLITS,
    MissingSources,
    SourceIntegrityError,
    check_present,
    locate,
    manifest,
    verify,
)
from dohnuts.io import sha256_file

from .fixtures import local_path


def test_every_source_names_its_license_revision_and_files_with_their_official_splits():
    sources = manifest()
    for source in sources.values():
        assert source.license and source.files
        assert source.hub is not None or all(file.url for file in source.files)
        assert source.hub is None or source.revision
        assert all(file.split in (*OFFICIAL_SPLITS, None) for file in source.files)
    groups = [group for source in sources.values() for group in source.groups]
    assert len(groups) == len(set(groups))  # a group comes from one source


def test_without_the_raw_files_the_error_names_every_missing_source_and_how_to_fetch_it(tmp_path):
    with pytest.raises(MissingSources) as caught:
        public_states(tmp_path / "empty", 0, 100)
    message = str(caught.value)
    for name, source in manifest().items():
        assert f"  {name} (" in message and source.license in message
        if source.hub:
            assert f"{source.hub}@{source.revision}" in message
            assert f"hf download {source.hub} --repo-type dataset --revision {source.revision}" in message
        for file in source.files:
            if file.url:
                assert file.url in message
    assert "dohnuts public fetch" in message and str(tmp_path / "empty" / "hub") in message


def test_a_present_source_is_found_a_missing_file_is_named_and_a_pinned_digest_is_checked(tmp_path):
    source = manifest()["boolq"]
    train = local_path(tmp_path, source, source.files[0])
    train.write_bytes(b"not really parquet")
    found, missing = locate(source, tmp_path)
    assert found == {source.files[0].path: [train]} and missing == [source.files[1]]
    with pytest.raises(MissingSources, match="boolq .* missing data/validation-00000-of-00001.parquet"):
        check_present({"boolq": source}, tmp_path)
    local_path(tmp_path, source, source.files[1]).write_bytes(b"nor this")
    found = check_present({"boolq": source}, tmp_path)["boolq"]
    assert verify(source, found)[source.files[0].path] == sha256_file(train)
    pinned = replace(source, files=(replace(source.files[0], sha256="0" * 64), source.files[1]))
    with pytest.raises(SourceIntegrityError, match="pins 0000"):
        verify(pinned, found)
