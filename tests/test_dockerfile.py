"""The Dockerfile, checked without a Docker daemon (none is available where tests run).

It is parsed by the BuildKit parser itself (the `dockerfile` package) and linted by
hadolint; its install is the Makefile's own recipe, shown here by a dry run of make with
the image's build arguments; its health check is run against a real server.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import dockerfile
import pytest
import yaml

from rawserve.ops.health_probe import DEFAULT_PORT
from rawserve.options import OPTIONS, parse_config
from tests.server import REPO_ROOT, RunningServer

try:
    import tomllib
except ImportError:  # Python 3.10: huggingface_hub installs tomli there
    import tomli as tomllib

ROOT = Path(REPO_ROOT)
DOCKERFILE = ROOT / "Dockerfile"
COMMANDS = dockerfile.parse_file(str(DOCKERFILE))
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def instructions(name: str) -> list[dockerfile.Command]:
    return [command for command in COMMANDS if command.cmd == name]


def build_args() -> dict[str, str]:
    """Each ARG's default (the values a plain `docker build .` uses)."""
    found = {}
    for command in instructions("ARG"):
        name, _, default = command.value[0].partition("=")
        found[name] = default
    return found


def environment() -> dict[str, str]:
    found = {}
    for command in instructions("ENV"):
        values = command.value
        found.update(zip(values[::2], values[1::2], strict=True))
    return found


def expand(text: str) -> str:
    """`${NAME}` replaced by the build argument's default, as docker build does."""
    values = build_args()
    return re.sub(r"\$\{(\w+)\}", lambda m: values[m.group(1)], text)


def install_runs() -> list[str]:
    return [expand(c.value[0]) for c in instructions("RUN") if shlex.split(c.value[0])[0] == "make"]


def makefile_default(name: str) -> str:
    match = re.search(rf"^{name} \?= ?(.*)$", (ROOT / "Makefile").read_text(), re.MULTILINE)
    assert match, name
    return match.group(1).strip()


def test_hadolint_finds_nothing_to_fix():
    hadolint = Path(sys.executable).parent / "hadolint"
    result = subprocess.run(
        [str(hadolint), "--no-color", str(DOCKERFILE)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_it_installs_with_the_makefile_and_nothing_else():
    [install] = install_runs()
    words = shlex.split(install)
    assert words[:2] == ["make", ".venv/.installed"]  # the Makefile's install stamp
    # nothing is installed by hand beside it: no pip, no second package manager step
    for command in instructions("RUN"):
        assert "pip install" not in command.value[0]
        assert "pip3 install" not in command.value[0]
    # the torch the image pins is the Makefile's
    assert build_args()["TORCH_SPEC"] == makefile_default("TORCH_SPEC")


def test_a_dry_run_of_the_install_is_the_pinned_cpu_torch_then_rawserve(tmp_path):
    [install] = install_runs()
    assignments = [word for word in shlex.split(install)[2:] if "=" in word]
    result = subprocess.run(
        ["make", "-n", "-W", "pyproject.toml", ".venv/.installed", *assignments],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    pip_lines = [line for line in result.stdout.splitlines() if "pip install" in line]
    assert len(pip_lines) == 2, result.stdout
    torch_line, rawserve_line = pip_lines
    assert "--index-url=https://download.pytorch.org/whl/cpu" in torch_line
    assert '"torch==2.13.0"' in torch_line
    extras = re.search(r'-e "\.\[(.*)\]"', rawserve_line)
    assert extras and set(extras.group(1).split(",")) <= set(
        PYPROJECT["project"]["optional-dependencies"]
    )


def image_extras() -> set[str]:
    [install] = install_runs()
    [extras] = [w.partition("=")[2] for w in shlex.split(install) if w.startswith("EXTRAS=")]
    return set(extras.split(","))


def test_the_image_has_the_extras_of_make_serve_but_test_and_dev():
    """With `EXTRAS=image` alone the image had no ONNX Runtime: `--engine auto` served
    torch always and `--engine onnx` exited 2, where `make serve` had both."""
    served = set(makefile_default("EXTRAS").split(",")) - {"test", "dev"}
    assert "onnx" in served
    # image: Pillow, which the Makefile's install gets through the test extra
    assert image_extras() == served | {"image"}


def test_a_cuda_build_is_one_build_argument():
    assert build_args()["TORCH_VARIANT"] == "cpu"
    assert any("whl/${TORCH_VARIANT}" in c.value[0] for c in instructions("RUN"))


def test_it_runs_as_a_user_that_is_not_root():
    [user] = instructions("USER")
    uid = user.value[0]
    assert uid.isdigit() and int(uid) != 0  # numeric: Kubernetes' runAsNonRoot can check it
    assert any(f"--uid {uid}" in c.value[0] for c in instructions("RUN"))
    # every build step runs before it, the server after it
    assert all(c.start_line < user.start_line for c in instructions("RUN"))
    [entrypoint] = instructions("ENTRYPOINT")
    assert entrypoint.start_line > user.start_line


def test_the_entry_point_is_python_m_rawserve_from_the_installed_environment():
    [entrypoint] = instructions("ENTRYPOINT")
    assert entrypoint.json  # exec form: signals reach the server, which drains on SIGTERM
    [workdir] = instructions("WORKDIR")
    assert list(entrypoint.value) == [f"{workdir.value[0]}/.venv/bin/python", "-m", "rawserve"]


def test_the_port_is_exposed_and_served_on_all_interfaces():
    env = environment()
    [expose] = instructions("EXPOSE")
    assert expose.value == (str(DEFAULT_PORT),)  # --port's default: the image sets none
    assert env["RAWSERVE_HOST"] == "0.0.0.0"
    known = {option.env for option in OPTIONS} | {"RAWSERVE_CACHE_DIR"}  # the trials' cache
    assert {name for name in env if name.startswith("RAWSERVE_")} <= known
    # the Kubernetes manifest serves the image on the port it exposes
    deployment = yaml.safe_load((ROOT / "deploy" / "kubernetes" / "deployment.yaml").read_text())
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    [port] = [
        variable["value"] for variable in container["env"] if variable["name"] == "RAWSERVE_PORT"
    ]
    assert [p["containerPort"] for p in container["ports"]] == [DEFAULT_PORT] == [int(port)]


def test_the_image_run_as_sagemaker_s_serve_listens_on_sagemaker_s_port(monkeypatch):
    """`docker run IMAGE serve` serves on 8080 (or SAGEMAKER_BIND_TO_PORT's), where
    SageMaker calls it, and the health check asks there: the image's own RAWSERVE_PORT
    won over SageMaker's port, and it served on 8000, reported healthy."""
    from rawserve.ops.health_probe import health_url

    monkeypatch.delenv("RAWSERVE_PORT", raising=False)
    monkeypatch.delenv("SAGEMAKER_BIND_TO_PORT", raising=False)
    for name, value in environment().items():
        monkeypatch.setenv(name, value)
    assert parse_config(["serve"]).port == 8080
    assert health_url(["serve"]) == "http://127.0.0.1:8080/health"
    monkeypatch.setenv("SAGEMAKER_BIND_TO_PORT", "8081")
    assert parse_config(["serve"]).port == 8081
    assert health_url(["serve"]) == "http://127.0.0.1:8081/health"
    assert parse_config([]).port == DEFAULT_PORT  # not as SageMaker's: --port's default


def test_the_model_cache_is_a_volume_owned_by_the_user():
    env = environment()
    [volume] = instructions("VOLUME")
    assert volume.json
    [cache] = volume.value
    assert env["HF_HOME"].startswith(cache + "/")  # Hub downloads land in the volume
    [user] = instructions("USER")
    assert any(
        f"chown -R {user.value[0]}:" in c.value[0] and cache in c.value[0]
        for c in instructions("RUN")
    )


def test_the_trial_verdicts_and_onnx_exports_are_kept_in_the_volume():
    """A first start's trials and ONNX export (tens of seconds) are what a restart skips:
    kept in the container's home, a new container (an upgrade, a rescheduled pod) made
    them all again at every start. The image installs ONNX Runtime (the onnx extra), so
    there are exports to keep."""
    [volume] = instructions("VOLUME")
    [cache] = volume.value
    assert environment()["RAWSERVE_CACHE_DIR"].startswith(cache + "/")
    assert "onnx" in image_extras()


def test_every_copied_file_exists_and_is_in_the_build_context():
    ignored = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    for command in instructions("COPY"):
        *sources, _ = command.value
        for source in sources:
            assert (ROOT / source).exists(), source
            assert not any(source == i or source.startswith(i + "/") for i in ignored), source
    assert {".git", ".venv"} <= set(ignored)


def test_the_python_version_is_one_rawserve_supports():
    version = build_args()["PYTHON_VERSION"]
    floor = PYPROJECT["project"]["requires-python"].removeprefix(">=")
    as_tuple = lambda text: tuple(int(part) for part in text.split("."))  # noqa: E731
    assert as_tuple(version) >= as_tuple(floor)
    [base] = instructions("FROM")
    assert base.value[0] == "python:${PYTHON_VERSION}-slim"


# Where the Hub is reached through a proxy, the container has these: the check went
# through the proxy (here a port where nothing listens) and failed on a healthy server.
# (NO_PROXY empty: one that named 127.0.0.1 here would hide it.)
PROXIES = {
    **dict.fromkeys(
        ("HTTP_PROXY", "http_proxy", "HTTPS_PROXY", "https_proxy"), "http://127.0.0.1:9"
    ),
    **dict.fromkeys(("NO_PROXY", "no_proxy"), ""),
}


@pytest.mark.slow
def test_the_health_check_passes_on_a_serving_server_and_fails_without_one():
    [check] = instructions("HEALTHCHECK")
    assert check.json and check.value[0] == "CMD"
    words = list(check.value[1:])
    assert words[1:] == ["-m", "rawserve.ops.health_probe"]
    assert words[0].endswith("/.venv/bin/python")
    words[0] = sys.executable  # the image's python is this environment's, here
    with RunningServer(["--handler", "tests.handlers:echo"]) as server:
        env = {**os.environ, **PROXIES, "RAWSERVE_PORT": str(server.port)}
        checked = subprocess.run(words, env=env, capture_output=True, text=True)
        assert checked.returncode == 0, checked.stderr
    env = {**os.environ, "RAWSERVE_PORT": str(server.port)}  # nothing listens there now
    assert subprocess.run(words, env=env, capture_output=True).returncode != 0


@pytest.mark.slow
def test_the_health_check_asks_a_tls_server_in_tls(tmp_path):
    """Over plain HTTP, a server given RAWSERVE_SSL_CERTFILE closed the check's connection
    at once: the container was unhealthy for as long as it served."""
    import trustme

    key_and_certificate = tmp_path / "server.pem"
    trustme.CA().issue_cert("127.0.0.1").private_key_and_cert_chain_pem.write_to_path(
        str(key_and_certificate)
    )
    [check] = instructions("HEALTHCHECK")
    words = [sys.executable, *check.value[2:]]
    server = RunningServer(["--handler", "tests.handlers:echo"])
    server.env["RAWSERVE_SSL_CERTFILE"] = str(key_and_certificate)
    with server:
        env = {**server.env, **PROXIES, "RAWSERVE_PORT": str(server.port)}
        checked = subprocess.run(words, env=env, capture_output=True, text=True)
        assert checked.returncode == 0, checked.stderr


@pytest.mark.parametrize(
    ("cmdline", "arguments"),
    [
        (b"/app/.venv/bin/python\0-m\0rawserve\0serve\0", ["serve"]),
        (b"/app/.venv/bin/rawserve\0--port\0009000\0", ["--port", "9000"]),
        (b"python3\0-c\0pass\0", []),  # not the server: nothing read
    ],
)
def test_the_health_check_reads_the_servers_command_line(tmp_path, cmdline, arguments):
    from rawserve.ops.health_probe import server_arguments

    (tmp_path / "cmdline").write_bytes(cmdline)
    assert server_arguments(str(tmp_path / "cmdline")) == arguments
    assert server_arguments(str(tmp_path / "none")) == []


@pytest.mark.parametrize(
    ("arguments", "env", "url"),
    [
        ([], {}, "http://127.0.0.1:8000/health"),
        ([], {"RAWSERVE_PORT": ""}, "http://127.0.0.1:8000/health"),  # (it asked port 80)
        ([], {"RAWSERVE_PORT": "9100"}, "http://127.0.0.1:9100/health"),
        (["--port", "9200"], {"RAWSERVE_PORT": "9100"}, "http://127.0.0.1:9200/health"),
        (["--port=9300", "--port", "9301"], {}, "http://127.0.0.1:9301/health"),
        (["serve"], {}, "http://127.0.0.1:8080/health"),  # SageMaker's (8000 was asked)
        (["serve"], {"SAGEMAKER_BIND_TO_PORT": "7000"}, "http://127.0.0.1:7000/health"),
        (["--ssl-certfile", "/c.pem"], {}, "https://127.0.0.1:8000/health"),
        ([], {"RAWSERVE_SSL_CERTFILE": "/c.pem"}, "https://127.0.0.1:8000/health"),
        # one address bound: that one (127.0.0.1 was refused there)
        (["--host", "127.0.0.2"], {}, "http://127.0.0.2:8000/health"),
        (["--host", "::1"], {}, "http://[::1]:8000/health"),
        ([], {"RAWSERVE_HOST": "0.0.0.0"}, "http://127.0.0.1:8000/health"),
    ],
)
def test_the_health_check_asks_the_port_and_scheme_the_server_was_started_with(
    monkeypatch, arguments, env, url
):
    from rawserve.ops.health_probe import health_url

    for name in (
        "RAWSERVE_PORT",
        "RAWSERVE_SSL_CERTFILE",
        "SAGEMAKER_BIND_TO_PORT",
        "RAWSERVE_HOST",
    ):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert health_url(arguments) == url
