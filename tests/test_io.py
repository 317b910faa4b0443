"""Atomic writes and SHA-256 manifests."""

import pytest

from dohnuts.io import IntegrityError, atomic_directory, read_json, verify_manifest, write_json, write_manifest


def test_atomic_directory_leaves_nothing_behind_on_failure_and_keeps_the_old_folder(tmp_path):
    target = tmp_path / "out"
    with atomic_directory(target) as tmp:
        (tmp / "a.txt").write_text("old")
    with pytest.raises(RuntimeError), atomic_directory(target) as tmp:
        (tmp / "a.txt").write_text("new")
        raise RuntimeError("killed")
    assert (target / "a.txt").read_text() == "old"
    assert sorted(path.name for path in tmp_path.iterdir()) == ["out"]


def test_manifest_detects_changed_missing_and_unlisted_required_files(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "w.bin").write_bytes(b"weights")
    write_json(tmp_path / "c.json", {"x": 1})
    manifest = write_manifest(tmp_path, {"step": 4})
    assert set(manifest["files"]) == {"sub/w.bin", "c.json"} and read_json(tmp_path / "manifest.json")["step"] == 4
    assert verify_manifest(tmp_path, required=("sub/w.bin",))["step"] == 4
    with pytest.raises(IntegrityError, match="does not list required file 'other'"):
        verify_manifest(tmp_path, required=("other",))
    (tmp_path / "sub" / "w.bin").write_bytes(b"weightz")
    with pytest.raises(IntegrityError, match="w.bin has SHA-256"):
        verify_manifest(tmp_path)
    (tmp_path / "sub" / "w.bin").unlink()
    with pytest.raises(IntegrityError, match="listed in the manifest but missing"):
        verify_manifest(tmp_path)
    with pytest.raises(IntegrityError, match="has no manifest.json"):
        verify_manifest(tmp_path / "sub")
