"""deploy/kubernetes/*.yaml: valid against the Kubernetes schemas, and consistent with rawserve.

kubernetes-validate bundles the JSON schemas of every Kubernetes release, so this runs
offline. Strict schemas refuse unknown fields (a misspelt key is an error, not ignored).
"""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import kubernetes_validate
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from rawserve.fronts import FINAL_WRITE_SECONDS
from rawserve.ops.metrics import Metrics
from rawserve.options import OPTIONS
from rawserve.serving.core import SchedulerCore
from rawserve.serving.pool import EXIT_TIMEOUT

MANIFESTS = Path(__file__).resolve().parent.parent / "deploy" / "kubernetes"
# the oldest release still common in managed clusters, and the newest the validator knows
KUBERNETES_VERSIONS = ["1.29.0", kubernetes_validate.utils.latest_version()]


def documents() -> list[tuple[str, dict]]:
    found = []
    for path in sorted(MANIFESTS.glob("*.yaml")):
        for document in yaml.safe_load_all(path.read_text()):
            if document:
                found.append((path.name, document))
    return found


def only(kind: str) -> dict:
    [document] = [d for _, d in documents() if d["kind"] == kind]
    return document


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize(
    ("name", "document"), documents(), ids=[f"{n}:{d['kind']}" for n, d in documents()]
)
def test_every_manifest_is_valid(name, document, version):
    kubernetes_validate.validate(document, version, strict=True)


def test_there_is_a_deployment_a_service_an_autoscaler_and_adapter_rules():
    kinds = sorted(d["kind"] for _, d in documents())
    assert kinds == ["ConfigMap", "Deployment", "HorizontalPodAutoscaler", "Service"]


def container() -> dict:
    [rawserve] = only("Deployment")["spec"]["template"]["spec"]["containers"]
    return rawserve


def env() -> dict[str, str]:
    return {e["name"]: e.get("value") for e in container()["env"]}


def test_environment_variables_are_rawserve_options():
    known = {option.env for option in OPTIONS}
    given = {name for name in env() if name.startswith("RAWSERVE_")}
    assert given <= known, given - known


def test_probes_point_at_health_and_ready_on_the_served_port():
    rawserve = container()
    assert rawserve["livenessProbe"]["httpGet"]["path"] == "/health"
    assert rawserve["startupProbe"]["httpGet"]["path"] == "/health"
    # a full queue keeps the pod in its Service: a full /ready took every pod out at once
    assert rawserve["readinessProbe"]["httpGet"]["path"] == "/ready?full=ok"
    [port] = rawserve["ports"]
    assert str(port["containerPort"]) == env()["RAWSERVE_PORT"]
    assert env()["RAWSERVE_HOST"] == "0.0.0.0"  # reachable from outside the pod
    service = only("Service")["spec"]
    assert service["ports"][0]["targetPort"] == port["name"]
    assert service["selector"] == only("Deployment")["spec"]["selector"]["matchLabels"]


def test_termination_grace_covers_the_pre_stop_pause_and_the_drain():
    pod = only("Deployment")["spec"]["template"]["spec"]
    command = container()["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep"
    pause, grace = float(command[1]), float(env()["RAWSERVE_GRACE"])
    # After the grace period the last 503s are written while the workers stop (a busy
    # one killed at once, an idle one given EXIT_TIMEOUT); then some room to spare.
    stopping = max(FINAL_WRITE_SECONDS, EXIT_TIMEOUT)
    assert pod["terminationGracePeriodSeconds"] >= pause + grace + stopping + 10


def test_resources_are_requested_and_limited():
    resources = container()["resources"]
    assert {"cpu", "memory"} <= set(resources["requests"]) <= set(resources["limits"])


def test_the_autoscaler_scales_the_deployment_on_a_metric_rawserve_exports():
    hpa = only("HorizontalPodAutoscaler")["spec"]
    assert hpa["scaleTargetRef"]["name"] == only("Deployment")["metadata"]["name"]
    [metric] = hpa["metrics"]
    assert metric["type"] == "Pods"
    name = metric["pods"]["metric"]["name"]
    # the adapter publishes that name, from a series of the same name
    rules = yaml.safe_load(only("ConfigMap")["data"]["config.yaml"])["rules"]
    assert any(rule["name"]["as"] == name for rule in rules)
    assert any(re.match(rf"{name}\{{", rule["seriesQuery"]) for rule in rules)
    # and rawserve's /metrics has it
    metrics = Metrics()
    scheduler = SimpleNamespace(core=SchedulerCore(), in_flight=0)
    metrics.watch("m", scheduler, SimpleNamespace(status=list))
    exported = {f.name for f in text_string_to_metric_families(metrics.render()[0].decode())}
    assert name in exported


def init_container() -> dict:
    [fetch] = only("Deployment")["spec"]["template"]["spec"]["initContainers"]
    return fetch


def environment(of: dict) -> dict[str, str | None]:
    return {e["name"]: e.get("value") for e in of["env"]}


def test_an_init_container_fetches_the_hub_model_the_server_then_serves_offline():
    fetch, served = init_container(), container()
    assert fetch["image"] == served["image"]
    assert fetch["args"] == ["--download-only"]
    flags = {option.flag for option in OPTIONS}
    assert {arg for arg in fetch["args"] if arg.startswith("--")} <= flags
    assert environment(fetch)["RAWSERVE_MODEL"] == env()["RAWSERVE_MODEL"]
    assert "/" in env()["RAWSERVE_MODEL"]  # a Hub repo id, not a folder
    # what --download-only fetches is planned for the device, engine, precision and task
    # its options name: the server's own, or the cache lacks what the server reads
    planning = (
        "RAWSERVE_DEVICE",
        "RAWSERVE_ENGINE",
        "RAWSERVE_DTYPE",
        "RAWSERVE_TASK",
        "RAWSERVE_REVISION",
    )
    for name in planning:
        assert environment(fetch).get(name) == env().get(name), name
    assert env()["HF_HUB_OFFLINE"] == "1" and "HF_HUB_OFFLINE" not in environment(fetch)
    # both see the same cache, at HF_HOME
    assert environment(fetch)["HF_HOME"] == env()["HF_HOME"]
    mounts = {m["name"]: m["mountPath"] for m in fetch["volumeMounts"]}
    assert mounts == {m["name"]: m["mountPath"] for m in served["volumeMounts"]}
    [(volume, path)] = mounts.items()
    assert env()["HF_HOME"].startswith(path + "/")
    pod = only("Deployment")["spec"]["template"]["spec"]
    assert [v["name"] for v in pod["volumes"]] == [volume]


def test_the_pod_runs_as_the_images_non_root_user():
    dockerfile = (MANIFESTS.parent.parent / "Dockerfile").read_text()
    [user] = re.findall(r"^USER (\d+)$", dockerfile, re.MULTILINE)
    security = only("Deployment")["spec"]["template"]["spec"]["securityContext"]
    assert security["runAsNonRoot"] is True
    assert str(security["runAsUser"]) == str(security["fsGroup"]) == user
    for each in (container(), init_container()):
        assert each["securityContext"]["allowPrivilegeEscalation"] is False
