"""Whether the files a start downloaded from the Hub are the bytes the Hub named.

huggingface_hub checks a download's size, not its bytes: a proxy, a disk or a network
that changed one byte of a weights file made a model that loaded and answered wrong, and
the cache kept it for every later start. The Hub names each file's blob by a hash of it
(an LFS file's sha256, another file's git blob id), so a blob written by this start is
hashed against its own name. Blobs named otherwise (a mirror's other ETags) have nothing
to be checked against and pass.

Server process, before any worker starts; standard library only.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection
from pathlib import Path

CHUNK = 1 << 20  # bytes hashed at a time


def changed_downloads(
    snapshot: Path, since: float, names: Collection[str] | None = None
) -> list[str]:
    """The files of `snapshot` (those of `names` alone, where given) whose blob was
    written at `since` (a `time.time()`) or later and does not hash to its name, each
    deleted with its link, so that the next download writes it again (huggingface_hub
    takes a blob that is there as done)."""
    changed = []
    links = sorted(snapshot.rglob("*")) if names is None else [snapshot / n for n in names]
    for link in links:
        if not link.is_symlink():
            continue
        blob = link.resolve()
        try:
            written = blob.stat().st_mtime
        except OSError:
            continue
        if written >= since and not hashes_to_its_name(blob):
            changed.append(link.relative_to(snapshot).as_posix())
            blob.unlink(missing_ok=True)
            link.unlink(missing_ok=True)
    return changed


def cut_short(snapshot: Path, sizes: dict[str, int]) -> list[str]:
    """The files of `snapshot` shorter than the repo's listing gives them (`sizes`: path to
    bytes): a blob cut short in the cache (a disk filled, a copy stopped) was taken by
    every later download as done, and every start refused it. A longer one is no cut (a
    file edited by hand, a link to one's own copy). Sizes only: cheap enough for every
    start."""
    cut = []
    for name, size in sorted(sizes.items()):
        try:
            found = (snapshot / name).stat().st_size
        except OSError:  # not downloaded (skipped), or its blob gone: said elsewhere
            continue
        if found < size:
            cut.append(name)
    return cut


def forget(snapshot: Path, names: list[str]) -> None:
    """Delete the files `names` of `snapshot` from the Hub cache, so that a download
    writes them again: each link, and its blob where that is the cache's own (in the
    repo's blobs/ folder; a link to a file elsewhere leaves the file)."""
    blobs = (snapshot.parent.parent / "blobs").resolve()
    for name in names:
        link = snapshot / name
        target = link.resolve()
        if link.is_symlink() and target.parent == blobs:
            target.unlink(missing_ok=True)
        link.unlink(missing_ok=True)


def hashes_to_its_name(blob: Path) -> bool:
    """Whether the blob's bytes hash to its file name: a sha256 (64 hex digits), or a git
    blob id or a plain sha1 (40: a mirror may name files by the latter); True for a name
    of another form."""
    name = blob.name.lower()
    if len(name) not in (40, 64) or any(c not in "0123456789abcdef" for c in name):
        return True
    if len(name) == 64:
        return name in _digests(blob, hashlib.sha256())
    git = hashlib.sha1(b"blob %d\0" % blob.stat().st_size, usedforsecurity=False)
    return name in _digests(blob, git, hashlib.sha1(usedforsecurity=False))


def _digests(blob: Path, *digests: hashlib._Hash) -> list[str]:
    """The blob's hex digests, read once."""
    with open(blob, "rb") as bytes_in:
        while chunk := bytes_in.read(CHUNK):
            for digest in digests:
                digest.update(chunk)
    return [digest.hexdigest() for digest in digests]
