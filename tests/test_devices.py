"""Device lists and per-worker GPU isolation, without a GPU."""

from __future__ import annotations

import pytest

from rawserve.shared.devices import DevicePlan, isolate, parse_devices


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


def test_two_gpu_workers_never_share_a_visible_device():
    plans = [isolate(device) for device in parse_devices("cuda:0,cuda:1")]
    assert [plan.visible_gpus for plan in plans] == ["0", "1"]
    assert {plan.torch_device for plan in plans} == {"cuda:0"}
