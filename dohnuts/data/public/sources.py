"""The public sources: the committed manifest, where their raw files sit locally, fetching them.

Each source is a Hugging Face dataset repository at a revision, or files at URLs (a source's own
release where it is not on the Hub), with its license and, per raw file, the official split it
holds and its pinned SHA-256. Hub files live in the Hugging Face hub cache (`datasets--owner--name/
snapshots/<commit>/<path>`), URL files under `<cache>/files/<source>/`. Nothing here touches the
network except `fetch`.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shutil
import tempfile
import urllib.request
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from ...io import sha256_file

OFFICIAL_SPLITS = ("train", "dev", "test")
_COMMIT = re.compile(r"[0-9a-f]{40}")


@dataclass(frozen=True)
class RawFile:
    """One raw file of a source. path: inside the Hub repository at the revision (a glob such as
    `data/train-*.parquet` where the shard names are not known in advance), or the file name
    under the source's cache folder for a `url` file; split: the official split it holds
    (train, dev or test; None: the source has no official split, or the file holds several);
    sha256: the pinned digest (None: not pinned yet; a fetch reports what it found)."""

    path: str
    split: str | None = None
    sha256: str | None = None
    url: str | None = None

    @property
    def pattern(self) -> bool:
        return any(character in self.path for character in "*?[")


@dataclass(frozen=True)
class Source:
    """A public source: the groups it yields, where its files come from, under which license."""

    name: str
    family: str
    groups: tuple[str, ...]
    license: str
    files: tuple[RawFile, ...]
    hub: str | None = None
    revision: str | None = None
    note: str = ""
    archive_splits: tuple[str, ...] = ()

    def pinned_splits(self) -> set[str]:
        """The official splits this source pins (dev, test), in its files or inside its archives
        (`archive_splits`): its training rows hash among the rest."""
        return {split for split in [file.split for file in self.files] + list(self.archive_splits)
                if split in ("dev", "test")}

    def where(self, file: RawFile) -> str:
        """Where a raw file comes from, for messages: its URL, or hf://datasets/<repo>@<revision>/<path>."""
        return file.url or f"hf://datasets/{self.hub}@{self.revision or 'main'}/{file.path}"


class MissingSources(FileNotFoundError):
    """Raw files of public sources are not in the local cache: every one, and how to fetch it."""


class SourceIntegrityError(ValueError):
    """A raw file's SHA-256 is not the one the manifest pins."""


def manifest() -> dict[str, Source]:
    """The committed manifest (`manifest.json` beside this module), source name -> Source."""
    data = json.loads(resources.files(__package__).joinpath("manifest.json").read_text(encoding="utf-8"))
    sources = {}
    for entry in data["sources"]:
        files = tuple(RawFile(**file) for file in entry.pop("files"))
        source = Source(files=files, groups=tuple(entry.pop("groups")),
                        archive_splits=tuple(entry.pop("archive_splits", ())), **entry)
        bad = [file.path for file in files if file.split not in (*OFFICIAL_SPLITS, None)]
        if bad or not files or (source.hub is None and any(file.url is None for file in files)):
            raise ValueError(f"manifest.json: source {source.name} has a bad file list {bad or list(files)}")
        sources[source.name] = source
    return sources


def cache_folders(cache: str | Path | None) -> tuple[Path, Path]:
    """(the Hugging Face hub cache, the folder of URL files) under `cache`, or the defaults:
    the hub cache `huggingface_hub` uses (HF_HUB_CACHE) and `dohnuts-public` beside it."""
    if cache is not None:
        return Path(cache) / "hub", Path(cache) / "files"
    from huggingface_hub import constants

    hub = Path(constants.HF_HUB_CACHE)
    return hub, hub.parent / "dohnuts-public"


def _snapshot(hub_cache: Path, source: Source) -> Path | None:
    """The cached snapshot folder of a source's Hub revision (a commit, or a branch the cache
    has resolved), or None."""
    repo = hub_cache / ("datasets--" + source.hub.replace("/", "--"))
    revision = source.revision or "main"
    if not _COMMIT.fullmatch(revision):
        ref = repo / "refs" / revision
        if not ref.is_file():
            return None
        revision = ref.read_text().strip()
    folder = repo / "snapshots" / revision
    return folder if folder.is_dir() else None


def locate(source: Source, cache: str | Path | None) -> tuple[dict[str, list[Path]], list[RawFile]]:
    """Where each raw file of `source` is in the local cache, without the network.

    Returns:
        ({file path or pattern: local files (several for a pattern, sorted)}, the raw files missing)
    """
    hub_cache, url_cache = cache_folders(cache)
    found, missing = {}, []
    snapshot = _snapshot(hub_cache, source) if source.hub else None
    for file in source.files:
        if file.url is not None:
            local = url_cache / source.name / file.path
            matches = [local] if local.is_file() else []
        elif snapshot is None:
            matches = []
        elif file.pattern:
            matches = sorted(path for path in snapshot.glob(file.path) if path.is_file())
        else:
            matches = [snapshot / file.path] if (snapshot / file.path).is_file() else []
        if matches:
            found[file.path] = matches
        else:
            missing.append(file)
    return found, missing


def missing_message(missing: dict[str, list[RawFile]], sources: dict[str, Source], cache) -> str:
    """One message naming every missing source, its revision and files, and how to fetch them."""
    hub_cache, url_cache = cache_folders(cache)
    lines = [f"data.source public: {len(missing)} of the selected sources are not in the local cache, so "
             f"nothing was read (Hugging Face hub cache {hub_cache}, URL files under {url_cache}):"]
    commands = []
    for name, files in missing.items():
        source = sources[name]
        origin = f"{source.hub}@{source.revision or 'main'}" if source.hub else "its own release"
        paths = ", ".join(file.path for file in files[:4]) + (f" and {len(files) - 4} more" if len(files) > 4 else "")
        lines.append(f"  {name} ({', '.join(source.groups)}; {origin}; {source.license}): missing {paths}")
        for file in files:
            if file.url is not None:
                commands.append(f"  curl -L --create-dirs -o {url_cache / name / file.path} {file.url}")
        hub_files = [file.path for file in files if file.url is None]
        if hub_files:
            commands.append(f"  hf download {source.hub} --repo-type dataset --revision {source.revision or 'main'} "
                            f"--cache-dir {hub_cache} " + " ".join(f"'{path}'" if "*" in path else path
                                                                   for path in hub_files))
    lines.append("Fetch them on a machine with network with `dohnuts public fetch` (same cache), or by hand:")
    return "\n".join(lines + commands)


def check_present(sources: dict[str, Source], cache) -> dict[str, dict[str, list[Path]]]:
    """The local files of every source, or MissingSources naming all that are missing."""
    found, missing = {}, {}
    for name, source in sources.items():
        found[name], absent = locate(source, cache)
        if absent:
            missing[name] = absent
    if missing:
        raise MissingSources(missing_message(missing, sources, cache))
    return found


def verify(source: Source, found: dict[str, list[Path]]) -> dict[str, str]:
    """The SHA-256 of every local file of `source`; SourceIntegrityError if a pinned one differs."""
    digests = {}
    for file in source.files:
        for path in found[file.path]:
            digest = sha256_file(path)
            if file.sha256 is not None and digest != file.sha256:
                raise SourceIntegrityError(f"{source.name}: {path} has SHA-256 {digest}, but the manifest pins "
                                           f"{file.sha256} for {source.where(file)}; delete it and fetch again")
            digests[str(path.name if file.pattern else file.path)] = digest
    return digests


def fetch(sources: dict[str, Source], cache, echo=print) -> dict[str, dict[str, str]]:
    """Download every raw file not yet cached (the Hub through `huggingface_hub` at the pinned
    revision, URL files by streaming to a temporary file, renamed when complete), then verify
    them. Returns {source: {file: SHA-256}}, to pin the unpinned ones in the manifest."""
    hub_cache, url_cache = cache_folders(cache)
    digests = {}
    for name, source in sources.items():
        _, missing = locate(source, cache)
        for file in missing:
            echo(f"{name}: fetching {source.where(file)}")
            if file.url is not None:
                _download(file.url, url_cache / name / file.path)
            else:
                _hub_download(source, file, hub_cache)
        found, still = locate(source, cache)
        if still:
            raise MissingSources(f"{name}: {[file.path for file in still]} did not arrive")
        digests[name] = verify(source, found)
    return digests


def _hub_download(source: Source, file: RawFile, hub_cache: Path) -> None:
    from huggingface_hub import HfApi, hf_hub_download

    paths = [file.path]
    if file.pattern:
        listed = HfApi().list_repo_files(source.hub, repo_type="dataset", revision=source.revision)
        paths = [path for path in listed if fnmatch.fnmatch(path, file.path)]
    for path in paths:
        hf_hub_download(source.hub, path, repo_type="dataset", revision=source.revision, cache_dir=hub_cache)


def _download(url: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
    try:
        with os.fdopen(handle, "wb") as stream, urllib.request.urlopen(url, timeout=60) as response:
            shutil.copyfileobj(response, stream, 1 << 20)
        os.replace(temporary, target)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
