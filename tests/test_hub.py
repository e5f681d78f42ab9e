"""Naming a model and resolving it: folders, a Hub cache offline, and the real download
path of huggingface_hub against a loopback stand-in for the Hub (`tests/hub_server.py`).

huggingface_hub reads HF_ENDPOINT, HF_HUB_CACHE, HF_HUB_OFFLINE and HF_TOKEN once, when
it is imported, so each resolution runs in a fresh process with the environment a user
would set, exactly as the server does it.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
import socket
import subprocess
import sys
import threading
import time
import types
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib.machinery import ModuleSpec
from pathlib import Path

import httpx2
import pytest

from rawserve.models.hub import (
    NOT_NEEDED,
    PICKLED_WEIGHTS,
    ModelNotFound,
    explain,
    fetched,
    files_to_skip,
    resolve_model,
)
from rawserve.models.hub_integrity import forget, hashes_to_its_name
from rawserve.models.names import ModelNameError, ModelSpec, default_names, parse_model_spec
from rawserve.models.plan import plan_models
from rawserve.models.sentence_folder import sentence_transformers_default_prompt
from tests.hub_cache import HubRepo, write_hub_cache
from tests.hub_server import FakeHub
from tests.server import REPO_ROOT

# a stand-in that importlib finds as sentencepiece, installed or not here
SENTENCEPIECE_INSTALLED = types.ModuleType("sentencepiece")
SENTENCEPIECE_INSTALLED.__spec__ = ModuleSpec("sentencepiece", None)

RESOLVE = """
import logging, sys
from rawserve.models.hub import ModelNotFound, resolve_model
from rawserve.models.names import ModelNameError, parse_model_spec
logging.basicConfig(level=logging.INFO, format="%(name)s %(message)s")
logging.getLogger("httpx2").setLevel(logging.WARNING)
try:
    print(resolve_model(parse_model_spec(sys.argv[1])).folder)
except (ModelNameError, ModelNotFound) as exc:
    print(f"error: {exc}", file=sys.stderr)
    sys.exit(1)
"""

PLAN = """
import logging, sys
from rawserve.models.hub import ModelNotFound
from rawserve.models.plan import plan_models
logging.basicConfig(level=logging.INFO, format="%(name)s %(message)s")
logging.getLogger("httpx2").setLevel(logging.WARNING)
try:
    print(plan_models([sys.argv[1]], onnx_graphs=sys.argv[2] == "onnx")[0].folder)
except ModelNotFound as exc:
    print(f"error: {exc}", file=sys.stderr)
    sys.exit(1)
"""

PLAN_ALL = """
import logging, sys
from rawserve.models.hub import ModelNotFound
from rawserve.models.plan import plan_models
logging.basicConfig(level=logging.INFO, format="%(name)s %(message)s")
logging.getLogger("httpx2").setLevel(logging.WARNING)
try:
    for plan in plan_models(sys.argv[1:]):
        print(plan.folder)
except ModelNotFound as exc:
    print(f"error: {exc}", file=sys.stderr)
    sys.exit(1)
"""

FILES = {
    "config.json": b'{"architectures": ["BertModel"], "hidden_size": 32}',
    "modules.json": b'[{"idx": 0, "path": "", "type": "sentence_transformers.models.Transformer"}]',
    "1_Pooling/config.json": b'{"pooling_mode_cls_token": true}',
    "tokenizer.json": b"{}",
    "model.safetensors": os.urandom(300_000),
    "pytorch_model.bin": os.urandom(1000),  # the same weights, pickled: not downloaded
    "tf_model.h5": os.urandom(1000),
    "onnx/model.onnx": os.urandom(1000),
}
NEEDED = {"config.json", "modules.json", "1_Pooling/config.json", "tokenizer.json"}
NEEDED |= {"model.safetensors"}


def make_repo(repo_id: str = "org/tiny", **kwargs) -> HubRepo:
    repo = HubRepo(repo_id, **kwargs)
    repo.add_commit(FILES, refs=("main",))
    return repo


def run_resolve(
    spec: str, home: Path, timeout: float = 120, script: str = RESOLVE, engine: str = "", **env: str
) -> subprocess.CompletedProcess[str]:
    """`script` (RESOLVE, or PLAN with `engine`) run on `spec` as the server would."""
    return run_script([script, spec, engine], home, timeout, **env)


def run_plan(
    models: list[str], home: Path, timeout: float = 120, **env: str
) -> subprocess.CompletedProcess[str]:
    """The plans of `models`, in one start as the server makes them (PLAN_ALL)."""
    return run_script([PLAN_ALL, *models], home, timeout, **env)


def run_script(
    args: list[str], home: Path, timeout: float, **env: str
) -> subprocess.CompletedProcess[str]:
    environ = {
        k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING", "TRANSFORMERS"))
    }
    environ.update(
        PYTHONPATH=REPO_ROOT,
        HF_HOME=str(home / "hf"),  # no token file, no stray cache of this machine
        HF_HUB_CACHE=str(home / "hub"),
        HF_HUB_DISABLE_TELEMETRY="1",
        **env,
    )
    return subprocess.run(
        [sys.executable, "-c", *args],
        env=environ,
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


def resolved(result: subprocess.CompletedProcess[str]) -> Path:
    assert result.returncode == 0, result.stderr
    return Path(result.stdout.strip())


def one_error_line(result: subprocess.CompletedProcess[str]) -> str:
    """The failure is one line of the resolver's own, never a traceback."""
    assert result.returncode == 1, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, result.stderr
    return errors[0]


def files_in(folder: Path) -> set[str]:
    return {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}


# --- the spelling ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "spec"),
    [
        ("org/name", ModelSpec("org/name")),
        ("gpt2", ModelSpec("gpt2")),
        ("org/name@main", ModelSpec("org/name", revision="main")),
        ("org/name@refs/pr/1", ModelSpec("org/name", revision="refs/pr/1")),
        ("org/name@v1.0:fill-mask", ModelSpec("org/name", "v1.0", task="fill-mask")),
        ("emb=org/name@abc123", ModelSpec("org/name", "abc123", alias="emb")),
        ("emb=/models/bge", ModelSpec("/models/bge", alias="emb")),
        (
            "cls=/models/sst2:text-classification",
            ModelSpec("/models/sst2", alias="cls", task="text-classification"),
        ),
        ("./model@v1", ModelSpec("./model@v1")),  # a folder has no revision: '@' is a name
        ("/models/a=b", ModelSpec("/models/a=b")),  # '=' after a '/' is not an alias
        ("  org/name  ", ModelSpec("org/name")),
    ],
)
def test_a_model_name_reads_as_documented(text, spec):
    assert parse_model_spec(text) == spec


def test_an_existing_folder_is_taken_as_it_is(tmp_path):
    folder = tmp_path / "odd=name@v1:fill-mask"
    folder.mkdir()
    assert parse_model_spec(str(folder)) == ModelSpec(str(folder))
    assert parse_model_spec(f"x={folder}") == ModelSpec(str(folder), alias="x")


def test_a_folder_with_a_colon_in_its_name_takes_a_task_after_it(tmp_path):
    """A checkpoint folder such as `run:v2` with `:TASK` after it: the task is what
    follows the last colon."""
    folder = tmp_path / "run:v2"
    folder.mkdir()
    spelt = parse_model_spec(f"cls={folder}:text-classification")
    assert spelt == ModelSpec(str(folder), alias="cls", task="text-classification")


@pytest.mark.parametrize(
    "text",
    ["", "   ", "emb=", "my model=org/name", "org/name@", "org/name:Not A Task", "=org/name", ":x"],
)
def test_a_malformed_model_name_is_refused_with_a_reason(text):
    with pytest.raises(ModelNameError) as caught:
        parse_model_spec(text)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("https://huggingface.co/org/st", "name the Hub repo as 'org/st'"),
        ("emb=http://hf.co/org/st/tree/main:feature-extraction", "as 'org/st@main'"),
        ("https://huggingface.co/org/st/tree/v1.0", "as 'org/st@v1.0'"),  # its revision kept
        ("HTTPS://huggingface.co/org/st/?library=transformers", "as 'org/st'"),
        ("https://hf.co/gpt2", "name the Hub repo as 'gpt2'"),
        ("https://huggingface.co/datasets/org/data", "name a Hub repo as 'org/name'"),
        ("https://mirror.example/org/st", "name a Hub repo as 'org/name' (HF_ENDPOINT"),
        ("s3://bucket/model", "name a Hub repo as 'org/name'"),
    ],
)
def test_a_url_is_refused_as_no_model_id_saying_which_to_give(text, says):
    """A repo's page copied whole read "'//huggingface.co/org/st' (after ':') is not a
    task name"."""
    with pytest.raises(ModelNameError, match="a URL is not a model id: name ") as caught:
        parse_model_spec(text)
    assert says in str(caught.value) and "task" not in str(caught.value)


@pytest.mark.parametrize(
    ("text", "names"),
    [
        ("org/name@v1", ("org/name",)),
        ("emb=org/name", ("emb", "org/name")),
        ("/models/bge/", ("bge",)),
        ("cls=/models/sst2:text-classification", ("cls", "sst2")),
        ("/models/modèle", ("modèle",)),
        # a command line read in an ASCII locale (LC_ALL=C PYTHONUTF8=0): the bytes of è
        # as surrogates, which a JSON answer could not carry (/v1/models and /info: 500)
        ("/models/mod\udcc3\udca8le", ("modèle",)),
        ("/models/mod\udce8le", ("mod\ufffdle",)),  # Latin-1 bytes: not UTF-8
    ],
)
def test_clients_call_a_model_by_its_alias_then_its_repo_id_or_folder_name(text, names):
    assert default_names(parse_model_spec(text)) == names


@pytest.mark.parametrize(("given", "folder"), [(".", "model"), ("./", "model"), ("..", "models")])
def test_a_folder_given_as_dots_is_called_by_the_folder_it_is(given, folder, tmp_path, monkeypatch):
    """`--model .` in the model's folder was served as ".": `/models/.` is no path a
    client keeps (they drop dot segments), and answers said `"model": "."`."""
    (tmp_path / "models" / "model").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "models" / "model")
    assert default_names(parse_model_spec(given)) == (folder,)
    assert default_names(parse_model_spec(f"alias={given}")) == ("alias", folder)


def test_defaults_fill_only_what_a_name_leaves_open():
    given = parse_model_spec("org/name@v2:fill-mask").with_defaults(task="x", revision="v1")
    assert (given.revision, given.task) == ("v2", "fill-mask")
    left = parse_model_spec("org/name").with_defaults(task="fill-mask", revision="v1")
    assert (left.revision, left.task) == ("v1", "fill-mask")
    folder = parse_model_spec("/models/bge").with_defaults(task=None, revision="v1")
    assert folder.revision is None  # a folder has no revisions


@pytest.mark.parametrize(
    "models",
    [
        [],  # the packaged model: a folder
        ["/models/bge"],
        ["org/name@v2"],  # names its own
        ["/models/bge", "emb=org/name@main"],
    ],
)
def test_a_revision_no_model_takes_is_refused_not_ignored(models):
    """`--revision v1` beside folders only (or the packaged model) was silently unused:
    the server served what it had, as though pinned. Refused before anything resolves."""
    with pytest.raises(ModelNotFound) as caught:
        plan_models(models, revision="v1")
    assert str(caught.value) == (
        "--revision 'v1' applies to Hub repos named without @REVISION, and no --model names one"
    )


def test_a_chat_template_no_model_reads_is_refused_not_ignored(tmp_path):
    """--chat-template beside an embedding model alone was silently unused (and never
    checked: a template that is not Jinja passed too)."""
    for kind, architecture in (("encoder", "BertModel"), ("gpt2", "GPT2LMHeadModel")):
        (tmp_path / kind).mkdir()
        for name in ("config.json", "tokenizer.json", "model.safetensors"):
            (tmp_path / kind / name).write_text(f'{{"architectures": ["{architecture}"]}}')
    both = [str(tmp_path / "encoder"), str(tmp_path / "gpt2")]
    assert len(plan_models(both, chat_template=True)) == 2
    with pytest.raises(ModelNotFound) as caught:
        plan_models(both[:1], chat_template=True)
    assert str(caught.value) == (
        "--chat-template applies to text-generation models, and none is served"
    )


def test_a_task_no_model_takes_is_refused_not_ignored(tmp_path):
    """Every model names its own task: `--task` was silently unused."""
    for name in ("config.json", "tokenizer.json", "model.safetensors"):
        (tmp_path / name).write_text('{"architectures": ["BertModel"]}')
    named = [f"a={tmp_path}:fill-mask", f"b={tmp_path}:ner"]
    assert [plan.facts.task for plan in plan_models(named)] == ["fill-mask", "token-classification"]
    with pytest.raises(ModelNotFound) as caught:
        plan_models(named, task="text-classification")
    assert str(caught.value) == (
        "--task 'text-classification' applies to the models named without :TASK, "
        "and no --model is one"
    )


def test_a_task_applies_to_the_models_named_without_one(tmp_path):
    """`--task` beside a model that names its own applies to the others, not refused."""
    for name in ("config.json", "tokenizer.json", "model.safetensors"):
        (tmp_path / name).write_text('{"architectures": ["BertModel"]}')
    named = [f"a={tmp_path}:fill-mask", f"b={tmp_path}"]
    plans = plan_models(named, task="text-classification")
    assert [plan.facts.task for plan in plans] == ["fill-mask", "text-classification"]


def test_a_folder_name_two_models_share_calls_neither(tmp_path):
    """Two folders of one name, each given an alias: a request by that name could mean
    either, so each answers to its alias alone (the one name it keeps)."""
    folders = [tmp_path / "a" / "model", tmp_path / "b" / "model", tmp_path / "c" / "other"]
    for folder in folders:
        folder.mkdir(parents=True)
        for name in ("config.json", "tokenizer.json", "model.safetensors"):
            (folder / name).write_text('{"architectures": ["BertModel"]}')
    named = [f"first={folders[0]}", f"second={folders[1]}", f"third={folders[2]}"]
    assert [plan.names for plan in plan_models(named)] == [
        ("first",),
        ("second",),
        ("third", "other"),  # a name of its own: kept
    ]


def test_safetensors_make_the_pickled_weights_unneeded():
    assert files_to_skip(["model.safetensors", "pytorch_model.bin"]) == NOT_NEEDED + PICKLED_WEIGHTS
    assert files_to_skip(["pytorch_model.bin"]) == NOT_NEEDED
    assert files_to_skip(None) == NOT_NEEDED
    shards = ["model.safetensors.index.json", "model-00001-of-00002.safetensors"]
    assert files_to_skip([*shards, "pytorch_model.bin"]) == NOT_NEEDED + PICKLED_WEIGHTS


def test_a_download_of_many_files_logs_a_line_every_few_seconds_and_one_at_its_end(caplog):
    """huggingface_hub grows the files bar's total and refreshes it after each file, past
    tqdm's own interval: 3,000 small files made 3,011 lines."""
    from rawserve.models.hub import LoggedProgress

    caplog.set_level(logging.INFO, logger="rawserve")
    bar = LoggedProgress(total=1, desc="Fetching 1 files")
    for _ in range(3000):
        bar.total += 1
        bar.update(1)
        bar.refresh()
    bar.close()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("downloading")]
    assert 1 <= len(lines) <= 3, lines
    assert lines[-1] == "downloading: 3000 of 3001 files"


@pytest.mark.parametrize("weights", ["model.safetensors", "pytorch_model.bin"])
def test_what_a_training_run_leaves_beside_the_model_is_not_fetched(weights):
    """A checkpoint's weights and optimizer state (twice the model), the run's logs and
    settings were downloaded with the model."""
    leftovers = [
        "checkpoint-500/model.safetensors",
        "checkpoint-500/pytorch_model.bin",
        "checkpoint-500/optimizer.pt",
        "checkpoint-500/rng_state.pth",
        "checkpoints/checkpoint-500/model.safetensors",
        "last.ckpt",
        "epoch=2-step=300.ckpt",
        "global_step500/mp_rank_00_model_states.pt",
        "runs/Jan01_00-00-00/events.out.tfevents.1.host",
        "optimizer.pt",
        "scheduler.pt",
        "rng_state_0.pth",
        "training_args.bin",
    ]
    model = ["config.json", "tokenizer.json", weights, "1_Pooling/config.json"]
    assert fetched([*model, *leftovers]) == model


def test_a_dense_module_s_only_weights_are_fetched_beside_the_model_s_safetensors():
    """LaBSE's repo: the model's weights in both forms, its Dense module's in
    pytorch_model.bin alone; that .bin is needed, the others are not. The Dense folders
    are those modules.json names (stella's 2_Dense_1024, say), whatever their names."""
    files = [
        "config.json",
        "model.safetensors",
        "pytorch_model.bin",
        "training_args.bin",
        "modules.json",
        "1_Pooling/config.json",
        "2_Dense/config.json",
        "2_Dense/pytorch_model.bin",
        "3_Dense/config.json",
        "3_Dense/model.safetensors",
        "3_Dense/pytorch_model.bin",
        "2_Dense_1024/pytorch_model.bin",
        "2_Dense_1024/adapter.safetensors",  # (not its weights: the .bin is)
        "2_Dense_256/pytorch_model.bin",  # a size modules.json does not name
        "checkpoint-5/pytorch_model.bin",
        "step[5]/pytorch_model.bin",  # (a name that is a glob pattern, taken as a name)
        "[weird]_Dense/pytorch_model.bin",
    ]
    dense = ("2_Dense", "3_Dense", "2_Dense_1024", "[weird]_Dense")
    assert set(files) - set(fetched(files, dense)) == {
        "pytorch_model.bin",
        "training_args.bin",
        "3_Dense/pytorch_model.bin",
        "2_Dense_256/pytorch_model.bin",
        "checkpoint-5/pytorch_model.bin",
        "step[5]/pytorch_model.bin",
    }
    assert files_to_skip(files) == NOT_NEEDED + PICKLED_WEIGHTS  # no Dense module: as before


@pytest.mark.parametrize(
    "other", ["adapter_model.safetensors", "2_Dense/model.safetensors", "model.fp16.safetensors"]
)
def test_a_safetensors_file_other_than_the_models_leaves_its_bin_to_download(other):
    """Any .safetensors file in the repo skipped its pytorch_model.bin: a fine-tune that
    also ships its adapter was downloaded without weights and refused as having none."""
    assert files_to_skip([other, "pytorch_model.bin"]) == NOT_NEEDED


# --- folders ---------------------------------------------------------------------------


def test_a_folder_resolves_to_itself(tmp_path):
    (tmp_path / "model").mkdir()
    assert resolved(run_resolve(str(tmp_path / "model"), tmp_path)) == tmp_path / "model"


@pytest.mark.parametrize("name", ["nowhere", "y" * 300], ids=["missing", "name-too-long"])
def test_a_missing_folder_is_one_line(tmp_path, name):
    """A name the system cannot look up (a part past 255 bytes) raised OSError from
    `is_dir`: a 24-line traceback at start instead of the line."""
    line = one_error_line(run_resolve(str(tmp_path / name), tmp_path))
    assert "no model folder" in line


def test_a_folder_given_a_revision_is_told_revisions_are_for_hub_ids(tmp_path, monkeypatch):
    """`./model@main` (a local folder with a revision) said only that there was no such
    folder, though the folder was right there; a folder whose name holds an '@' is still
    served."""
    (tmp_path / "model").mkdir()
    (tmp_path / "odd@name").mkdir()
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelNotFound, match=r"\./model is a folder, and a revision"):
        resolve_model(parse_model_spec("./model@main"))
    assert resolve_model(parse_model_spec("./odd@name")).folder == tmp_path / "odd@name"
    with pytest.raises(ModelNotFound, match="^no model folder ./elsewhere@main$"):
        resolve_model(parse_model_spec("./elsewhere@main"))


@pytest.mark.parametrize(
    ("weights", "refused"),
    [
        ((), True),
        (("tf_model.h5", "flax_model.msgpack"), True),  # transformers 5 loads neither
        (("model.safetensors",), False),
        (("pytorch_model.bin",), False),
        (("model.safetensors.index.json", "model-00001-of-00002.safetensors"), False),
    ],
)
def test_a_folder_without_pytorch_weights_is_refused_before_any_worker_loads_it(
    tmp_path, weights, refused
):
    (tmp_path / "model").mkdir()
    for name in ("config.json", "tokenizer.json", *weights):
        (tmp_path / "model" / name).write_text('{"architectures": ["BertModel"]}')
    if not refused:
        assert plan_models([str(tmp_path / "model")])[0].facts.task == "feature-extraction"
        return
    with pytest.raises(ModelNotFound, match=r"model .*/model: the model has no PyTorch weights"):
        plan_models([str(tmp_path / "model")])


def test_a_folder_of_an_onnx_graph_alone_is_refused_clearly_where_the_engine_cannot_serve_it(
    tmp_path,
):
    """A folder copied from an ONNX-only repo, served in float16 (a GPU's default, or
    --dtype) or with --engine torch: the plan passed it, and each worker failed loading
    it with transformers' "no file named model.safetensors", naming no remedy. It is now
    refused before any worker starts, saying why, as such a Hub repo is."""
    folder = tmp_path / "model"
    (folder / "onnx").mkdir(parents=True)
    for name in ("config.json", "tokenizer.json", "onnx/model.onnx"):
        (folder / name).write_text('{"architectures": ["BertModel"]}')
    assert plan_models([str(folder)], onnx_graphs=True)[0].facts.task == "feature-extraction"
    with pytest.raises(ModelNotFound) as refused:
        plan_models([str(folder)], onnx_graphs=False)
    assert str(refused.value).startswith(
        f"model {folder}: the folder has no PyTorch weights, only its ONNX graph "
        "(onnx/model.onnx), and ONNX Runtime serves it only on the CPU, in float32"
    )


@pytest.mark.parametrize(
    ("shards", "index"),
    [
        ("model-{}-of-00002.safetensors", "model.safetensors.index.json"),
        ("pytorch_model-{}-of-00002.bin", "pytorch_model.bin.index.json"),
    ],
)
def test_shards_without_their_index_are_refused_naming_the_index(tmp_path, shards, index):
    """Shards copied without their index were refused as a model with no PyTorch weights,
    TensorFlow's and Flax's not loaded, with the weights there in the folder."""
    (tmp_path / "model").mkdir()
    for name in ("config.json", "tokenizer.json", *map(shards.format, ("00001", "00002"))):
        (tmp_path / "model" / name).write_text('{"architectures": ["BertModel"]}')
    with pytest.raises(ModelNotFound) as caught:
        plan_models([str(tmp_path / "model")])
    assert str(caught.value) == (
        f"model {tmp_path / 'model'}: the model's weights are shards "
        f"({shards.format('00001')}, ...) without {index}, which names the shard of each "
        "tensor: copy it too, or download the model again"
    )


def text_model(folder: Path, architecture: str, files: dict[str, str]) -> Path:
    """A model folder of `architecture` whose tokenizer is `files` (name → text)."""
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": [architecture]}))
    (folder / "model.safetensors").write_text("")
    for name, text in files.items():
        (folder / name).parent.mkdir(exist_ok=True)
        (folder / name).write_text(text)
    return folder


@pytest.mark.parametrize(
    ("files", "task", "refused"),
    [
        ({}, None, True),  # transformers would advise installing sentencepiece
        ({"tokenizer_config.json": '{"tokenizer_class": "TokenizersBackend"}'}, None, True),
        ({"special_tokens_map.json": "{}"}, "text-classification", True),
        ({"tokenizer.json": "{}"}, None, False),
        ({"vocab.json": "{}", "merges.txt": ""}, None, False),
        ({"vocab.txt": ""}, None, False),
        ({"spiece.model": ""}, None, False),
        ({"tokenizer_config.json": '{"tokenizer_class": "ByT5Tokenizer"}'}, None, False),
        ({}, "image-classification", False),  # an image model has no tokenizer
    ],
)
def test_a_text_model_without_tokenizer_files_is_refused_before_any_worker_loads_it(
    tmp_path, monkeypatch, files, task, refused
):
    monkeypatch.setitem(sys.modules, "sentencepiece", SENTENCEPIECE_INSTALLED)
    folder = text_model(tmp_path / "gpt2-like", "GPT2LMHeadModel", files)
    spec = f"{folder}:{task}" if task else str(folder)
    if not refused:
        assert plan_models([spec])[0].facts.task == (task or "text-generation")
        return
    with pytest.raises(ModelNotFound) as caught:
        plan_models([spec])
    assert str(caught.value) == (
        f"model {spec}: the model has no tokenizer files (tokenizer.json, a vocabulary or a "
        "sentencepiece model): every text would read as unknown tokens"
    )


def test_an_audio_model_is_refused_as_one_not_for_its_missing_tokenizer(tmp_path):
    """A wav2vec2 classifier's task reads as text-classification (ForSequenceClassification),
    and it was refused for tokenizer files it never had."""
    processor = {"feature_extractor_type": "Wav2Vec2FeatureExtractor", "sampling_rate": 16000}
    files = {"preprocessor_config.json": json.dumps(processor)}
    folder = text_model(tmp_path / "wav2vec2", "Wav2Vec2ForSequenceClassification", files)
    with pytest.raises(ModelNotFound) as caught:
        plan_models([str(folder)])
    assert str(caught.value) == (
        f"model {folder}: the model reads sound (its preprocessor_config.json names "
        "Wav2Vec2FeatureExtractor), and rawserve serves no audio task"
    )


@pytest.mark.parametrize("task", ["text-classification", "feature-extraction"])
def test_an_image_model_served_as_a_text_task_is_told_it_reads_images(tmp_path, task):
    """An image classifier named with a text task was refused for tokenizer files it
    never had ("every text would read as unknown tokens")."""
    processor = {"image_processor_type": "ViTImageProcessor", "size": {"height": 32}}
    files = {"preprocessor_config.json": json.dumps(processor)}
    folder = text_model(tmp_path / "vit", "ViTForImageClassification", files)
    with pytest.raises(ModelNotFound) as caught:
        plan_models([f"{folder}:{task}"])
    assert str(caught.value) == (
        f"model {folder}:{task}: the model reads images (its preprocessor_config.json names "
        "ViTImageProcessor), not text: serve it as image-classification"
    )


@pytest.mark.parametrize("task", [None, "text-generation"])
def test_a_model_without_config_json_is_refused_for_that_whatever_names_its_task(tmp_path, task):
    """Named with its task, a folder without config.json was refused with transformers'
    "should have a `model_type` key in its config.json" (a file that is not there)."""
    folder = text_model(tmp_path / "gpt2-like", "GPT2LMHeadModel", {"tokenizer.json": "{}"})
    (folder / "config.json").unlink()
    spec = f"{folder}:{task}" if task else str(folder)
    with pytest.raises(ModelNotFound) as caught:
        plan_models([spec])
    assert "no config.json" in str(caught.value) and "model_type" not in str(caught.value)
    assert "name the task" not in str(caught.value)  # named, it was refused for the same


@pytest.mark.parametrize(
    ("files", "says"),
    [
        ({"model-q4_k_m.gguf": "GGUF"}, "the model is GGUF weights (model-q4_k_m.gguf"),
        (
            {"adapter_config.json": '{"base_model_name_or_path": "org/base"}'},
            "the folder is a PEFT adapter, not a model: serve its base model (org/base)",
        ),
        (
            {
                "modules.json": json.dumps(
                    [{"path": "0_Transformer", "type": "sentence_transformers.models.Transformer"}]
                )
            },
            "its transformer is in 0_Transformer/, not the folder's root",
        ),
        ({}, "the model has no config.json at its top, which says its architecture"),
    ],
)
def test_a_hub_repo_without_config_json_is_refused_saying_what_it_is(tmp_path, files, says):
    """Each was told "copy it too, or download the model again", which cannot help a
    Hub download (a GGUF repo, an adapter, a transformer in a subfolder)."""
    snapshot = tmp_path / "models--org--x" / "snapshots" / ("a" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "model.safetensors").write_bytes(b"")
    for name, text in files.items():
        (snapshot / name).write_text(text)
    with pytest.raises(ModelNotFound) as caught:
        plan_models([str(snapshot)])
    assert says in str(caught.value) and "copy it too" not in str(caught.value)


def test_a_hub_caches_model_folder_is_refused_saying_which_folder_to_serve(tmp_path):
    """A cache's models--org--name folder holds the files under snapshots/<commit>/: it
    was refused as a folder with no config.json, "name the task", which did not help."""
    cache = tmp_path / "models--org--tiny"
    (cache / "snapshots").mkdir(parents=True)
    text_model(cache / "snapshots" / "aaa111", "BertForMaskedLM", {})  # an older one
    snapshot = text_model(cache / "snapshots" / "fff999", "BertForMaskedLM", {})
    (cache / "refs").mkdir()
    (cache / "refs" / "main").write_text("fff999")  # main's, not the first by name
    with pytest.raises(ModelNotFound) as caught:
        plan_models([str(cache)])
    message = str(caught.value)
    assert f"--model {snapshot}" in message and "--model org/tiny" in message, message
    assert "name the task" not in message


@pytest.mark.parametrize(
    ("files", "refused"),
    [
        ({"tokenizer.model": "\n\x05<unk>"}, "tokenizer.model"),  # a protobuf, not text
        ({"spiece.model": ""}, "spiece.model"),
        ({"source.spm": "", "vocab.json": "{}"}, "source.spm"),  # Marian's
        ({"tokenizer.model": "", "tokenizer.json": "{}"}, None),  # the fast tokenizer's
        ({"tokenizer.model": "IQ== 0\nIg== 1\n"}, None),  # tiktoken's (Llama 3's)
        ({"checkpoints.model/notes.txt": "", "vocab.txt": ""}, None),  # a folder
    ],
)
def test_a_sentencepiece_tokenizer_without_sentencepiece_is_refused_before_any_worker_loads_it(
    tmp_path, monkeypatch, files, refused
):
    """A folder whose tokenizer is only a sentencepiece model, where sentencepiece is not
    installed: transformers tried it as tiktoken's in each worker, and the server stopped
    on its advice to install tiktoken, which would not have helped."""
    folder = text_model(tmp_path / "llama-like", "LlamaForCausalLM", files)
    monkeypatch.setitem(sys.modules, "sentencepiece", None)  # not installed
    if refused is None:
        assert plan_models([str(folder)])[0].facts.task == "text-generation"
        return
    with pytest.raises(ModelNotFound) as caught:
        plan_models([str(folder)])
    assert str(caught.value) == (
        f"model {folder}: the model's tokenizer is the sentencepiece model {refused} (it has "
        "no tokenizer.json), which takes sentencepiece to read: pip install sentencepiece"
    )
    monkeypatch.setitem(sys.modules, "sentencepiece", SENTENCEPIECE_INSTALLED)
    assert plan_models([str(folder)])[0].facts.task == "text-generation"


def test_an_image_model_without_pillow_names_the_extra_before_any_worker_loads_it(
    tmp_path, monkeypatch
):
    folder = tmp_path / "vit"
    folder.mkdir()
    (folder / "config.json").write_text('{"architectures": ["ViTForImageClassification"]}')
    (folder / "model.safetensors").write_text("")
    monkeypatch.setitem(sys.modules, "PIL", None)  # as where the image extra is not installed
    with pytest.raises(ModelNotFound) as caught:
        plan_models([str(folder)])
    assert str(caught.value) == (
        f"model {folder}: image-classification reads images with Pillow, which is not "
        "installed (pip install 'rawserve[image]')"
    )


@pytest.mark.parametrize(
    ("task", "served"),
    [
        ("text-classification", "text-classification"),
        ("sentiment-analysis", "text-classification"),  # transformers' other names
        ("ner", "token-classification"),
        ("sentence-similarity", "feature-extraction"),  # the Hub's tag, SageMaker's HF_TASK
        ("bogus-task", None),  # transformers' KeyError listed its own tasks, in a worker
        ("image-segmentation", None),  # a pipeline of transformers, not served here
    ],
)
def test_a_task_not_served_is_refused_before_any_worker_starts(tmp_path, task, served):
    folder = tmp_path / "model"
    folder.mkdir()
    for name in ("config.json", "tokenizer.json", "model.safetensors"):
        (folder / name).write_text('{"architectures": ["BertModel"]}')
    if served:
        assert plan_models([f"{folder}:{task}"])[0].facts.task == served
        assert plan_models([str(folder)], task=task)[0].facts.task == served
        return
    # the model named as the user typed it: `:TASK`, or --task beside it
    for models, given, named in (
        ([f"{folder}:{task}"], None, f"{folder}:{task}"),
        ([str(folder)], task, f"{folder} (--task {task})"),
    ):
        with pytest.raises(ModelNotFound) as caught:
            plan_models(models, task=given)
        assert str(caught.value).startswith(f"model {named}: {task!r} is not a task served")
        assert "feature-extraction, fill-mask, text-classification" in str(caught.value)


@pytest.mark.parametrize(
    ("architecture", "task"),
    [
        ("BertForMaskedLM", "fill-mask"),
        ("DistilBertForSequenceClassification", "text-classification"),
        ("BertForTokenClassification", "token-classification"),
        ("BertForQuestionAnswering", "question-answering"),
        ("T5ForConditionalGeneration", "text2text-generation"),
        ("MarianMTModel", "translation"),  # its ending before the bare Model's
        ("ViTForImageClassification", "image-classification"),
        ("LlamaForCausalLM", "text-generation"),
        ("GPT2LMHeadModel", "text-generation"),  # as above
        ("BertModel", "feature-extraction"),
    ],
)
def test_a_folder_without_a_task_is_served_for_its_architecture_s(tmp_path, architecture, task):
    """What a model is served for when no task is named: read from its config's
    architecture, each family's ending as transformers' pipelines read it."""
    for name in ("config.json", "tokenizer.json", "model.safetensors"):
        (tmp_path / name).write_text(json.dumps({"architectures": [architecture]}))
    assert plan_models([str(tmp_path)])[0].facts.task == task


# --- a Hub cache, offline --------------------------------------------------------------


def test_an_offline_cache_serves_the_default_branch_a_tag_and_a_commit(tmp_path):
    repo = make_repo()
    old = repo.main
    repo.add_commit({**FILES, "config.json": b'{"architectures": ["BertModel"]}'}, refs=("main",))
    repo.refs["v1"] = old
    write_hub_cache(tmp_path / "hub", repo)
    snapshots = tmp_path / "hub" / "models--org--tiny" / "snapshots"

    assert resolved(run_resolve("org/tiny", tmp_path, HF_HUB_OFFLINE="1")) == snapshots / repo.main
    assert resolved(run_resolve("org/tiny@v1", tmp_path, HF_HUB_OFFLINE="1")) == snapshots / old
    pinned = run_resolve(f"org/tiny@{old}", tmp_path, HF_HUB_OFFLINE="1")
    assert resolved(pinned) == snapshots / old


def test_an_offline_cache_serves_a_commit_by_its_short_form(tmp_path):
    """README's own example pins `@5c38ec7c`: huggingface_hub found a short commit in the
    cache only by the ref a download under that name left, so a cache filled by its
    branch said "not in the Hub cache" offline. One the cache does not hold still does."""
    repo = make_repo()
    old = repo.main
    repo.add_commit({**FILES, "config.json": b'{"architectures": ["BertModel"]}'}, refs=("main",))
    write_hub_cache(tmp_path / "hub", repo)
    snapshots = tmp_path / "hub" / "models--org--tiny" / "snapshots"
    for commit in (old, repo.main):
        pinned = run_resolve(f"org/tiny@{commit[:8]}", tmp_path, HF_HUB_OFFLINE="1")
        assert resolved(pinned) == snapshots / commit
    line = one_error_line(run_resolve("org/tiny@0000000", tmp_path, HF_HUB_OFFLINE="1"))
    assert "org/tiny@0000000 is not in the Hub cache" in line


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        ("org/absent", ["org/absent", "not in the Hub cache", "HF_HUB_OFFLINE=1"]),
        ("org/tiny@v9", ["org/tiny@v9", "not in the Hub cache"]),
        ("org/tiny@" + "0" * 40, ["not in the Hub cache"]),
        ("not a/repo id", ["neither an existing folder nor a Hub repo id"]),
        # vLLM's served names have a '/': read as a path's, it is said what an alias takes
        ("org/x=/no/such/folder", ["an alias before '=' ('org/x' here) takes letters, digits"]),
        ("org/tiny@v1:Bad Task", ["'Bad Task' (after ':') is not a task name"]),
    ],
)
def test_what_the_offline_cache_lacks_is_one_line(tmp_path, spec, words):
    write_hub_cache(tmp_path / "hub", make_repo())
    line = one_error_line(run_resolve(spec, tmp_path, HF_HUB_OFFLINE="1"))
    for word in words:
        assert word in line
    assert "HF_ENDPOINT" not in line


UNLISTED = {name: FILES[name] for name in ("config.json", "tokenizer.json", "model.safetensors")}
GENERATING = {**UNLISTED, "config.json": b'{"architectures": ["GPT2LMHeadModel"]}'}


@pytest.mark.parametrize(
    ("files", "env", "says"),
    [
        (UNLISTED, {"HF_HUB_OFFLINE": "1"}, "(it has no modules.json: served with pooling none"),
        # the Hub unreachable: the cache serves, as offline
        (UNLISTED, {"HF_ENDPOINT": "http://127.0.0.1:9"}, "(it has no modules.json: served"),
        (
            {**UNLISTED, "config_sentence_transformers.json": b"{}"},
            {"HF_HUB_OFFLINE": "1"},
            "(it has config_sentence_transformers.json but no modules.json: a sentence-",
        ),
        (GENERATING, {"HF_HUB_OFFLINE": "1"}, "(it has no generation_config.json: the repo's"),
    ],
    ids=["offline", "unreachable", "sentence-transformers", "generating"],
)
def test_a_cached_snapshot_without_its_listing_is_served_saying_what_may_be_missing(
    tmp_path, files, env, says
):
    """A cache filled file by file (transformers' from_pretrained, hf_hub_download) has
    no listing of the repo's files: served offline, or with the Hub unreachable, as
    though whole, and a sentence-transformers repo without its modules.json was served
    with another pooling, without a word. Served all the same (as transformers serves
    it), with one line naming what may be missing and how to complete it."""
    repo = HubRepo("org/st")
    repo.add_commit(files, refs=("main",))
    write_hub_cache(tmp_path / "hub", repo)  # (as from_pretrained leaves it: no listing)
    result = run_resolve("org/st", tmp_path, 120, PLAN, "torch", **env)
    assert resolved(result) == tmp_path / "hub" / "models--org--st" / "snapshots" / repo.main
    [line] = [line for line in result.stderr.splitlines() if "no listing" in line]
    assert f"model org/st: the Hub cache holds no listing of org/st's files at {repo.main}" in line
    assert says in line and "start once with the Hub reachable" in line


def test_a_cached_snapshot_with_its_listing_is_served_without_a_word_of_it(tmp_path):
    with FakeHub([make_repo("org/st")]) as hub:
        folder = resolved(run_resolve("org/st", tmp_path, HF_ENDPOINT=hub.endpoint))
    result = run_resolve("org/st", tmp_path, 120, PLAN, "torch", HF_HUB_OFFLINE="1")
    assert resolved(result) == folder and "no listing" not in result.stderr


# --- the real download path, against the stand-in -------------------------------------


def test_a_download_fills_the_cache_and_a_second_start_needs_no_hub(tmp_path):
    repo = make_repo()
    with FakeHub([repo]) as hub:
        result = run_resolve("org/tiny", tmp_path, HF_ENDPOINT=hub.endpoint)
        folder = resolved(result)
        cdn = hub.seen("GET", "/cdn/")
    assert folder == tmp_path / "hub" / "models--org--tiny" / "snapshots" / repo.main
    assert files_in(folder) == NEEDED  # no pickled, TensorFlow or ONNX copies
    assert (folder / "model.safetensors").read_bytes() == FILES["model.safetensors"]
    assert (folder.parent.parent / "refs" / "main").read_text() == repo.main
    assert len(cdn) == 1  # the weights came by redirect from the "CDN"
    assert "downloading: 5 of 5 files" in result.stderr  # progress in the log

    # the stand-in is gone: served from the cache, offline or not
    for offline in ("1", "0"):
        again = run_resolve("org/tiny", tmp_path, HF_ENDPOINT=hub.endpoint, HF_HUB_OFFLINE=offline)
        assert resolved(again) == folder


SHIPPED = {
    "onnx/model.onnx": os.urandom(1000),  # the repo's own float32 export
    "onnx/model.onnx_data": os.urandom(3000),  # its weights, kept apart
}
VARIANTS = {
    "onnx/model_qint8_avx512.onnx": os.urandom(500),  # quantized: answers otherwise
    "onnx/model_O4.onnx": os.urandom(500),
    "model.onnx": os.urandom(500),  # an optimum export at the top: not what the engine reads
}


def test_a_repo_s_own_onnx_graph_is_fetched_for_the_onnx_engine(tmp_path):
    """The ONNX engine serves a folder's own onnx/model.onnx, loaded in a second, where
    an export takes tens: a Hub repo's was never downloaded, so every repo was exported.
    Its quantized variants, and every other ONNX file, stay on the Hub."""
    repo = HubRepo("org/tiny")
    repo.add_commit({**FILES, **SHIPPED, **VARIANTS}, refs=("main",))
    with FakeHub([repo]) as hub:
        result = run_resolve("org/tiny", tmp_path, 120, PLAN, "onnx", HF_ENDPOINT=hub.endpoint)
        folder = resolved(result)
    assert files_in(folder) == NEEDED | set(SHIPPED)
    for name, content in SHIPPED.items():
        assert (folder / name).read_bytes() == content
    assert "model org/tiny: the repo's onnx/model.onnx, for the ONNX engine (" in result.stderr


def test_a_generating_repo_s_onnx_graph_is_not_fetched(tmp_path):
    """The ONNX engine serves the encoder tasks: a decoder's export would be downloaded
    for nothing."""
    repo = HubRepo("org/gen")
    config = b'{"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}'
    files = {"config.json": config, "tokenizer.json": b"{}", "model.safetensors": b"0"}
    repo.add_commit({**files, **SHIPPED}, refs=("main",))
    with FakeHub([repo]) as hub:
        result = run_resolve("org/gen", tmp_path, 120, PLAN, "onnx", HF_ENDPOINT=hub.endpoint)
    assert files_in(resolved(result)) == set(files)


def test_an_onnx_only_repo_is_served_by_the_onnx_engine_and_refused_clearly_elsewhere(tmp_path):
    """A transformers.js-style repo (its graph, a tokenizer, a config; no torch weights)
    was refused at plan time ("no PyTorch weights") though the ONNX engine serves such a
    folder: its graph is now fetched first. Where the engine may not serve it (--engine
    torch, a GPU; a generation model) the refusal says so, and nothing is downloaded."""
    files = {name: FILES[name] for name in NEEDED - {"model.safetensors"}}
    config = b'{"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}'
    repo, generating = HubRepo("org/tiny"), HubRepo("org/gen")
    repo.add_commit({**files, **SHIPPED}, refs=("main",))
    generating.add_commit(
        {"config.json": config, "tokenizer.json": b"{}", **SHIPPED}, refs=("main",)
    )
    with FakeHub([repo, generating]) as hub:
        result = run_resolve("org/tiny", tmp_path, 120, PLAN, "onnx", HF_ENDPOINT=hub.endpoint)
        assert files_in(resolved(result)) == set(files) | set(SHIPPED)
        for spec, engine, reason in (
            ("org/tiny", "torch", "ONNX Runtime serves it only on the CPU, in float32,"),
            ("org/gen", "onnx", "ONNX Runtime serves the encoder tasks, not text-generation"),
        ):
            home = tmp_path / engine
            result = run_resolve(spec, home, 120, PLAN, engine, HF_ENDPOINT=hub.endpoint)
            assert result.returncode == 1
            assert f"error: model {spec}: the repo has no PyTorch weights, only its ONNX " in (
                result.stderr
            )
            assert reason in result.stderr
            assert not list((home / "hub").rglob("*.onnx*"))


@pytest.mark.parametrize(("changed", "served"), [(1, True), (2, False)])
def test_an_onnx_graph_whose_bytes_differ_from_its_hash_is_never_kept(tmp_path, changed, served):
    """The graph was fetched apart from the snapshot, and never hashed: a byte changed on
    the way stayed in the cache under a name that is not its sha256, and every later
    start failed ("cannot be exported to ONNX"). Hashed as the snapshot's files are:
    downloaded again once; changed twice, the start stops naming it."""
    files = {name: FILES[name] for name in NEEDED - {"model.safetensors"}}
    repo = HubRepo("org/tiny")
    repo.add_commit({**files, **SHIPPED}, refs=("main",))  # the graph is its only LFS file
    with FakeHub([repo], changed=changed) as hub:
        result = run_resolve("org/tiny", tmp_path, 120, PLAN, "onnx", HF_ENDPOINT=hub.endpoint)
    assert "model org/tiny: onnx/model.onnx did not match the hash the Hub named" in result.stderr
    blobs = list((tmp_path / "hub").rglob("blobs/*"))
    assert blobs and all(hashes_to_its_name(blob) for blob in blobs)
    if served:
        folder = resolved(result)
        assert (folder / "onnx/model.onnx").read_bytes() == SHIPPED["onnx/model.onnx"]
    else:
        line = one_error_line(result)
        assert line.startswith("error: model org/tiny: onnx/model.onnx did not match the hash")
        assert "downloaded twice" in line and "HF_ENDPOINT" in line


def test_an_onnx_graph_that_cannot_be_had_is_one_line_and_the_model_served(tmp_path):
    """Offline, a cache filled for --engine torch lacks it: the model is served all the
    same, and exported."""
    repo = HubRepo("org/tiny")
    repo.add_commit({**FILES, **SHIPPED}, refs=("main",))
    with FakeHub([repo]) as hub:  # downloaded once without it (--engine torch)
        folder = resolved(
            run_resolve("org/tiny", tmp_path, 120, PLAN, "torch", HF_ENDPOINT=hub.endpoint)
        )
    result = run_resolve("org/tiny", tmp_path, 120, PLAN, "onnx", HF_HUB_OFFLINE="1")
    assert resolved(result) == folder and files_in(folder) == NEEDED
    assert "Traceback" not in result.stderr
    [line] = [line for line in result.stderr.splitlines() if "onnx/model.onnx" in line]
    assert line.startswith("rawserve.models the repo's onnx/model.onnx was not downloaded (")
    assert "HF_HUB_OFFLINE=1" in line
    assert line.endswith("): the ONNX engine exports the model instead")


def test_a_failing_hub_serves_the_cache_and_says_so(tmp_path):
    """The Hub down (5xx) or busy (429) must not stop a restart the cache can serve: the
    repo's listing asked first failed the start, although the download then falls back."""
    repo = make_repo()
    with FakeHub([repo]) as hub:
        folder = resolved(run_resolve("org/tiny", tmp_path, HF_ENDPOINT=hub.endpoint))
    with FakeHub([repo], failing=503) as hub:
        result = run_resolve("org/tiny", tmp_path, HF_ENDPOINT=hub.endpoint)
    assert resolved(result) == folder
    assert "the Hub answered 503 for org/tiny: the cache decides" in result.stderr


def test_a_token_the_hub_refuses_is_said_where_the_cache_serves(tmp_path):
    """A revoked HF_TOKEN with the model cached: the start served the cache without a
    word, and the token's fault showed only where a start found the cache empty."""
    repo = make_repo()
    with FakeHub([repo]) as hub:
        folder = resolved(run_resolve("org/tiny", tmp_path, HF_ENDPOINT=hub.endpoint))
    with FakeHub([repo], revoked=frozenset({"hf_revoked"})) as hub:
        result = run_resolve("org/tiny", tmp_path, HF_ENDPOINT=hub.endpoint, HF_TOKEN="hf_revoked")
    assert resolved(result) == folder
    assert "the Hub refused org/tiny (401: a token it does not take, HF_TOKEN" in result.stderr


def test_a_repo_the_hub_does_not_have_blames_no_token(tmp_path):
    """The Hub answers 401 for a repo it does not have (or will not show without a
    token): a start with no token was warned of "a token it does not take" first."""
    with FakeHub([make_repo()]) as hub:
        result = run_resolve("org/absent", tmp_path, HF_ENDPOINT=hub.endpoint)
    assert "org/absent" in one_error_line(result)
    assert "a token it does not take" not in result.stderr, result.stderr


@pytest.mark.parametrize("status", [500, 429])
def test_a_failing_hub_with_nothing_cached_says_to_try_again_later(tmp_path, status):
    with FakeHub([make_repo()], failing=status) as hub:
        line = one_error_line(run_resolve("org/tiny", tmp_path, HF_ENDPOINT=hub.endpoint))
    assert "org/tiny is not in the Hub cache" in line
    assert f"answered {status}: the Hub is failing or busy; try again later" in line


def test_a_429_that_asks_for_an_hour_is_tried_again_sooner(tmp_path):
    """huggingface_hub waited as long as a file's 429 said, an hour a retry where it
    said 3600 (a start held past this test's 120 s); the rate limit lifted meanwhile.
    (Each file's HEAD is refused twice: its first try is not retried with a wait.)"""
    limited = {"failing": 429, "retry_after": "3600", "failing_files": True, "failing_times": 2}
    with FakeHub([make_repo()], **limited) as hub:
        result = run_resolve("org/tiny", tmp_path, HF_ENDPOINT=hub.endpoint)
    assert files_in(resolved(result)) >= {"config.json", "model.safetensors"}
    assert "the Hub answered 429 and asks to wait 3600 s before trying again" in result.stderr


@pytest.mark.parametrize(
    ("cached", "retry_after", "waited"),
    [(False, "1", 1), (True, "1", 1), (False, "3600", 1)],
    ids=["nothing-cached", "branch-moved-on", "an-hour-asked"],
)
def test_a_429_for_the_repo_s_info_is_waited_then_asked_again(
    tmp_path, cached, retry_after, waited
):
    """huggingface_hub asks a repo's info once: a 429 there, whatever wait it asked for,
    failed a start with nothing cached in a second ("try again later"), and served a
    cached branch as the cache held it, moved on or not. (Files took the wait.)"""
    repo = make_repo()
    if cached:
        download_with_fake_hub(["org/tiny"], [repo], tmp_path)
        repo.add_commit({**FILES, "config.json": b"{}"}, refs=("main",))
    limited = {"failing": 429, "retry_after": retry_after, "failing_api": True, "failing_times": 1}
    with FakeHub([repo], **limited) as hub:
        result = run_resolve("org/tiny", tmp_path, HF_ENDPOINT=hub.endpoint)
        infos = hub.seen("GET", "/api/models/org/tiny/revision/main")
    assert resolved(result).name == repo.main, result.stderr
    assert f"the Hub answered 429 for org/tiny's info: asking again in {waited} s" in result.stderr
    assert len(infos) == 2  # snapshot_download's own, refused then answered


def test_a_hub_whose_files_never_answer_is_given_up_after_one_silence(tmp_path):
    """The Hub's API answering and its files never: huggingface_hub asked modules.json's
    HEAD again five times, 1 to 8 s between (45 s with HF_HUB_ETAG_TIMEOUT at 3, 12 lines
    of its own), before the line that said the Hub did not answer within 3 s."""
    env = {"HF_HUB_ETAG_TIMEOUT": "1", "HF_HUB_DOWNLOAD_TIMEOUT": "1"}
    with FakeHub([make_repo()], silent_files=True) as hub:
        started = time.monotonic()
        result = run_resolve("org/tiny", tmp_path, timeout=60, HF_ENDPOINT=hub.endpoint, **env)
        took = time.monotonic() - started
        heads = hub.seen("HEAD")
    assert "org/tiny is not in the Hub cache" in one_error_line(result)
    assert "did not answer for org/tiny within 1 s (HF_HUB_ETAG_TIMEOUT)" in result.stderr
    assert len(heads) == 1 and "Retry" not in result.stderr, result.stderr
    assert took < 15, result.stderr


def test_a_pinned_revision_downloads_that_commit(tmp_path):
    repo = make_repo()
    first = repo.main
    repo.add_commit({**FILES, "config.json": b"{}"}, refs=("main",))
    with FakeHub([repo]) as hub:
        folder = resolved(run_resolve(f"org/tiny@{first}", tmp_path, HF_ENDPOINT=hub.endpoint))
        fetched = hub.seen(prefix="/org/tiny/resolve/")
    assert fetched and all(f"/resolve/{first}/" in r.path for r in fetched)
    assert folder.name == first
    assert (folder / "config.json").read_bytes() == FILES["config.json"]


@pytest.mark.parametrize(
    ("spec", "token", "words"),
    [
        ("org/absent", None, ["no Hub repo org/absent", "HF_TOKEN"]),
        # the Hub's 404 with a token, X-Error-Code RepoNotFound: no word of HF_ENDPOINT
        ("org/absent", "hf_granted", ["no Hub repo org/absent", "check the name"]),
        ("org/tiny@v9", None, ["org/tiny has no revision 'v9'"]),
        ("org/gated", None, ["org/gated is gated", "set HF_TOKEN"]),
        ("org/gated", "hf_other", ["org/gated is gated", "has no access"]),
        # it was 'the Hub answered 401 for org/tiny', a public repo
        ("org/tiny", "hf_revoked", ["refused the token in use (HF_TOKEN", "not valid"]),
    ],
)
def test_what_the_hub_refuses_is_one_line(tmp_path, spec, token, words):
    repos = [make_repo(), make_repo("org/gated", gated=True, granted_tokens={"hf_granted"})]
    env = {"HF_TOKEN": token} if token else {}
    with FakeHub(repos, revoked=frozenset({"hf_revoked"})) as hub:
        line = one_error_line(run_resolve(spec, tmp_path, HF_ENDPOINT=hub.endpoint, **env))
    for word in words:
        assert word in line
    assert "HF_ENDPOINT" not in line


def test_a_gated_repo_downloads_with_a_granted_token_which_never_leaves_the_hub(tmp_path):
    repo = make_repo("org/gated", gated=True, granted_tokens={"hf_granted"})
    with FakeHub([repo]) as hub:
        result = run_resolve("org/gated", tmp_path, HF_ENDPOINT=hub.endpoint, HF_TOKEN="hf_granted")
        assert files_in(resolved(result)) == NEEDED
        resolves = hub.seen(prefix="/org/gated/resolve/")
        cdn = hub.seen(prefix="/cdn/")
    assert resolves and all(r.authorization == "Bearer hf_granted" for r in resolves)
    assert cdn and all(r.authorization is None for r in cdn)  # not sent to another host


def test_no_network_and_nothing_cached_is_one_line(tmp_path):
    with FakeHub([]) as hub:
        endpoint = hub.endpoint  # a port that refuses connections once the stand-in stops
    line = one_error_line(run_resolve("org/tiny", tmp_path, HF_ENDPOINT=endpoint))
    assert "org/tiny is not in the Hub cache" in line and "cannot be reached" in line


def test_why_the_hub_cannot_be_reached_is_in_the_line_that_ends_the_start(tmp_path):
    """The line said only "cannot be reached": the cause (a certificate not trusted, a
    timeout) was in a warning above it, which a log filtered to errors drops."""
    import ssl

    import trustme

    with FakeHub([]) as hub:
        refused = hub.endpoint  # a port that refuses connections once the stand-in stops
    line = one_error_line(run_resolve("org/tiny", tmp_path, HF_ENDPOINT=refused))
    assert line.endswith("cannot be reached ([Errno 111] Connection refused)"), line
    with SilentHub() as silent:
        env = {"HF_ENDPOINT": silent.endpoint, "HF_HUB_ETAG_TIMEOUT": "1"}
        line = one_error_line(run_resolve("org/tiny", tmp_path, timeout=60, **env))
    assert line.endswith("cannot be reached (no answer within 1 s, HF_HUB_ETAG_TIMEOUT)"), line
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    trustme.CA().issue_cert("127.0.0.1").configure_cert(context)  # a CA no one trusts
    with FakeHub([]) as hub:
        hub._server.socket = context.wrap_socket(hub._server.socket, server_side=True)
        endpoint = hub.endpoint.replace("http://", "https://")
        line = one_error_line(run_resolve("org/tiny", tmp_path, timeout=60, HF_ENDPOINT=endpoint))
    assert "cannot be reached ([SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed" in line


def test_a_hub_that_never_answers_is_given_up_then_the_cache_serves(tmp_path):
    """A Hub (or a proxy) that takes the connection and never answers: huggingface_hub
    set no limit on the repo's info, and the start waited forever. Each wait now ends
    after HF_HUB_ETAG_TIMEOUT seconds: one line with nothing cached, the cache otherwise."""
    with socket.create_server(("127.0.0.1", 0)) as silent:  # connects, never answers
        endpoint = f"http://127.0.0.1:{silent.getsockname()[1]}"
        env = {"HF_ENDPOINT": endpoint, "HF_HUB_ETAG_TIMEOUT": "1"}
        line = one_error_line(run_resolve("org/tiny", tmp_path, timeout=60, **env))
        assert "org/tiny is not in the Hub cache" in line and "cannot be reached" in line
        repo = make_repo()
        write_hub_cache(tmp_path / "hub", repo)
        folder = resolved(run_resolve("org/tiny", tmp_path, timeout=60, **env))
    assert folder.name == repo.main


class SilentHub:
    """A Hub (or a proxy) that takes every connection and never answers, on `endpoint`;
    `taken`: how many connections it has taken (each request of huggingface_hub's,
    its connection dropped when it gave up)."""

    def __init__(self) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._held: list[socket.socket] = []
        self._thread = threading.Thread(target=self._take, daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self._listener.getsockname()[1]}"

    @property
    def taken(self) -> int:
        return len(self._held)

    def _take(self) -> None:
        while True:
            try:
                connection, _ = self._listener.accept()
            except OSError:  # the listener shut
                return
            self._held.append(connection)

    def __enter__(self) -> SilentHub:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._listener.shutdown(socket.SHUT_RDWR)  # (wakes the accept)
        self._listener.close()
        self._thread.join(timeout=10)
        for connection in self._held:
            connection.close()


def download_with_fake_hub(models: list[str], repos: list[HubRepo], home: Path) -> list[Path]:
    """`models` downloaded from the stand-in Hub serving `repos`: into the cache as a
    start leaves them (the listing of each commit beside its files)."""
    with FakeHub(repos) as hub:
        result = run_plan(models, home, HF_ENDPOINT=hub.endpoint)
    assert result.returncode == 0, result.stderr
    return [Path(line) for line in result.stdout.split()]


def test_a_hub_that_never_answers_is_asked_once_in_a_start_and_said_to(tmp_path):
    """A silent Hub was asked again by each step of each model's resolution, the
    timeout waited each time in silence (33 s a model with the default 10 s, one line at
    the end). Once it has not answered, the start asks it nothing more and says so."""
    repos = [make_repo("org/emb"), make_repo("org/cls")]
    folders = download_with_fake_hub(["org/emb", "org/cls"], repos, tmp_path)
    with SilentHub() as silent:
        endpoint = silent.endpoint
        env = {"HF_ENDPOINT": endpoint, "HF_HUB_ETAG_TIMEOUT": "1"}
        result = run_plan(["org/emb", "org/cls"], tmp_path, timeout=60, **env)
        taken = silent.taken
    assert [Path(line) for line in result.stdout.split()] == folders, result.stderr
    assert taken == 1, result.stderr  # org/emb's file list, given up after 1 s
    assert (
        f"the Hub ({endpoint}) did not answer for org/emb within 1 s "
        "(HF_HUB_ETAG_TIMEOUT): the cache decides, and the Hub is not asked again"
    ) in result.stderr
    assert "the Hub is not asked for org/cls (it failed for org/emb" in result.stderr


def test_a_hub_that_failed_once_is_still_asked_for_a_model_the_cache_does_not_hold(tmp_path):
    """One 503 for a cached model's file list made the next model, not cached, fail
    ("answered 503: try again later") without the Hub ever being asked for it."""

    class FailingOnce(FakeHub):  # the first request the Hub is sent, and no other
        failed = False

        def fails_once_more(self, path: str) -> bool:
            first, self.failed = not self.failed, True
            return first

    emb, cls = make_repo("org/emb"), make_repo("org/cls")
    [emb_folder] = download_with_fake_hub(["org/emb"], [emb, cls], tmp_path)
    with FailingOnce([emb, cls], failing=503) as hub:
        result = run_plan(["org/emb", "org/cls"], tmp_path, HF_ENDPOINT=hub.endpoint)
        asked_for_cls = hub.seen(prefix="/api/models/org/cls")
    folders = [Path(line) for line in result.stdout.split()]
    assert result.returncode == 0 and folders[0] == emb_folder, result.stderr
    assert (folders[1] / "config.json").is_file() and asked_for_cls, result.stderr
    assert "the Hub is not asked for org/cls" not in result.stderr


def test_a_cached_whole_commit_needs_nothing_of_the_hub(tmp_path):
    """A commit cannot change: with its files and listing cached, a start that pinned it
    still asked a silent Hub for the file list, and waited its timeout."""
    repo = make_repo("org/emb")
    pinned = f"org/emb@{repo.main}"
    [folder] = download_with_fake_hub([pinned], [repo], tmp_path)
    with SilentHub() as silent:
        env = {"HF_ENDPOINT": silent.endpoint, "HF_HUB_ETAG_TIMEOUT": "1"}
        result = run_plan([pinned], tmp_path, timeout=60, **env)
        taken = silent.taken
    assert Path(result.stdout.strip()) == folder, result.stderr
    assert taken == 0, result.stderr


def test_a_hub_failing_files_alone_is_retried_once_with_nothing_cached(tmp_path):
    """A Hub whose API answers and whose files fail (503): huggingface_hub's retries ran
    twice, for modules.json and again for the snapshot (47 s, ~90 lines), before the
    line that says to try again later. One retry cycle now, then that line."""
    with FakeHub([make_repo()], failing=503, failing_files=True) as hub:
        result = run_resolve("org/tiny", tmp_path, HF_ENDPOINT=hub.endpoint)
    line = one_error_line(result)
    assert "org/tiny is not in the Hub cache" in line
    assert "answered 503: the Hub is failing or busy; try again later" in line
    cycles = [text for text in result.stderr.splitlines() if "[Retry 1/" in text]
    assert len(cycles) == 1, result.stderr


@pytest.mark.parametrize(
    ("models", "name"),
    [
        (["org/cls", "org/cls:feature-extraction"], "org/cls"),
        (["org/emb", "org/emb@feature/x"], "org/emb"),
    ],
)
def test_a_name_clash_the_command_line_shows_is_refused_before_any_download(tmp_path, models, name):
    """It was refused only once every model was downloaded and resolved."""
    emb = make_repo("org/emb")
    emb.refs["feature/x"] = emb.main
    with FakeHub([make_repo("org/cls"), emb]) as hub:
        result = run_plan(models, tmp_path, HF_ENDPOINT=hub.endpoint)
        asked = hub.seen()
    assert one_error_line(result) == (
        f"error: two models are named {name!r} (an alias, or a folder's or Hub id's name): "
        "give each a name of its own (ALIAS=MODEL)"
    )
    assert asked == []


class WebPage(BaseHTTPRequestHandler):
    """What HF_ENDPOINT set to a web site, or a proxy's login form, answers."""

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        page = b"<html><body>Sign in to continue</body></html>"
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(page)))
        self.end_headers()
        self.wfile.write(page)

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002
        pass


def test_an_endpoint_that_is_not_the_hub_is_named(tmp_path):
    """It answered 'could not resolve org/tiny: JSONDecodeError'."""
    with ThreadingHTTPServer(("127.0.0.1", 0), WebPage) as page:
        threading.Thread(target=page.serve_forever, daemon=True).start()
        endpoint = f"http://127.0.0.1:{page.server_address[1]}"
        line = one_error_line(run_resolve("org/tiny", tmp_path, HF_ENDPOINT=endpoint))
        page.shutdown()
    assert line == (
        f"error: {endpoint} answered for org/tiny with something other than the Hub's API "
        "(not JSON): check HF_ENDPOINT, or a proxy in the way"
    )


def test_an_endpoint_answering_404_not_as_the_hub_is_named_and_the_cache_serves(tmp_path):
    """HF_ENDPOINT at a wrong path of a web server or a proxy (nginx, Artifactory) answers
    a bare 404, without the Hub's X-Error-Code: huggingface_hub reads it as the Hub
    failing. The cache served without a word (a branch moved on, served stale for ever),
    and with nothing cached the start said "the Hub answered 404", naming no setting."""
    repo = make_repo()
    with FakeHub([repo]) as hub:
        wrong = hub.endpoint + "/mirror"  # the stand-in has no such path: a bare 404
        line = one_error_line(run_resolve("org/tiny", tmp_path, HF_ENDPOINT=wrong))
        folder = resolved(run_resolve("org/tiny", tmp_path, HF_ENDPOINT=hub.endpoint))
        result = run_resolve("org/tiny", tmp_path, HF_ENDPOINT=wrong)
    says = (
        f"{wrong} answered 404 for org/tiny without the Hub's error code (a path that is not "
        "the Hub's API): check HF_ENDPOINT, or a proxy in the way"
    )
    assert line == f"error: {says}"
    assert resolved(result) == folder, result.stderr
    assert f"{says}; serving its snapshot {repo.main}, found in the cache" in result.stderr


class RedirectLoop(BaseHTTPRequestHandler):
    """An endpoint (a misconfigured proxy) that sends every request back to itself."""

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        self.send_response(302)
        self.send_header("Location", self.path)
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_HEAD = do_GET

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002
        pass


def resolve_behind(
    endpoint_class: type[BaseHTTPRequestHandler], spec: str, home: Path
) -> subprocess.CompletedProcess[str]:
    """`run_resolve` of `spec` with HF_ENDPOINT at a server answering as `endpoint_class`."""
    with ThreadingHTTPServer(("127.0.0.1", 0), endpoint_class) as other:
        threading.Thread(target=other.serve_forever, daemon=True).start()
        endpoint = f"http://127.0.0.1:{other.server_address[1]}"
        try:
            return run_resolve(spec, home, HF_ENDPOINT=endpoint)
        finally:
            other.shutdown()


@pytest.mark.parametrize("endpoint_class", [WebPage, RedirectLoop], ids=["web-page", "loop"])
def test_an_endpoint_that_does_not_answer_as_the_hub_leaves_the_cache_served(
    tmp_path, endpoint_class
):
    """With the model cached, such an endpoint stopped the start: huggingface_hub serves
    the cache where the Hub cannot be reached or answers an error, but not where its API
    answers a page or redirects without end."""
    repo = make_repo()
    with FakeHub([repo]) as hub:
        folder = resolved(run_resolve("org/tiny", tmp_path, HF_ENDPOINT=hub.endpoint))
    result = resolve_behind(endpoint_class, "org/tiny", tmp_path)
    assert resolved(result) == folder, result.stderr
    assert "Traceback" not in result.stderr
    [line] = [line for line in result.stderr.splitlines() if "found in the cache" in line]
    assert f"serving its snapshot {repo.main}, found in the cache" in line
    assert ("not JSON" if endpoint_class is WebPage else "redirects") in line


def test_a_branch_deleted_on_the_hub_stops_the_start_though_it_is_cached(tmp_path):
    """The Hub's 404 for a revision is its error and httpx's too: a first version of the
    cache standing in for the Hub took it for a failed download and served the deleted
    branch's snapshot from the cache."""
    repo = make_repo()
    repo.add_commit(FILES, refs=("dev",))
    with FakeHub([repo]) as hub:
        resolved(run_resolve("org/tiny@dev", tmp_path, HF_ENDPOINT=hub.endpoint))
        del repo.refs["dev"]
        line = one_error_line(run_resolve("org/tiny@dev", tmp_path, HF_ENDPOINT=hub.endpoint))
    assert "has no revision 'dev'" in line, line


def test_a_network_that_drops_mid_download_is_one_line_and_each_retry_one_log_line(tmp_path):
    with FakeHub([make_repo()], cut_downloads=True) as hub:
        result = run_resolve("org/tiny", tmp_path, HF_ENDPOINT=hub.endpoint)
    line = one_error_line(result)
    assert "could not download org/tiny" in line and "peer closed connection" in line
    # huggingface_hub's retries are logged through the server's handler alone, never
    # written a second time bare (which would break --log-format json)
    retries = [text for text in result.stderr.splitlines() if "Error while downloading" in text]
    assert retries and all(text.startswith("huggingface_hub.") for text in retries)


@pytest.mark.parametrize(("changed", "served"), [(1, True), (2, False)])
def test_a_download_whose_bytes_differ_from_its_hash_is_never_served(tmp_path, changed, served):
    """huggingface_hub checks sizes only: weights with one byte changed on the way were
    kept in the cache and served, answering wrong at every start after. Downloaded
    again once; changed twice, the start stops and the cache keeps no such blob."""
    with FakeHub([make_repo()], changed=changed) as hub:
        result = run_resolve("org/tiny", tmp_path, HF_ENDPOINT=hub.endpoint)
    assert "model.safetensors did not match the hash the Hub named" in result.stderr
    if served:
        folder = resolved(result)
        assert (folder / "model.safetensors").read_bytes() == FILES["model.safetensors"]
    else:
        line = one_error_line(result)
        assert "downloaded twice" in line and "HF_ENDPOINT" in line
        blobs = list((tmp_path / "hub").rglob("blobs/*"))
        assert blobs and all(hashes_to_its_name(blob) for blob in blobs)


@pytest.mark.parametrize(
    ("named_by", "kept"),
    [
        (lambda data: hashlib.sha256(data).hexdigest(), True),  # the Hub's for LFS files
        (lambda data: hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest(), True),  # git's
        (lambda data: hashlib.sha1(data).hexdigest(), True),  # a mirror's plain sha1
        (lambda data: hashlib.sha256(data + b"!").hexdigest(), False),
        (lambda data: hashlib.sha1(data + b"!").hexdigest(), False),
        (lambda data: "model-weights", True),  # a name of no hash's form: nothing to check
    ],
)
def test_a_cached_blob_is_kept_where_its_bytes_hash_to_its_name(tmp_path, named_by, kept):
    """A blob whose bytes differ from its name's hash (cut short, corrupted) is never
    served; one named by any hash the Hub or a mirror uses is."""
    data = b"weights" * 1000
    blob = tmp_path / named_by(data)
    blob.write_bytes(data)
    assert hashes_to_its_name(blob) is kept


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT])
def test_a_disk_that_fills_while_downloading_names_the_hub_cache(tmp_path, monkeypatch, code):
    """It said "[Errno 28] No space left on device", naming no folder. (Filled for real,
    a small tmpfs as HF_HUB_CACHE, the download fails with this same OSError.)"""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    line = explain(OSError(code, os.strerror(code)), "org/tiny", None)
    assert line.startswith(f"could not download org/tiny: the Hub cache's disk is full ({tmp_path}")
    assert f"[Errno {code}] {os.strerror(code)}" in line and "set HF_HUB_CACHE" in line


def test_a_listed_file_the_hub_does_not_serve_is_named(tmp_path):
    """Its 404 read "the Hub answered 404 for org/tiny", as though the repo were missing."""
    with FakeHub([make_repo()], missing=frozenset({"tokenizer.json"})) as hub:
        line = one_error_line(run_resolve("org/tiny", tmp_path, HF_ENDPOINT=hub.endpoint))
    assert "the Hub has no tokenizer.json in org/tiny" in line, line


def test_a_branch_whose_new_commit_is_partly_cached_serves_its_whole_earlier_snapshot(
    tmp_path,
):
    """huggingface_hub moves the ref before it downloads: main moved on, its new commit's
    download stopped, left every later start the Hub could not serve failing ("only
    partly in the Hub cache"), the earlier snapshot whole beside it."""
    with FakeHub([make_repo()]) as hub:
        earlier = resolved(run_resolve("org/tiny", tmp_path, HF_ENDPOINT=hub.endpoint))
    storage = tmp_path / "hub" / "models--org--tiny"
    moved_on = "f" * 40
    (storage / "refs" / "main").write_text(moved_on)
    (storage / "snapshots" / moved_on).mkdir()
    (storage / "snapshots" / moved_on / "config.json").symlink_to(earlier / "config.json")
    # (its listing is written before its files, as the first look at the new commit did)
    listing = (storage / "trees" / f"{earlier.name}.json").read_text()
    (storage / "trees" / f"{moved_on}.json").write_text(listing)
    result = run_resolve("org/tiny", tmp_path, HF_HUB_OFFLINE="1")
    assert resolved(result) == earlier
    assert f"serving the whole earlier snapshot {earlier.name}" in result.stderr
    # an endpoint answering in the Hub's place too (a first version tried the new
    # commit's snapshot alone there, and stopped the start)
    for endpoint_class in (WebPage, RedirectLoop):
        result = resolve_behind(endpoint_class, "org/tiny", tmp_path)
        assert resolved(result) == earlier, result.stderr
        assert f"serving the whole earlier snapshot {earlier.name}" in result.stderr
    # a commit asked for by its id: nothing else stands in for it
    line = one_error_line(run_resolve(f"org/tiny@{moved_on}", tmp_path, HF_HUB_OFFLINE="1"))
    assert f"org/tiny@{moved_on} is not in the Hub cache" in line
    # nor for a branch or tag the cache never held (`@mian` was served main's earlier)
    line = one_error_line(run_resolve("org/tiny@mian", tmp_path, HF_HUB_OFFLINE="1"))
    assert "org/tiny@mian is not in the Hub cache" in line and "serving" not in line, line
    # a stray file among the refs, and a pin a start by a short commit left, are no
    # branches: the earlier snapshot serves beside them
    (storage / "refs" / ".DS_Store").write_bytes(b"\x00\x05\x16\x07\xff\xfe")
    (storage / "refs" / earlier.name[:7]).write_text(earlier.name)
    result = run_resolve("org/tiny", tmp_path, HF_HUB_OFFLINE="1")
    assert resolved(result) == earlier, result.stderr
    # what another branch names now is that branch's model, not main's earlier one
    (storage / "refs" / "dev").write_text(earlier.name)
    line = one_error_line(run_resolve("org/tiny", tmp_path, HF_HUB_OFFLINE="1"))
    assert "serving" not in line and earlier.name not in line, line


def test_a_file_forgotten_deletes_the_caches_blob_and_never_a_file_linked_from_elsewhere(
    tmp_path,
):
    """A file cut short is forgotten to be downloaded again: the cache's own blob goes,
    and where a snapshot's file was linked by hand to the user's own copy, only the link
    does (deleting what it links to would lose the user's file)."""
    repo = tmp_path / "models--org--name"
    blobs, snapshot = repo / "blobs", repo / "snapshots" / ("a" * 40)
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    (blobs / ("b" * 64)).write_bytes(b"cached")
    os.symlink(os.path.relpath(blobs / ("b" * 64), snapshot), snapshot / "model.safetensors")
    own = tmp_path / "elsewhere" / "config.json"
    own.parent.mkdir()
    own.write_text("{}")
    os.symlink(own, snapshot / "config.json")
    forget(snapshot, ["model.safetensors", "config.json"])
    assert not (blobs / ("b" * 64)).exists()
    assert not os.path.lexists(snapshot / "model.safetensors")
    assert not os.path.lexists(snapshot / "config.json")
    assert own.read_text() == "{}"


def test_a_cached_file_cut_short_is_downloaded_again_and_named_offline(tmp_path):
    """A blob cut short in the cache (a disk filled) was taken by every later download as
    done: each start refused the model, and --download-only said all was well."""
    with FakeHub([make_repo()]) as hub:
        folder = resolved(run_resolve("org/tiny", tmp_path, HF_ENDPOINT=hub.endpoint))
        weights = folder / "model.safetensors"
        whole = weights.read_bytes()
        os.truncate(weights.resolve(), 10)
        result = run_resolve("org/tiny", tmp_path, HF_ENDPOINT=hub.endpoint)
        assert resolved(result) == folder and weights.read_bytes() == whole
        assert "model.safetensors in the Hub cache is shorter than the Hub lists" in result.stderr
    os.truncate(weights.resolve(), 10)  # offline: named, nothing deleted, and it stops
    line = one_error_line(run_resolve("org/tiny", tmp_path, HF_HUB_OFFLINE="1"))
    assert "model.safetensors in the Hub cache is shorter than the Hub lists" in line, line
    assert weights.stat().st_size == 10
    # a file longer than listed is one edited by hand, or a link to one's own copy: kept
    own = tmp_path / "my_tokenizer.json"
    own.write_text('{"edited": "by hand, longer than the listing"}')
    (folder / "tokenizer.json").unlink()
    (folder / "tokenizer.json").symlink_to(own)
    os.truncate(weights.resolve(), 0)
    with FakeHub([make_repo()]) as hub:
        assert resolved(run_resolve("org/tiny", tmp_path, HF_ENDPOINT=hub.endpoint)) == folder
    assert own.is_file() and (folder / "tokenizer.json").resolve() == own
    assert weights.read_bytes() == whole


def test_a_partly_downloaded_snapshot_is_named_as_such(tmp_path):
    with FakeHub([make_repo()]) as hub:
        folder = resolved(run_resolve("org/tiny", tmp_path, HF_ENDPOINT=hub.endpoint))
    (folder / "tokenizer.json").unlink()
    line = one_error_line(run_resolve("org/tiny", tmp_path, HF_HUB_OFFLINE="1"))
    assert "only partly in the Hub cache" in line


def sentence_folder(tmp_path, modules, pooling, prompts=None, dense=None):
    """A sentence-transformers folder's files: `modules` as (type's last name, path), each
    Dense module's config `dense` (or a 32 → 16 tanh), with a weights file."""
    folder = tmp_path / "sentence"
    folder.mkdir()
    for name in ("config.json", "tokenizer.json", "model.safetensors"):
        (folder / name).write_text('{"architectures": ["BertModel"]}')
    listed = [
        {"idx": i, "name": str(i), "path": path, "type": f"sentence_transformers.models.{kind}"}
        for i, (kind, path) in enumerate(modules)
    ]
    (folder / "modules.json").write_text(json.dumps(listed))
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    if prompts is not None:
        (folder / "config_sentence_transformers.json").write_text(json.dumps({"prompts": prompts}))
    for kind, path in modules:
        if kind == "Dense":
            (folder / path).mkdir()
            (folder / path / "config.json").write_text(json.dumps(dense or DENSE))
            (folder / path / "model.safetensors").write_bytes(b"")
    return folder


ST_MODULES = [("Transformer", ""), ("Pooling", "1_Pooling"), ("Normalize", "2_Normalize")]
DENSE = {
    "in_features": 32,
    "out_features": 16,
    "activation_function": "torch.nn.modules.activation.Tanh",
}
WITH_DENSE = [*ST_MODULES[:2], ("Dense", "2_Dense"), ("Normalize", "3_Normalize")]


@pytest.mark.parametrize(
    ("pooling", "mode"),
    [
        ({"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False}, "cls"),
        ({"pooling_mode_mean_tokens": True}, "mean"),
        ({"pooling_mode_max_tokens": True}, "max"),
        ({"pooling_mode_mean_sqrt_len_tokens": True}, "mean_sqrt_len_tokens"),
        ({"pooling_mode_weightedmean_tokens": True}, "weightedmean"),
        ({"pooling_mode_lasttoken": True}, "lasttoken"),
        ({"pooling_mode": "cls"}, "cls"),  # sentence-transformers 6 names the mode
        ({"pooling_mode": "lasttoken", "include_prompt": True}, "lasttoken"),
        ({"pooling_mode": ["max"]}, "max"),
    ],
)
def test_a_sentence_transformers_folder_s_pooling_is_read_in_either_form(tmp_path, pooling, mode):
    facts = plan_models([str(sentence_folder(tmp_path, ST_MODULES, pooling))])[0].facts
    assert (facts.pooling, facts.normalize) == (mode, True)


@pytest.mark.parametrize(
    ("modules", "pooling", "prompts", "reason"),
    [
        (
            [*ST_MODULES[:2], ("LayerNorm", "2_LayerNorm"), ("Normalize", "3_Normalize")],
            {"pooling_mode": "mean"},
            None,
            "its sentence-transformers module LayerNorm (2_LayerNorm) is not served",
        ),
        (
            [*ST_MODULES, ("Dense", "3_Dense")],
            {"pooling_mode": "mean"},
            None,
            "its sentence-transformers module Dense (3_Dense) comes after Normalize",
        ),
        (
            [("Transformer", ""), ("Dense", "1_Dense")],
            {"pooling_mode": "mean"},
            None,
            "its Dense module has no Pooling before it",
        ),
        (
            [("Transformer", "0_Transformer"), ("Pooling", "1_Pooling")],
            {"pooling_mode": "mean"},
            None,
            "its transformer is in 0_Transformer/, not the folder's root",
        ),
        (ST_MODULES, {"pooling_mode": ["cls", "mean"]}, None, "its pooling cls+mean is not"),
        (
            ST_MODULES,
            {"pooling_mode_cls_token": True, "pooling_mode_max_tokens": True},
            None,
            "its pooling cls+max is not served",
        ),
        (ST_MODULES, {"pooling_mode": "splade"}, None, "its pooling splade is not served"),
        (ST_MODULES, {}, None, "its pooling names no mode: one of cls, "),
        (
            ST_MODULES,
            {"pooling_mode": "mean", "include_prompt": False},
            {"query": "query: "},
            "its pooling leaves its prompts out",
        ),
    ],
)
def test_a_sentence_transformers_folder_rawserve_would_answer_otherwise_is_refused(
    tmp_path, modules, pooling, prompts, reason
):
    """Its vectors would not be the model's: refused before any worker starts, saying why."""
    folder = sentence_folder(tmp_path, modules, pooling, prompts)
    with pytest.raises(ModelNotFound) as caught:
        plan_models([str(folder)])
    assert str(caught.value).startswith(f"model {folder}: {reason}")


@pytest.mark.parametrize(
    ("name", "field"),
    [
        ("tokenizer_config.json", "model_max_length"),
        ("sentence_bert_config.json", "max_seq_length"),
    ],
)
@pytest.mark.parametrize("value", [-1, 0, True, "long", 2.5, 64.0])
def test_a_token_count_that_is_no_count_is_refused_at_start_naming_its_file(
    tmp_path, name, field, value
):
    """-1 was taken as the length (every request a 500), 0 refused every input, true was
    said to clients as the model's length."""
    folder = sentence_folder(tmp_path, ST_MODULES, {"pooling_mode": "mean"})
    path = folder / name
    document = json.loads(path.read_text()) if path.is_file() else {}
    path.write_text(json.dumps({**document, field: value}))
    with pytest.raises(ModelNotFound, match=f"its {name} sets {field} to .*not a positive whole"):
        plan_models([str(folder)])
    for taken in (128, 1e30, int(1e30), 10**400, None):  # (1e30: transformers' "no limit")
        path.write_text(json.dumps({**document, field: taken}))
        assert plan_models([str(folder)])[0].facts.task == "feature-extraction"


def test_a_pooling_module_without_its_config_is_refused_saying_so(tmp_path):
    folder = sentence_folder(tmp_path, ST_MODULES, {"pooling_mode": "mean"})
    (folder / "1_Pooling" / "config.json").unlink()
    with pytest.raises(ModelNotFound, match="its Pooling module has no 1_Pooling/config.json"):
        plan_models([str(folder)])


@pytest.mark.parametrize("listed", [{"0": "Transformer"}, [1, 2], "modules"])
def test_a_modules_json_that_lists_no_modules_is_refused_saying_so(tmp_path, listed):
    """It was "the model's files are unreadable (AttributeError)"."""
    folder = sentence_folder(tmp_path, ST_MODULES, {"pooling_mode": "mean"})
    (folder / "modules.json").write_text(json.dumps(listed))
    with pytest.raises(ModelNotFound, match="its modules.json is not a list of modules"):
        plan_models([str(folder)])


def test_a_sentence_transformers_folder_s_dense_layers_are_read_in_order(tmp_path):
    """LaBSE's and distiluse's modules: a Dense layer on the pooled vector, which may
    change its size; /info lists them (and a chain of two must fit together)."""
    modules = [*WITH_DENSE[:3], ("Dense", "3_Dense"), ("Normalize", "4_Normalize")]
    config = {"in_features": 16, "out_features": 16, "bias": False}  # tanh: the default
    folder = sentence_folder(tmp_path, modules, {"pooling_mode": "cls"}, dense=DENSE)
    (folder / "3_Dense" / "config.json").write_text(json.dumps(config))
    facts = plan_models([str(folder)])[0].facts
    assert (facts.pooling, facts.normalize) == ("cls", True)
    assert [(d.path, d.in_features, d.out_features, d.bias, d.activation) for d in facts.dense] == [
        ("2_Dense", 32, 16, True, "Tanh"),
        ("3_Dense", 16, 16, False, "Tanh"),
    ]
    (folder / "3_Dense" / "config.json").write_text(json.dumps({**config, "in_features": 32}))
    with pytest.raises(ModelNotFound, match="takes 32 numbers where the one before it gives 16"):
        plan_models([str(folder)])


@pytest.mark.parametrize(
    ("dense", "reason"),
    [
        ({**DENSE, "activation_function": "my_module.Swish"}, "has the activation my_module.Swish"),
        ({**DENSE, "activation_function": "torch.nn.modules.activation.Softmax"}, "Softmax"),
        ({**DENSE, "module_input_name": "token_embeddings"}, "reads or writes token_embeddings"),
        ({"out_features": 16}, "names no in_features and out_features"),
        ({**DENSE, "in_features": "32"}, "names no in_features and out_features"),
        # sentence-transformers fails on both: not Tanh, its default
        ({**DENSE, "activation_function": None}, "has the activation None"),
        ({**DENSE, "activation_function": "torch.nn.nonexistent.Tanh"}, "torch.nn.nonexistent"),
    ],
)
def test_a_dense_module_rawserve_would_compute_otherwise_is_refused(tmp_path, dense, reason):
    folder = sentence_folder(tmp_path, WITH_DENSE, {"pooling_mode": "cls"}, dense=dense)
    with pytest.raises(ModelNotFound) as caught:
        plan_models([str(folder)])
    assert str(caught.value).startswith(f"model {folder}: its Dense module (2_Dense) ")
    assert reason in str(caught.value)


@pytest.mark.parametrize(
    ("path", "reason"),
    [
        ("/etc/rawserve_dense", "its sentence-transformers module's path /etc/rawserve_dense is"),
        ("../../outside", "its sentence-transformers module's path ../../outside is outside"),
        ("2_Dense/../../x", "is outside its folder"),
    ],
)
def test_a_module_outside_the_model_s_folder_is_refused(tmp_path, path, reason):
    """A repo's modules.json made the server read files anywhere on the machine."""
    folder = sentence_folder(tmp_path, WITH_DENSE, {"pooling_mode": "cls"})
    modules = json.loads((folder / "modules.json").read_text())
    modules[2]["path"] = path
    (folder / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ModelNotFound, match=re.escape(reason)):
        plan_models([str(folder)])


def test_another_package_s_module_of_a_served_name_is_refused(tmp_path):
    folder = sentence_folder(tmp_path, WITH_DENSE, {"pooling_mode": "cls"})
    modules = json.loads((folder / "modules.json").read_text())
    modules[2]["type"] = "mypackage.Dense"
    (folder / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ModelNotFound, match=re.escape("module mypackage.Dense (2_Dense) is not")):
        plan_models([str(folder)])


def test_a_dense_module_without_its_config_is_refused_naming_it(tmp_path):
    """It was said to be the model's own config.json that was missing."""
    folder = sentence_folder(tmp_path, WITH_DENSE, {"pooling_mode": "cls"})
    (folder / "2_Dense" / "config.json").unlink()
    with pytest.raises(ModelNotFound, match=re.escape("its Dense module (2_Dense) has no config")):
        plan_models([str(folder)])


def test_a_dense_module_without_its_weights_is_refused_at_start(tmp_path):
    folder = sentence_folder(tmp_path, WITH_DENSE, {"pooling_mode": "cls"})
    (folder / "2_Dense" / "model.safetensors").unlink()
    with pytest.raises(ModelNotFound, match=r"\(2_Dense\) holds no weights"):
        plan_models([str(folder)])
    (folder / "2_Dense" / "pytorch_model.bin").write_bytes(b"")  # an older save's: served
    assert plan_models([str(folder)])[0].facts.dense[0].path == "2_Dense"


@pytest.mark.parametrize(
    ("config", "default"),
    [
        ({"prompts": {"query": "query: "}, "default_prompt_name": "query"}, "query"),
        ({"prompts": {"query": "query: "}, "default_prompt_name": "passage"}, None),
        ({"prompts": {}, "default_prompt_name": "query"}, None),
        ({"default_prompt_name": "query"}, None),
        ({"prompts": {"query": "query: "}, "default_prompt_name": None}, None),
    ],
)
def test_a_default_prompt_is_one_the_folder_names(tmp_path, config, default):
    """The prompt put before every text sent without a prompt_name: a default naming no
    prompt of the folder's puts none (read as a name, every such request was refused
    as asking for a prompt the model does not have)."""
    (tmp_path / "config_sentence_transformers.json").write_text(json.dumps(config))
    assert sentence_transformers_default_prompt(tmp_path) == default


@pytest.mark.parametrize(
    ("name", "text", "fault"),
    [
        ("config.json", '{"architectures": ["BertModel"],}', "is not valid JSON (Expecting"),
        ("config.json", "", "is not valid JSON (Expecting value: line 1 column 1"),
        ("config.json", '["BertModel"]', "is not a JSON object"),
        ("config.json", b'{"a": "\xe9"}', "is not valid JSON ('utf-8' codec"),
        ("modules.json", '[{"type": "Transformer"', "is not valid JSON (Expecting"),
        ("1_Pooling/config.json", "{'pooling_mode': 'cls'}", "is not valid JSON (Expecting"),
        # a chat template added by hand: the worker failed on json's words alone, naming no file
        ("tokenizer_config.json", '{"chat_template": "{{ x }}",}', "is not valid JSON (Expect"),
        ("generation_config.json", '{"temperature": .7}', "is not valid JSON (Expecting"),
        # a download cut short: each worker failed on json's words alone, naming no file,
        # after an ONNX export that failed on it too
        ("tokenizer.json", '{"version": "1.0", "trunc', "is not valid JSON (Unterminated"),
    ],
)
def test_a_model_file_that_is_not_json_is_named_with_its_fault(tmp_path, name, text, fault):
    """A config edited by hand: the line names the file and where it breaks, where it
    said only \"the model's files are unreadable (JSONDecodeError)\"."""
    folder = sentence_folder(tmp_path, ST_MODULES, {"pooling_mode": "cls"})
    if name == "config.json":  # where the task is read from
        (folder / "modules.json").unlink()
    file = folder / name
    file.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(ModelNotFound) as caught:
        plan_models([str(folder)])
    assert str(caught.value).startswith(f"model {folder}: {file} {fault}")


def test_a_model_s_files_are_read_as_utf_8_whatever_the_locale(tmp_path, ascii_locale):
    """JSON is UTF-8: labels, names and paths beyond ASCII (a multilingual classifier's)
    are read in an ASCII locale too, not refused as undecodable."""
    classifier = tmp_path / "classifier"
    classifier.mkdir()
    config = {"architectures": ["BertForSequenceClassification"], "id2label": {"0": "négatif"}}
    tokenizer = {"tokenizer_class": "ByT5Tokenizer", "name_or_path": "équipe/modèle"}
    for name, document in (("config.json", config), ("tokenizer_config.json", tokenizer)):
        (classifier / name).write_text(json.dumps(document, ensure_ascii=False), "utf-8")
    (classifier / "model.safetensors").write_bytes(b"")
    sentence = sentence_folder(tmp_path, ST_MODULES, {"pooling_mode": "cls"})
    modules = json.loads((sentence / "modules.json").read_text("utf-8"))
    modules[0]["name"] = "modèle"
    (sentence / "modules.json").write_text(json.dumps(modules, ensure_ascii=False), "utf-8")
    plans = plan_models([str(classifier), str(sentence)])
    assert [plan.facts.task for plan in plans] == ["text-classification", "feature-extraction"]
    assert plans[1].facts.pooling == "cls"


@pytest.mark.parametrize("name", ["model.safetensors", "config.json"])
def test_a_cached_file_whose_blob_is_gone_is_named_at_start(tmp_path, name):
    # the snapshot is whole, so huggingface_hub resolves it offline; the file links to nothing
    repo = make_repo()
    storage = write_hub_cache(tmp_path, repo)
    link = storage / "snapshots" / repo.main / name
    link.resolve().unlink()
    with pytest.raises(ModelNotFound) as caught:
        plan_models([str(link.parent)])
    assert f": {name} links to ../../blobs/" in str(caught.value)
    assert "which is missing: download the model again" in str(caught.value)


def test_only_the_files_a_model_reads_are_looked_at_for_links_to_nothing(tmp_path):
    """A folder's tree was walked whole: `--model /usr` took 6 s to be refused over a
    JDK's link, and a link to nothing in a folder never read refused the model."""
    from tests.tiny_models import build

    model = build("text-classification", tmp_path / "cls")
    (model / "unread").mkdir()
    (model / "unread" / "gone").symlink_to(tmp_path / "nowhere")
    (model / "tf_model.h5").symlink_to(tmp_path / "nowhere")  # at the top: looked at
    with pytest.raises(ModelNotFound, match="tf_model.h5 links to"):
        plan_models([str(model)])
    (model / "tf_model.h5").unlink()
    assert plan_models([str(model)])[0].facts.task == "text-classification"
    for name in ("onnx/model.onnx", "additional_chat_templates/tool_use.jinja"):
        (model / name).parent.mkdir()
        (model / name).symlink_to(tmp_path / "nowhere")
        with pytest.raises(ModelNotFound, match=f"{name} links to"):
            plan_models([str(model)])
        (model / name).unlink()


def test_an_alias_that_hides_another_models_folder_name_is_said_at_start(caplog):
    """`--model a=./cls --model cls=./emb`: requests by the first's folder name reach the
    second model (its alias), and the start said nothing of it (a tester)."""
    from rawserve.models.plan import ModelPlan, _unique_names

    plans = [
        ModelPlan(("a", "cls"), "/m/cls", "/m/cls"),
        ModelPlan(("cls", "emb"), "/m/emb", "/m/emb"),
    ]
    with caplog.at_level("WARNING", logger="rawserve"):
        kept = _unique_names(plans)
    assert [plan.names for plan in kept] == [("a",), ("cls", "emb")]
    assert "model a is not also named 'cls': that is another model's alias" in caplog.text


def test_an_alias_that_is_another_models_folder_name_is_refused_in_words_that_fit():
    """`--model text-classification=./emb --model ./text-classification`: the advice was to
    give each an alias, though one had it (a tester)."""
    from rawserve.models.plan import ModelPlan, _unique_names

    plans = [
        ModelPlan(("text-classification", "emb"), "/m/emb", "/m/emb"),
        ModelPlan(("text-classification",), "/m/tc", "/m/tc"),
    ]
    with pytest.raises(ModelNotFound) as refused:
        _unique_names(plans)
    assert str(refused.value) == (
        "two models are named 'text-classification' (an alias, or a folder's or Hub id's "
        "name): give each a name of its own (ALIAS=MODEL)"
    )


def test_a_files_head_waits_the_etag_timeout_whatever_it_was_given(monkeypatch):
    """huggingface_hub asks a file's HEAD again with 60 s of its own: a Hub whose HEADs
    never answered held a start 6.5 minutes with HF_HUB_ETAG_TIMEOUT at 10."""
    from huggingface_hub import constants

    from rawserve.models.hub import bounded_waits

    monkeypatch.setattr(constants, "HF_HUB_ETAG_TIMEOUT", 10)
    given = {"connect": 60.0, "read": 60.0, "write": 5.0, "pool": None}
    for method, expected in (
        ("HEAD", {"connect": 10.0, "read": 10.0, "write": 5.0, "pool": 10.0}),
        ("GET", {"connect": 60.0, "read": 60.0, "write": 5.0, "pool": 10.0}),  # a download
    ):
        request = httpx2.Request(method, "http://hub/org/tiny/resolve/main/config.json")
        request.extensions["timeout"] = dict(given)
        bounded_waits(request)
        assert request.extensions["timeout"] == expected


@pytest.mark.parametrize(
    ("headers", "kept"),
    [
        ({"Retry-After": "3600"}, False),
        ({"RateLimit": '"api";r=0;t=3600'}, False),
        ({"Retry-After": "5"}, True),  # waited, as asked
        ({"RateLimit": '"api";r=3;t=3600'}, True),  # requests left: no wait asked for
        ({"Retry-After": "Wed, 21 Oct 2026 07:28:00 GMT"}, True),  # a date: not read by it
    ],
)
def test_a_wait_the_hub_asks_for_past_the_bound_is_not_taken(headers, kept, caplog):
    from huggingface_hub.utils import parse_ratelimit_headers

    from rawserve.models.hub import bounded_retry_after

    response = httpx2.Response(429, headers=headers)
    with caplog.at_level("WARNING", logger="rawserve.models"):
        bounded_retry_after(response)
    assert (dict(response.headers) == {k.lower(): v for k, v in headers.items()}) is kept
    assert bool(caplog.records) is not kept
    if not kept:
        assert parse_ratelimit_headers(response.headers) is None
        assert "asks to wait 3600 s before trying again: not waited" in caplog.text
    answered = httpx2.Response(200, headers=headers)  # a success is never tried again
    bounded_retry_after(answered)
    assert dict(answered.headers) == {k.lower(): v for k, v in headers.items()}
