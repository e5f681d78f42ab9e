"""`python -m rawserve --model org/name[@revision]`: a model named by its Hub id, served from
a Hub cache offline and from the loopback Hub stand-in, with its task, pooling and
normalization read from the resolved folder exactly as for a local folder.

The repo holds a tiny sentence-transformers model whose pooling is CLS (as the BGE family
is) on its main branch and mean on an older commit, so what the server reads from the
folder shows in /info and in the vectors themselves.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests.hub_cache import HubRepo, folder_files, write_hub_cache
from tests.hub_server import CDN_PREFIX, FakeHub
from tests.server import REPO_ROOT, RunningServer, running_together, sighup_at_default

pytestmark = pytest.mark.slow

REPO_ID = "org/tiny-bge"
CLS_POOLING = b'{"word_embedding_dimension": 32, "pooling_mode_cls_token": true}'


@pytest.fixture(scope="module")
def repo(tiny_model) -> HubRepo:
    """main: CLS pooling, normalized; the commit before it: mean pooling."""
    files = folder_files(Path(tiny_model("sentence-embedding")))
    repo = HubRepo(REPO_ID)
    repo.add_commit(files)  # mean pooling, as tiny_models writes it
    repo.add_commit({**files, "1_Pooling/config.json": CLS_POOLING}, refs=("main",))
    return repo


def mean_commit(repo: HubRepo) -> str:
    return next(commit for commit in repo.commits if commit != repo.main)


def hub_env(home: Path, **extra: str) -> dict[str, str]:
    """The Hub settings a user would export, and none of this machine's."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING"))}
    env.update(HF_HOME=str(home / "hf"), HF_HUB_CACHE=str(home / "hub"), **extra)
    return env


def serving(args: list[str], env: dict[str, str]) -> RunningServer:
    """A server with exactly `env` (RunningServer's own sets HF_HUB_OFFLINE=1)."""
    server = RunningServer([*args, "--threads", "1"])
    server.env = {**env, "PYTHONPATH": REPO_ROOT}
    return server


def embed(server: RunningServer, text: str) -> np.ndarray:
    status, answer = server.post_json({"inputs": text})
    assert status == 200, answer
    return np.asarray(answer, dtype=np.float32)


def info(server: RunningServer) -> dict:
    status, _, body = server.request("GET", "/info")
    assert status == 200
    return json.loads(body)


def test_a_hub_id_serves_from_the_cache_offline_as_its_folder_would(tmp_path, repo, tiny_model):
    write_hub_cache(tmp_path / "hub", repo)
    snapshot = tmp_path / "hub" / "models--org--tiny-bge" / "snapshots" / repo.main
    env = hub_env(tmp_path, HF_HUB_OFFLINE="1")
    both = {
        "id": serving(["--model", REPO_ID], env),
        "folder": serving(["--model", str(snapshot)], env),
    }
    with running_together(both):
        by_id, by_folder = both["id"], both["folder"]
        facts = info(by_id)
        assert facts["task"] == "feature-extraction"  # inferred, no --task
        assert (facts["pooling"], facts["normalize"]) == ("cls", True)
        assert (facts["model"], facts["revision"]) == (REPO_ID, repo.main)
        assert facts["model_sha"] == repo.main  # TEI's field: it was always null
        assert facts["names"] == [REPO_ID]
        vector = embed(by_id, "hello world")
        assert vector.shape == (32,) and np.linalg.norm(vector) == pytest.approx(1, abs=1e-5)
        np.testing.assert_array_equal(vector, embed(by_folder, "hello world"))
        # the OpenAI route uses the model's own pooling, not a forced mean
        status, answer = by_id.post_json(
            {"input": "hello world", "model": REPO_ID}, path="/v1/embeddings"
        )
        assert status == 200
        np.testing.assert_allclose(answer["data"][0]["embedding"], vector, atol=1e-6)
        models = json.loads(by_id.request("GET", "/v1/models")[2])["data"]
        assert [model["id"] for model in models] == [REPO_ID]


def test_a_pinned_commit_serves_that_commit(tmp_path, repo):
    write_hub_cache(tmp_path / "hub", repo)
    env = hub_env(tmp_path, HF_HUB_OFFLINE="1")
    old = mean_commit(repo)
    pinned = {
        "in the name": serving(["--model", f"{REPO_ID}@{old}"], env),
        "by --revision": serving(["--model", REPO_ID, "--revision", old], env),
    }
    with running_together(pinned):
        facts = info(pinned["in the name"])
        assert (facts["pooling"], facts["revision"]) == ("mean", old)
        assert info(pinned["by --revision"])["revision"] == old


def test_the_real_download_path_then_a_restart_with_the_hub_gone(tmp_path, repo):
    with FakeHub([repo]) as hub:
        env = hub_env(tmp_path, HF_ENDPOINT=hub.endpoint, HF_HUB_DISABLE_TELEMETRY="1")
        with serving(["--model", REPO_ID], env) as first:
            downloaded = embed(first, "the movie")
            assert info(first)["revision"] == repo.main
            progress = [line for line in first.lines if "downloading:" in line]
        assert hub.seen(prefix="/cdn/")  # the weights came through the download path
    assert progress  # the download logged its progress
    # the stand-in is gone: the cache serves, with HF_HUB_OFFLINE or without
    offline_or_not = {
        offline: serving(["--model", REPO_ID], {**env, "HF_HUB_OFFLINE": offline})
        for offline in ("1", "0")
    }
    with running_together(offline_or_not):
        for again in offline_or_not.values():
            np.testing.assert_array_equal(embed(again, "the movie"), downloaded)


def test_download_only_fills_the_cache_and_exits(tmp_path, repo):
    with FakeHub([repo]) as hub:
        env = hub_env(tmp_path, HF_ENDPOINT=hub.endpoint, PYTHONPATH=REPO_ROOT)
        result = subprocess.run(
            [sys.executable, "-m", "rawserve", "--model", REPO_ID, "--download-only"],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            stdin=subprocess.DEVNULL,
        )
    assert result.returncode == 0, result.stderr
    snapshot = tmp_path / "hub" / "models--org--tiny-bge" / "snapshots" / repo.main
    assert (snapshot / "model.safetensors").is_file()
    assert "listening" not in result.stderr  # nothing was served


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_a_stop_during_a_download_exits_at_once_saying_so(tmp_path, repo, stop):
    """huggingface_hub downloads on threads of its own: the exit waited for the file under
    way (a model's weights: minutes, past a container's grace), then said nothing."""
    with FakeHub([repo], trickle=0.5) as hub:  # the weights (88 KiB) would take 44 s
        env = hub_env(tmp_path, HF_ENDPOINT=hub.endpoint, PYTHONPATH=REPO_ROOT)
        process = subprocess.Popen(
            [sys.executable, "-m", "rawserve", "--port", "0", "--model", REPO_ID],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            stdin=subprocess.DEVNULL,
            preexec_fn=sighup_at_default,  # a terminal's SIGHUP: under nohup it stays ignored
        )
        try:
            deadline = time.monotonic() + 60
            while not any(seen.path.startswith(CDN_PREFIX) for seen in hub.requests):
                assert time.monotonic() < deadline, "the weights were never asked for"
                time.sleep(0.05)
            process.send_signal(stop)
            _, stderr = process.communicate(timeout=30)
        finally:
            process.kill()
    assert process.returncode == 1, stderr
    assert f"{stop.name} received while the models were being found: stopped" in stderr


def run_to_exit(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """Run the server until it exits by itself (a model it cannot serve)."""
    return subprocess.run(
        [sys.executable, "-m", "rawserve", "--port", "0", *args],
        env={**env, "PYTHONPATH": REPO_ROOT},
        capture_output=True,
        text=True,
        timeout=180,
        stdin=subprocess.DEVNULL,
    )


def start_failing(args: list[str], env: dict[str, str]) -> str:
    """Run the server with a model it cannot have: exit code 1 and one error line."""
    result = run_to_exit(args, env)
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if " ERROR " in line]
    assert len(errors) == 1, result.stderr
    assert "listening" not in result.stderr  # refused before anything listened
    return errors[0]


@pytest.mark.parametrize(
    ("model", "says"),
    [
        ("org/absent", r"no Hub repo org/absent"),
        (f"{REPO_ID}@v9", r"org/tiny-bge has no revision 'v9'"),
        ("org/gated", r"org/gated is gated: .* set HF_TOKEN"),
        ("not a repo!", r"neither an existing folder nor a Hub repo id"),
        ("org/tf-only", r"model org/tf-only: the model has no PyTorch weights"),
    ],
)
def test_a_model_the_hub_refuses_is_one_clear_line(tmp_path, repo, model, says):
    gated = HubRepo("org/gated", commits=repo.commits, refs=repo.refs, gated=True)
    files = {**repo.commits[repo.main], "tf_model.h5": b"TensorFlow's weights"}
    del files["model.safetensors"]
    tf_only = HubRepo("org/tf-only")
    tf_only.add_commit(files, refs=("main",))
    with FakeHub([repo, gated, tf_only]) as hub:
        line = start_failing(["--model", model], hub_env(tmp_path, HF_ENDPOINT=hub.endpoint))
    assert re.search(says, line), line


def test_offline_with_nothing_cached_is_one_clear_line(tmp_path):
    line = start_failing(["--model", REPO_ID], hub_env(tmp_path, HF_HUB_OFFLINE="1"))
    assert "org/tiny-bge is not in the Hub cache" in line and "HF_HUB_OFFLINE=1" in line


def test_a_folder_whose_task_is_unknown_is_one_clear_line(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text('{"architectures": ["SomethingNew"]}')
    line = start_failing(["--model", str(tmp_path / "model")], hub_env(tmp_path))
    assert "no task is known for the model's architecture" in line and "--task" in line


def test_a_repo_uploaded_without_its_tokenizer_stops_the_server_with_one_line(tmp_path, repo):
    """Not served with a tokenizer of special tokens alone (every text the same answer),
    and refused before any worker loads it, not with transformers' advice to install
    sentencepiece."""
    files = {k: v for k, v in repo.commits[repo.main].items() if not k.startswith("tokenizer")}
    files = {k: v for k, v in files.items() if not k.startswith("vocab")}
    untokenized = HubRepo("org/untokenized")
    untokenized.add_commit(files, refs=("main",))
    with FakeHub([untokenized]) as hub:
        args = ["--model", "org/untokenized", "--no-warmup", "--engine", "torch", "--device", "cpu"]
        line = start_failing(args, hub_env(tmp_path, HF_ENDPOINT=hub.endpoint))
    assert " ERROR model org/untokenized: the model has no tokenizer files (" in line
