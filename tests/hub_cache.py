"""Hub repos for tests: a repo's files and commit ids, and a Hub cache folder built from them.

`HubRepo` holds one repo as the Hub would: files by commit, refs (branches and tags)
pointing at commits, git blob ids and LFS sha256 for each file. `write_hub_cache` lays
the repo out the way huggingface_hub's cache does, so `snapshot_download` with
`HF_HUB_OFFLINE=1` finds it without any network:

    <cache>/models--org--name/blobs/<etag>
    <cache>/models--org--name/snapshots/<commit>/<path>  -> ../../blobs/<etag>
    <cache>/models--org--name/refs/main                  (the commit id, no newline)

The loopback Hub stand-in (`tests/hub_server.py`) serves the same `HubRepo` values.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".h5", ".onnx", ".msgpack", ".ot")


def git_blob_id(content: bytes) -> str:
    """The git object id of a file (what the Hub's tree lists as `oid`)."""
    return hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()


def is_lfs(path: str) -> bool:
    """Weights are stored with Git LFS on the Hub (and served by redirect to a CDN)."""
    return path.endswith(LFS_SUFFIXES)


def etag(path: str, content: bytes) -> str:
    """The Hub's ETag of a file: its LFS sha256 for weights, its git blob id otherwise."""
    return hashlib.sha256(content).hexdigest() if is_lfs(path) else git_blob_id(content)


def folder_files(folder: Path) -> dict[str, bytes]:
    """Every file under `folder`, by its '/'-separated path inside it."""
    return {
        path.relative_to(folder).as_posix(): path.read_bytes()
        for path in sorted(folder.rglob("*"))
        if path.is_file()
    }


def commit_id(files: Mapping[str, bytes], salt: str = "") -> str:
    """A 40-hex commit id that depends on the files (and `salt`, for a second commit)."""
    digest = hashlib.sha1(salt.encode())
    for path in sorted(files):
        digest.update(path.encode() + b"\0" + git_blob_id(files[path]).encode())
    return digest.hexdigest()


@dataclass
class HubRepo:
    """A model repo: its commits (files by path) and refs (branch or tag -> commit)."""

    repo_id: str
    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)
    refs: dict[str, str] = field(default_factory=dict)
    gated: bool = False
    # tokens allowed to read a gated repo (others get 403; no token gets 401)
    granted_tokens: set[str] = field(default_factory=set)

    @classmethod
    def from_folder(cls, repo_id: str, folder: Path, **kwargs: object) -> HubRepo:
        repo = cls(repo_id, **kwargs)  # type: ignore[arg-type]
        repo.add_commit(folder_files(folder), refs=("main",))
        return repo

    def add_commit(self, files: Mapping[str, bytes], refs: tuple[str, ...] = ()) -> str:
        commit = commit_id(files, salt=str(len(self.commits)))
        self.commits[commit] = dict(files)
        for ref in refs:
            self.refs[ref] = commit
        return commit

    def commit_of(self, revision: str) -> str | None:
        """The commit a branch, tag or commit id names; None if it names none."""
        if revision in self.commits:
            return revision
        return self.refs.get(revision)

    @property
    def main(self) -> str:
        return self.refs["main"]


def repo_folder_name(repo_id: str) -> str:
    return "models--" + repo_id.replace("/", "--")


def write_hub_cache(cache: Path, repo: HubRepo, commits: tuple[str, ...] | None = None) -> Path:
    """Write `repo` into the Hub cache folder `cache` (HF_HUB_CACHE) as huggingface_hub
    lays it out; only `commits` if given, else every commit. Returns the repo's folder."""
    storage = cache / repo_folder_name(repo.repo_id)
    for commit in commits if commits is not None else tuple(repo.commits):
        snapshot = storage / "snapshots" / commit
        for path, content in repo.commits[commit].items():
            blob = storage / "blobs" / etag(path, content)
            blob.parent.mkdir(parents=True, exist_ok=True)
            if not blob.exists():
                blob.write_bytes(content)
            pointer = snapshot / path
            pointer.parent.mkdir(parents=True, exist_ok=True)
            pointer.symlink_to(os.path.relpath(blob, pointer.parent))
    (storage / "refs").mkdir(parents=True, exist_ok=True)
    for ref, commit in repo.refs.items():
        if commits is None or commit in commits:
            ref_file = storage / "refs" / ref
            ref_file.parent.mkdir(parents=True, exist_ok=True)
            ref_file.write_text(commit)
    return storage
