"""The limits a container's cgroup sets on this process, which neither the CPU affinity
nor /proc/meminfo shows: its CPU quota (`docker run --cpus 2`, a Kubernetes CPU limit,
which leave every core of the host in the affinity mask) and its memory limit
(`--memory 4g`, a Kubernetes memory limit, past which the kernel kills a process).

cgroup v2 (`cpu.max`, `memory.max`) and v1 (`cpu.cfs_quota_us` over `cpu.cfs_period_us`,
`memory.limit_in_bytes`) alike, found as the kernel says: this process's cgroup in
/proc/self/cgroup, under its controller's mount in /proc/self/mountinfo. The lowest limit
of the cgroup and of its ancestors holds. Plain file reads, no torch; `root` is `/` but
for tests, which build fake trees.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path("/")  # read at each call: the tests' machine is set apart from its own limits
V1_UNLIMITED = 2**60  # v1 says "no limit" with a huge number (9223372036854771712)
_V1_DEFAULT_MOUNT = "/sys/fs/cgroup/{controller}"
_V2_DEFAULT_MOUNT = "/sys/fs/cgroup"


@dataclass(frozen=True)
class Limit:
    value: float  # CPUs (the quota over its period) or bytes
    file: Path  # the file that sets it, for the log and /info


@dataclass(frozen=True)
class _Mount:
    root: str  # the cgroup the mount shows at its mount point
    point: str
    controllers: frozenset[str]  # none for v2's one hierarchy
    version: int


def cpu_limit(root: Path | None = None) -> Limit | None:
    """The CPUs the cgroup's quota allows (`2.0` for `--cpus 2`), None where none is set."""
    return _lowest(ROOT if root is None else root, "cpu", _cpu_v2, _cpu_v1)


def memory_limit(root: Path | None = None) -> Limit | None:
    """The bytes the cgroup's memory limit allows, None where none is set."""
    return _lowest(ROOT if root is None else root, "memory", _memory_v2, _memory_v1)


def _cpu_v2(folder: Path) -> float | None:
    quota, _, period = _read(folder / "cpu.max").partition(" ")
    if quota in ("", "max"):
        return None
    return int(quota) / int(period or 100_000)


def _cpu_v1(folder: Path) -> float | None:
    quota = _read(folder / "cpu.cfs_quota_us")
    if quota in ("", "-1"):
        return None
    return int(quota) / int(_read(folder / "cpu.cfs_period_us") or 100_000)


def _memory_v2(folder: Path) -> float | None:
    limit = _read(folder / "memory.max")
    return None if limit in ("", "max") else int(limit)


def _memory_v1(folder: Path) -> float | None:
    limit = _read(folder / "memory.limit_in_bytes")
    return None if limit == "" or int(limit) >= V1_UNLIMITED else int(limit)


_FILES: dict[Callable[[Path], float | None], str] = {  # the file each reads
    _cpu_v2: "cpu.max",
    _cpu_v1: "cpu.cfs_quota_us",
    _memory_v2: "memory.max",
    _memory_v1: "memory.limit_in_bytes",
}


def _lowest(
    root: Path,
    controller: str,
    v2: Callable[[Path], float | None],
    v1: Callable[[Path], float | None],
) -> Limit | None:
    """The lowest limit over this process's cgroup folders for `controller` (v2's and
    v1's: a hybrid host has both), each read by its version's reader."""
    lowest: Limit | None = None
    for folder, version in _folders(root, controller):
        read = v2 if version == 2 else v1
        try:
            value = read(folder)
        except (ValueError, ZeroDivisionError):  # not a number, or a period of 0: none known
            continue
        if value is not None and value > 0 and (lowest is None or value < lowest.value):
            lowest = Limit(value, Path("/") / (folder / _FILES[read]).relative_to(root))
    return lowest


def _folders(root: Path, controller: str) -> Iterator[tuple[Path, int]]:
    """This process's cgroup folders for `controller`, each of its own and its ancestors'
    up to the mount, with the cgroup version of each."""
    mounts = _mounts(root)
    for line in _read(root / "proc/self/cgroup").splitlines():
        number, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if number == "0" and not controllers:
            version = 2
        elif controller in controllers.split(","):
            version = 1
        else:
            continue
        for mount in _mounts_of(mounts, controller, version):
            if path != mount.root and not path.startswith(mount.root.rstrip("/") + "/"):
                continue  # not under what this mount shows (another namespace's)
            inside = path[len(mount.root.rstrip("/")) :].strip("/")
            if ".." in inside.split("/"):  # outside this cgroup namespace: its root's limit
                inside = ""
            folder = root / mount.point.lstrip("/") / inside
            top = root / mount.point.lstrip("/")
            while True:
                yield folder, version
                if folder == top:
                    break
                folder = folder.parent


def _mounts_of(mounts: list[_Mount], controller: str, version: int) -> list[_Mount]:
    found = [
        mount
        for mount in mounts
        if mount.version == version and (version == 2 or controller in mount.controllers)
    ]
    if found or mounts:
        return found
    # no mountinfo to read: where the kernel's mounts usually are
    point = _V2_DEFAULT_MOUNT if version == 2 else _V1_DEFAULT_MOUNT.format(controller=controller)
    return [_Mount("/", point, frozenset({controller}), version)]


def _mounts(root: Path) -> list[_Mount]:
    """The cgroup mounts in /proc/self/mountinfo: `… root point options … - type source
    super-options` a line."""
    mounts = []
    for line in _read(root / "proc/self/mountinfo").splitlines():
        fields, _, tail = line.partition(" - ")
        head, kinds = fields.split(), tail.split()
        if len(head) < 5 or len(kinds) < 3 or kinds[0] not in ("cgroup", "cgroup2"):
            continue
        version = 2 if kinds[0] == "cgroup2" else 1
        controllers = frozenset(kinds[2].split(",")) if version == 1 else frozenset()
        mounts.append(_Mount(head[3], head[4], controllers, version))
    return mounts


def _read(path: Path) -> str:
    """A file's text, stripped; empty where it cannot be read. Bytes that are not UTF-8
    (a mount point's name in mountinfo) are kept as a path's are (os.fsdecode)."""
    try:
        return path.read_text(errors="surrogateescape").strip()
    except OSError:
        return ""
