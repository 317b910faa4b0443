"""Atomic writes and SHA-256 manifests."""

import pytest

from dohnuts.io import IntegrityError, atomic_directory, read_json, verify_manifest, write_json, write_manifest


def test_atomic_directory_leaves_nothing_behind_on_failure_and_keeps_the_old_folder(tmp_path):
    target = tmp_path / "out"
    with atomic_directory(target) as tmp:
        (tmp / "a.txt").write_text("old")
        write_manifest(tmp)
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


def test_atomic_directory_replaces_only_what_dohnuts_wrote(tmp_path):
    mine = tmp_path / "mine"
    with atomic_directory(mine) as tmp:
        (tmp / "w.bin").write_bytes(b"1")
        write_manifest(tmp)
    with atomic_directory(mine) as tmp:  # listed in its manifest: replaced
        (tmp / "w.bin").write_bytes(b"2")
        write_manifest(tmp)
    assert (mine / "w.bin").read_bytes() == b"2"
    (mine / "notes.txt").write_text("a user's file")
    with pytest.raises(FileExistsError, match="holds files dohnuts did not write \\(notes.txt\\)"), \
            atomic_directory(mine) as tmp:
        (tmp / "w.bin").write_bytes(b"3")
    assert (mine / "notes.txt").read_text() == "a user's file" and (mine / "w.bin").read_bytes() == b"2"
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "photo.png").write_bytes(b"png")
    with pytest.raises(FileExistsError, match="photo.png"), atomic_directory(theirs):
        pass
    assert sorted(path.name for path in tmp_path.iterdir()) == ["mine", "theirs"]  # no temporary left
    (tmp_path / "readme-only").mkdir()
    (tmp_path / "readme-only" / "README.md").write_text("kept")
    with atomic_directory(tmp_path / "readme-only", keep=("README.md",)) as tmp:
        (tmp / "w.bin").write_bytes(b"1")
    assert (tmp_path / "readme-only" / "README.md").read_text() == "kept"  # carried into the new folder
    # Hidden files and hidden folders' files are a user's too: refused, never deleted.
    for hidden in ("cfg/.secret", ".notes/todo.txt", ".env"):
        folder = tmp_path / f"hidden-{hidden.replace('/', '-')}"
        (folder / hidden).parent.mkdir(parents=True)
        (folder / hidden).write_text("mine")
        with pytest.raises(FileExistsError, match=hidden.replace(".", "\\.")), atomic_directory(folder):
            pass
        assert (folder / hidden).read_text() == "mine"


def test_a_complete_manifest_check_refuses_unlisted_files_but_a_readme(tmp_path):
    (tmp_path / "w.bin").write_bytes(b"w")
    write_manifest(tmp_path)
    (tmp_path / "README.md").write_text("about this folder")
    (tmp_path / ".gitignore").write_text("*")
    verify_manifest(tmp_path, complete=True)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "extra.bin").write_bytes(b"x")
    verify_manifest(tmp_path)  # listed files only
    with pytest.raises(IntegrityError, match="does not list: sub/extra.bin"):
        verify_manifest(tmp_path, complete=True)
