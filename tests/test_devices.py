"""Device lists and per-worker GPU isolation, without a GPU; the cores a process may
run on, its container's CPU limit counted (on fake cgroup trees)."""

from __future__ import annotations

from pathlib import Path

import pytest

from rawserve.shared import cgroups
from rawserve.shared.devices import (
    AFFINITY,
    DevicePlan,
    core_count,
    gpu_present,
    isolate,
    parse_devices,
)


@pytest.mark.parametrize(
    ("spec", "devices"),
    [
        ("cpu", ["cpu"]),
        ("cpu,cpu", ["cpu", "cpu"]),
        ("cuda:0, cuda:1", ["cuda:0", "cuda:1"]),
        ("CUDA", ["cuda"]),
        ("auto", ["auto"]),
    ],
)
def test_one_worker_per_entry(spec, devices):
    assert parse_devices(spec) == devices


@pytest.mark.parametrize("spec", ["gpu", "cuda:", "cuda:x", "cpu,,cpu", "", "cuda:-1", "tpu:0"])
def test_invalid_devices_are_refused(spec):
    with pytest.raises(ValueError, match="invalid device"):
        parse_devices(spec)


def test_a_gpu_outside_the_inherited_visible_list_is_refused():
    assert parse_devices("cuda:0,cuda:1", visible_gpus="4,5") == ["cuda:0", "cuda:1"]
    with pytest.raises(ValueError, match="CUDA_VISIBLE_DEVICES"):
        parse_devices("cuda:2", visible_gpus="4,5")


@pytest.mark.parametrize(
    ("device", "inherited", "plan"),
    [
        ("cuda:0", None, DevicePlan("cuda:0", "0")),
        ("cuda:3", None, DevicePlan("cuda:0", "3")),
        ("cuda:1", "4,5", DevicePlan("cuda:0", "5")),
        ("cuda:0", " 4 , 5 ", DevicePlan("cuda:0", "4")),
        ("cuda:1", "", DevicePlan("cuda:0", "1")),
        ("cuda", None, DevicePlan("cuda:0", None)),
        ("cpu", "4,5", DevicePlan("cpu", None)),
        ("auto", None, DevicePlan("auto", None)),
        ("mps", None, DevicePlan("mps", None)),
    ],
)
def test_each_worker_sees_only_its_gpu(device, inherited, plan):
    assert isolate(device, inherited) == plan


@pytest.mark.parametrize(
    ("nodes", "shown"),
    [
        (["nvidia0", "nvidiactl", "nvidia-uvm"], True),
        (["nvidia3", "nvidiactl", "nvidia-uvm"], True),  # a container given the host's GPU 3
        (["nvidia12"], True),
        (["kfd"], True),  # ROCm
        (["nvidiactl", "nvidia-uvm", "nvidia-caps"], False),  # the driver, and no GPU given
        ([], False),
        (["dxg", "wsl/libcuda.so"], True),  # WSL 2 with Windows' NVIDIA driver
        (["dxg"], False),  # WSL 2 with another GPU: no CUDA
    ],
)
def test_a_gpu_is_shown_by_its_node_whichever_its_number(tmp_path, monkeypatch, nodes, shown):
    """Only /dev/nvidia0 was read: a container given another GPU than the host's first,
    or WSL 2 with an NVIDIA GPU, was planned as a CPU machine, a worker per core and the
    GPU unused."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    (tmp_path / "wsl").mkdir()
    for node in nodes:
        (tmp_path / node).touch()
    assert gpu_present(tmp_path, tmp_path / "wsl") is shown
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "-1")  # hidden from CUDA: no GPU
    assert gpu_present(tmp_path, tmp_path / "wsl") is False


def test_two_gpu_workers_never_share_a_visible_device():
    plans = [isolate(device) for device in parse_devices("cuda:0,cuda:1")]
    assert [plan.visible_gpus for plan in plans] == ["0", "1"]
    assert {plan.torch_device for plan in plans} == {"cuda:0"}


# --- the cores: the affinity, and a container's CPU limit --------------------------


def cgroup_tree(root: Path, cgroup: str, mountinfo: str, files: dict[str, str]) -> Path:
    """A fake `/` with this process's /proc/self/cgroup and mountinfo, and cgroup files."""
    (root / "proc/self").mkdir(parents=True)
    (root / "proc/self/cgroup").write_text(cgroup)
    (root / "proc/self/mountinfo").write_text(mountinfo)
    for name, text in files.items():
        (root / name.lstrip("/")).parent.mkdir(parents=True, exist_ok=True)
        (root / name.lstrip("/")).write_text(text)
    return root


V2_MOUNT = "30 23 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n"
V1_MOUNTS = (
    "31 23 0:28 / /sys/fs/cgroup rw - tmpfs tmpfs rw,mode=755\n"
    "32 31 0:29 /docker/abc /sys/fs/cgroup/cpu,cpuacct rw - cgroup cgroup rw,cpu,cpuacct\n"
    "35 31 0:32 /docker/abc /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n"
)


def v2_tree(root: Path, cpu_max: str, memory_max: str = "max") -> Path:
    """`docker run --cpus …` on cgroup v2, with its own cgroup namespace: its cgroup is `/`."""
    files = {"sys/fs/cgroup/cpu.max": cpu_max, "sys/fs/cgroup/memory.max": memory_max}
    return cgroup_tree(root, "0::/\n", V2_MOUNT, files)


def v1_tree(root: Path, quota: str, limit: str = "9223372036854771712") -> Path:
    """The same on cgroup v1 without a cgroup namespace: its cgroup is /docker/abc, which
    the controllers' mounts show at their mount points."""
    files = {
        "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us": quota,
        "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_period_us": "100000",
        "sys/fs/cgroup/memory/memory.limit_in_bytes": limit,
    }
    cgroup = "12:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n0::/docker/abc\n"
    return cgroup_tree(root, cgroup, V1_MOUNTS, files)


OUTSIDE = {"sys/fs/cgroup/cpu.max": "400000 100000", "sys/fs/cpu.max": "100000 100000"}


@pytest.mark.parametrize(
    ("tree", "cores"),
    [
        (lambda root: v2_tree(root, "200000 100000"), 2),  # --cpus 2
        (lambda root: v2_tree(root, "150000 100000"), 2),  # --cpus 1.5: rounded up
        (lambda root: v2_tree(root, "10000 100000"), 1),  # --cpus 0.1: one at least
        (lambda root: v2_tree(root, "max 100000"), 64),  # no limit
        (lambda root: v2_tree(root, "12800000 100000"), 64),  # more than the affinity
        (lambda root: v1_tree(root, "300000"), 3),
        (lambda root: v1_tree(root, "-1"), 64),
        (lambda root: root, 64),  # no /proc, no cgroup files
        (  # a cgroup outside the namespace's root: the root's limit, nothing above it
            lambda root: cgroup_tree(root, "0::/../sibling\n", V2_MOUNT, OUTSIDE),
            4,
        ),
    ],
    ids=["v2-2", "v2-1.5", "v2-0.1", "v2-max", "v2-128", "v1-3", "v1-none", "none", "outside"],
)
def test_a_container_s_cpu_limit_bounds_the_cores(tmp_path, monkeypatch, tree, cores):
    """`docker run --cpus 2` (a Kubernetes CPU limit) on a 64-core host leaves all 64 in
    the affinity: counted as 64, the layout planned 64 workers throttled to 2 CPUs."""
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(64)))
    found = core_count(tree(tmp_path))
    assert found.cores == cores
    assert (found.source == AFFINITY) == (cores == 64)


def test_the_source_names_the_limit_and_the_file_that_sets_it(tmp_path, monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(64)))
    found = core_count(v1_tree(tmp_path, "200000"))
    assert "/sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us" in found.source
    assert "of 64 allowed" in found.source


def test_a_parent_cgroup_s_lower_limit_holds(tmp_path, monkeypatch):
    """A Kubernetes pod's limit sits on the pod's cgroup, above the container's own."""
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(8)))
    files = {
        "sys/fs/cgroup/kubepods/pod1/cpu.max": "100000 100000",
        "sys/fs/cgroup/kubepods/pod1/c1/cpu.max": "max 100000",
        "sys/fs/cgroup/kubepods/pod1/c1/memory.max": "max",
        "sys/fs/cgroup/kubepods/pod1/memory.max": str(3 * 2**30),
    }
    root = cgroup_tree(tmp_path, "0::/kubepods/pod1/c1\n", V2_MOUNT, files)
    assert core_count(root).cores == 1
    assert cgroups.memory_limit(root) == cgroups.Limit(
        3 * 2**30, Path("/sys/fs/cgroup/kubepods/pod1/memory.max")
    )


@pytest.mark.parametrize("container_lower", [False, True])
def test_of_a_pods_and_its_containers_limits_the_lower_holds(
    tmp_path, monkeypatch, container_lower
):
    """Both set (a pod of 1 CPU and 1 GiB, its container of 4 and 4 GiB, or the other way
    round): the lower is the one the kernel holds the server to."""
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(8)))
    low, high = ("c1", "") if container_lower else ("", "c1")
    pod = "sys/fs/cgroup/kubepods/pod1"
    files = {
        f"{pod}/{low}/cpu.max".replace("//", "/"): "100000 100000",
        f"{pod}/{high}/cpu.max".replace("//", "/"): "400000 100000",
        f"{pod}/{low}/memory.max".replace("//", "/"): str(2**30),
        f"{pod}/{high}/memory.max".replace("//", "/"): str(4 * 2**30),
    }
    root = cgroup_tree(tmp_path, "0::/kubepods/pod1/c1\n", V2_MOUNT, files)
    assert core_count(root).cores == 1
    held = "/sys/fs/cgroup/kubepods/pod1/" + ("c1/" if container_lower else "") + "memory.max"
    assert cgroups.memory_limit(root) == cgroups.Limit(2**30, Path(held))


@pytest.mark.parametrize(
    ("tree", "limit"),
    [
        (lambda root: v2_tree(root, "max 100000", str(4 * 2**30)), 4 * 2**30),
        (lambda root: v2_tree(root, "max 100000", "max"), None),
        (lambda root: v1_tree(root, "-1", str(2 * 2**30)), 2 * 2**30),
        (lambda root: v1_tree(root, "-1"), None),  # v1's "no limit": a huge number
        (lambda root: v2_tree(root, "max 100000", "not a number"), None),
    ],
    ids=["v2-4g", "v2-max", "v1-2g", "v1-none", "v2-garbled"],
)
def test_a_container_s_memory_limit_is_read(tmp_path, tree, limit):
    found = cgroups.memory_limit(tree(tmp_path))
    assert (found and found.value) == limit


def _garble(root: Path, file: str, text: bytes) -> Path:
    (root / file).write_bytes(text)
    return root


@pytest.mark.parametrize(
    "tree",
    [
        lambda root: v2_tree(root, "200000 0"),  # a period of 0
        lambda root: _garble(
            v1_tree(root, "200000"), "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_period_us", b"0"
        ),
    ],
    ids=["v2-period-0", "v1-period-0"],
)
def test_a_garbled_cpu_limit_counts_the_affinity(tmp_path, monkeypatch, tree):
    """A limit that cannot be a number of CPUs is none known: the server starts."""
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(64)))
    found = core_count(tree(tmp_path))
    assert (found.cores, found.source) == (64, AFFINITY)


def test_a_mount_point_not_in_utf8_leaves_the_limits_read(tmp_path, monkeypatch):
    """mountinfo lists every mount of the machine: one at a path in Latin-1 (a USB disk)
    is no cgroup's, and the limits are read as without it."""
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(64)))
    root = v2_tree(tmp_path, "200000 100000", str(2**30))
    other = b"40 23 0:1 / /media/d\xe9p\xf4t rw - ext4 /dev/sdb1 rw\n"
    _garble(root, "proc/self/mountinfo", V2_MOUNT.encode() + other)
    assert core_count(root).cores == 2
    assert cgroups.memory_limit(root) == cgroups.Limit(2**30, Path("/sys/fs/cgroup/memory.max"))
