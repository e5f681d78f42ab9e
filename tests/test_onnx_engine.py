"""The ONNX Runtime engine: which engine runs a task, answers equal to torch's within 1e-4
for every encoder task (tiny models and the packaged MiniLM), the export made once and
cached, a model's own graph used as shipped, and the engine named in /info."""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from rawserve.shared.messages import EMBEDDING_ROUTE, NO_CONTROL, Control, Engine, WorkerConfig
from tests.server import RunningServer, running_together

pytest.importorskip("onnxruntime", reason="the onnx extra is not installed")

TOLERANCE = 1e-4
CONTEXT = "john lives in paris and mary lives in london"

# (model kind, task, inputs, parameters): what each encoder task is asked
CASES = [
    ("feature-extraction", "feature-extraction", ["hello world", "the movie was good"], {}),
    ("feature-extraction", "feature-extraction", ["hello world", "a"], {"pooling": "mean"}),
    (
        "feature-extraction",
        "feature-extraction",
        ["hello world", "bad film"],
        EMBEDDING_ROUTE,  # the embedding routes' control, and no parameters
    ),
    ("text-classification", "text-classification", ["i like it", "bad movie"], {}),
    ("text-classification", "text-classification", ["i like it", "bad"], {"top_k": 2}),
    (
        "text-classification",
        "text-classification",
        [{"text": "i like it", "text_pair": "it is good"}, {"text": "bad"}],
        {"function_to_apply": "sigmoid"},
    ),
    ("token-classification", "token-classification", ["john lives in paris", "hello"], {}),
    (
        "token-classification",
        "token-classification",
        ["john lives in paris", "mary"],
        {"aggregation_strategy": "simple"},
    ),
    ("fill-mask", "fill-mask", ["paris is the [MASK]", "the [MASK] movie"], {"top_k": 3}),
    (
        "zero-shot-classification",
        "zero-shot-classification",
        ["i like this film", "paris"],
        {"candidate_labels": ["movie", "city"], "multi_label": True},
    ),
    (
        "question-answering",
        "question-answering",
        [
            {"question": "who lives in paris", "context": CONTEXT},
            {"question": "where", "context": "hello world"},
        ],
        {"top_k": 2},
    ),
]


@pytest.fixture(scope="module")
def onnx_cache(monkeypatch_module):
    """Kept between test runs on this machine: the tiny models are built the same each
    time, so their graphs (keyed by content) are exported once, not on every run."""
    folder = Path(tempfile.gettempdir()) / "rawserve-test-cache"
    monkeypatch_module.setenv("RAWSERVE_CACHE_DIR", str(folder))
    return folder / "onnx"


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


@pytest.fixture(scope="module")
def runners(tiny_model, onnx_cache):
    from rawserve.worker.loading import load_runner

    loaded = {}

    def get(kind: str, task: str, engine: Engine, model: str | None = None):
        key = (kind, task, engine)
        if key not in loaded:
            config = WorkerConfig(
                model=model or tiny_model(kind), task=task, dtype="float32", engine=engine
            )
            loaded[key] = load_runner(config, "cpu")
        return loaded[key]

    return get


def assert_close(actual, expected, path="answer"):
    """Equal structure and text; numbers within TOLERANCE (max abs)."""
    if isinstance(expected, dict):
        assert isinstance(actual, dict) and set(actual) == set(expected), path
        for key in expected:
            assert_close(actual[key], expected[key], f"{path}.{key}")
    elif isinstance(expected, (list, tuple)):
        assert isinstance(actual, (list, tuple)) and len(actual) == len(expected), path
        for index, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_close(a, e, f"{path}[{index}]")
    elif isinstance(expected, np.ndarray):
        assert np.asarray(actual).shape == expected.shape, path
        np.testing.assert_allclose(actual, expected, rtol=0, atol=TOLERANCE, err_msg=path)
    elif isinstance(expected, (float, np.floating)):
        assert abs(float(actual) - float(expected)) <= TOLERANCE, path
    else:
        assert actual == expected, path


@pytest.mark.parametrize(("kind", "task", "inputs", "params"), CASES)
def test_every_encoder_task_answers_what_torch_answers(runners, kind, task, inputs, params):
    torch_runner = runners(kind, task, Engine.TORCH)
    onnx_runner = runners(kind, task, Engine.ONNX)
    assert onnx_runner.engine is Engine.ONNX and torch_runner.engine is Engine.TORCH
    control = params if isinstance(params, Control) else NO_CONTROL
    params = {} if isinstance(params, Control) else params
    expected = torch_runner.run(list(inputs), dict(params), control)
    assert_close(onnx_runner.run(list(inputs), dict(params), control), expected)
    # one at a time (other shapes than the batch's) and on every core: the same answers
    onnx_runner.set_threads(2)
    try:
        alone = [onnx_runner.run([item], dict(params), control)[0] for item in inputs]
    finally:
        onnx_runner.set_threads(1)
    assert_close(alone, expected)


@pytest.mark.parametrize(
    ("engine", "message"),
    [
        (
            Engine.ONNX,
            "[ONNXRuntimeError] : 1 : FAIL : Non-zero status code returned while running Where "
            "node. Status Message: bfc_arena.cc:360 void* onnxruntime::BFCArena::"
            "AllocateRawInternal(size_t, bool, onnxruntime::Stream*) Failed to allocate memory "
            "for requested buffer of size 4294967296",
        ),
        (
            Engine.TORCH,
            "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate "
            "memory: you tried to allocate 8589934592 bytes. Error code 12 (Cannot allocate "
            "memory)",
        ),
    ],
)
def test_a_batch_too_large_for_the_cpu_s_memory_is_out_of_memory(runners, engine, message):
    """What each engine raises when a batch does not fit in RAM (read from each with a
    memory limit): out of memory, so the batch is split and the worker's cap lowered, as
    the README says of a CPU; it was "the model failed on this input", a 500 per item."""
    from onnxruntime.capi.onnxruntime_pybind11_state import Fail

    from rawserve.shared.messages import FailureKind

    runner = runners("text-classification", "text-classification", engine)
    raised = Fail(message) if engine is Engine.ONNX else RuntimeError(message)
    assert runner.describe_failure(raised).kind is FailureKind.OUT_OF_MEMORY


def test_a_gpt2_served_for_embeddings_runs_on_onnx_runtime(tiny_model, onnx_cache, caplog):
    """onnxscript's fusions made GPT-2's graph one ONNX Runtime refuses to load (a Gemm
    fused over 3-D inputs): it was served by torch only, exported again at each start.
    A fused graph that does not load is now dropped for the graph as exported."""
    from rawserve.worker.loading import load_runner
    from tests.tiny_models import worker_config

    folder = tiny_model("text-generation")
    texts = ["i like it", "the movie was very bad and i hate it"]
    answers = {}
    with caplog.at_level(logging.WARNING, logger="rawserve.onnx"):
        for engine in (Engine.TORCH, Engine.ONNX):
            config = worker_config(folder, "feature-extraction", engine=engine, threads=1)
            runner = load_runner(config, "cpu")
            assert runner.engine is engine
            answers[engine] = runner.run(texts, {})
    for onnx, torch_answer in zip(answers[Engine.ONNX], answers[Engine.TORCH], strict=True):
        np.testing.assert_allclose(onnx, torch_answer, atol=TOLERANCE)


def test_the_packaged_minilm_answers_what_torch_answers(runners):
    from rawserve.models.folder import default_model

    texts = ["A short sentence.", "A much longer sentence, " * 20, "x"]
    for params, control in (
        ({}, NO_CONTROL),
        ({"pooling": "none", "normalize": False}, NO_CONTROL),
        ({}, EMBEDDING_ROUTE),
    ):
        expected = runners("minilm", "feature-extraction", Engine.TORCH, default_model()).run(
            texts, dict(params), control
        )
        actual = runners("minilm", "feature-extraction", Engine.ONNX, default_model()).run(
            texts, dict(params), control
        )
        assert_close(actual, expected)


def test_the_export_is_made_once_and_reused(tiny_model, onnx_cache, caplog, monkeypatch):
    from rawserve.worker import onnx_engine

    folder = Path(tiny_model("text-classification"))
    head = onnx_engine.HEADS["text-classification"]
    first = onnx_engine.exported_graph(folder, head, onnx_cache)
    assert first.is_file() and (first.parent / "key.json").is_file()

    def no_export(*args):
        raise AssertionError("exported again")

    monkeypatch.setattr(onnx_engine, "export", no_export)
    with caplog.at_level(logging.INFO, logger="rawserve.onnx"):
        assert onnx_engine.exported_graph(folder, head, onnx_cache) == first
    assert "exported before" in caplog.text
    # another head of the same folder is another graph
    other = onnx_engine.HEADS["feature-extraction"]
    assert onnx_engine.cache_key(folder, other) != onnx_engine.cache_key(folder, head)


def test_the_export_keeps_its_weights_beside_the_graph_and_sessions_map_them(
    tiny_model, onnx_cache
):
    """A worker holds a session per thread count: with the weights inside the graph's
    file each session read its own copy of them (MiniLM's two: 281 MB); kept in a file
    of their own, ONNX Runtime maps them from it, and the workers share the pages."""
    from rawserve.worker import onnx_engine

    folder = Path(tiny_model("feature-extraction"))
    network = onnx_engine.load_network(str(folder), "feature-extraction", 1, onnx_cache)
    assert_weights_mapped(network.graph)


def assert_weights_mapped(graph: Path) -> None:
    """`graph`'s weights are in a file beside it, in a cache folder of its own, and this
    process maps them (ONNX Runtime's sessions share the pages)."""
    from rawserve.worker import graph_cache, onnx_engine

    weights = graph.with_name(onnx_engine.WEIGHTS_FILE)
    mapped = {line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines()}
    assert str(weights) in mapped
    assert sorted(path.name for path in graph.parent.iterdir()) == [
        "key.json",
        graph_cache.GRAPH_FILE,
        onnx_engine.WEIGHTS_FILE,
    ]


def test_a_graph_exported_from_untrained_weights_says_so_when_loaded_from_the_cache(
    tiny_model, tmp_path, monkeypatch
):
    """A classifier's checkpoint exported as fill-mask has a random masked-LM head: the
    torch load said so, and a start from the cached graph, which loads no weights, said
    nothing; the export keeps what it found beside the graph."""
    from rawserve.worker import onnx_engine

    folder = tiny_model("text-classification")
    exported = onnx_engine.load_network(folder, "fill-mask", 1, tmp_path)
    assert exported.untrained is not None and exported.untrained.model_class == "BertForMaskedLM"
    assert any(name.startswith("cls.predictions.") for name in exported.untrained.tensors)
    trained = onnx_engine.load_network(folder, "text-classification", 1, tmp_path)
    assert trained.untrained is None

    def no_export(*args):
        raise AssertionError("exported again")

    monkeypatch.setattr(onnx_engine, "export", no_export)
    cached = onnx_engine.load_network(folder, "fill-mask", 1, tmp_path)
    assert cached.untrained == exported.untrained


def test_a_model_whose_files_cannot_be_exported_is_said_so_not_the_cache(tmp_path, tiny_model):
    """Its weights missing, the export's OSError was said as "the ONNX export's cache folder
    ... cannot be written", though the cache could be."""
    from rawserve.worker import onnx_engine

    folder = tmp_path / "no-weights"
    shutil.copytree(tiny_model("text-classification"), folder)
    (folder / "model.safetensors").unlink()
    head = onnx_engine.HEADS["text-classification"]
    with pytest.raises(onnx_engine.NotExportable, match="cannot be exported to ONNX: ") as caught:
        onnx_engine.exported_graph(folder, head, tmp_path / "onnx")
    assert "cannot be written" not in str(caught.value)


def test_a_cache_folder_that_cannot_be_written_is_named_not_a_bare_os_error(
    tiny_model, tmp_path, monkeypatch, caplog
):
    """`--engine onnx` fails with the folder and the variable that moves it; `auto`
    serves with torch and says why (it said the export failed: nothing was exported)."""
    from rawserve.worker import onnx_engine
    from rawserve.worker.loading import load_runner

    (tmp_path / "a-file").write_text("")
    cache = tmp_path / "a-file" / "cache"  # not a folder: root may write anywhere else
    folder = Path(tiny_model("text-classification"))
    head = onnx_engine.HEADS["text-classification"]
    with pytest.raises(OSError) as caught:
        onnx_engine.exported_graph(folder, head, cache / "onnx")
    assert str(caught.value) == (
        f"the ONNX export's cache folder {cache / 'onnx'} cannot be written (Not a directory): "
        "set RAWSERVE_CACHE_DIR to one that can"
    )
    monkeypatch.setenv("RAWSERVE_CACHE_DIR", str(cache))
    config = WorkerConfig(model=str(folder), task="text-classification", engine=Engine.AUTO)
    with caplog.at_level(logging.WARNING):
        runner = load_runner(config, "cpu")
    assert runner.engine is Engine.TORCH
    # ONNX Runtime never ran: it said "ONNX Runtime could not load the model (OSError)"
    assert runner.engine_reason == (
        f"auto: the ONNX export could not be written to {cache / 'onnx'} (Not a directory), "
        "so ONNX Runtime never ran: RAWSERVE_CACHE_DIR names a folder that can be written"
    )
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    [warning] = [w for w in warnings if "ONNX" in w]
    assert warning.endswith(
        "cannot be written (Not a directory): set RAWSERVE_CACHE_DIR to one that can"
    )
    # on a CPU with bfloat16 units its trial's verdict cannot be kept there either: said so
    # (unless other work shared the machine while it ran: then it is not kept, said so)
    busy = "ran while other work shared the machine"
    others = [w for w in warnings if w != warning and busy not in w]
    assert all(w.endswith("(Not a directory)") for w in others), warnings
    assert "Traceback" not in caplog.text


def copy_export(graph: Path, path: Path) -> None:
    """A cached export (a graph and its weights file) copied to `path` and beside it, as
    the export would have made it."""
    from rawserve.worker import onnx_engine

    shutil.copy(graph, path)
    shutil.copy(graph.with_name(onnx_engine.WEIGHTS_FILE), path.parent)


def graph_in_a_cache(tiny_model, onnx_cache, cache: Path) -> tuple[Path, Path, Path]:
    """The tiny classifier's folder, its exported graph, and a copy of that graph's cache
    entry in `cache` (the graph's path there)."""
    from rawserve.worker import graph_cache, onnx_engine

    folder = Path(tiny_model("text-classification"))
    head = onnx_engine.HEADS["text-classification"]
    good = onnx_engine.exported_graph(folder, head, onnx_cache)
    shutil.copytree(good.parent, cache / good.parent.name)
    return folder, good, cache / good.parent.name / graph_cache.GRAPH_FILE


@pytest.mark.parametrize(
    "failure",
    [MemoryError(), ImportError("libonnxruntime.so: failed to map segment from shared object")],
)
def test_a_worker_out_of_memory_keeps_the_cached_graph(
    tiny_model, onnx_cache, tmp_path, monkeypatch, failure
):
    """Memory the worker lacks (under a memory limit onnxruntime's library could not even
    be mapped: an ImportError) is not a damaged graph: the good one was removed and
    exported again, at every restart under memory pressure (a tester). The load fails,
    saying it ran out of memory, and the graph stays."""
    from rawserve.worker import onnx_engine
    from rawserve.worker.process import load_failed

    folder, good, kept = graph_in_a_cache(tiny_model, onnx_cache, tmp_path / "onnx")
    cache = tmp_path / "onnx"

    def out_of_memory(*args, **kwargs):
        raise failure

    monkeypatch.setattr(onnx_engine, "OnnxNetwork", out_of_memory)
    monkeypatch.setattr(onnx_engine, "export", lambda *args: pytest.fail("exported again"))
    with pytest.raises(type(failure)) as caught:
        onnx_engine.load_network(str(folder), "text-classification", 1, cache)
    assert kept.read_bytes() == good.read_bytes()
    if isinstance(failure, MemoryError):  # it said "MemoryError:" and nothing more
        assert load_failed(caught.value).message.startswith(
            "MemoryError (the worker ran out of memory: a memory limit, or too little RAM)"
        )


@pytest.mark.parametrize("cut", ["model.onnx", "model.onnx.data"])
def test_a_cached_graph_that_cannot_be_loaded_is_exported_again(
    tiny_model, onnx_cache, tmp_path, monkeypatch, caplog, cut
):
    """A cut-short or damaged graph or weights file in the cache (a full disk, a crash
    before the data reached it, a hand edit) is made again, said in one line: it stopped
    the server at every start with --engine onnx, and kept auto on torch for good."""
    from rawserve.worker import onnx_engine

    folder, good, broken = graph_in_a_cache(tiny_model, onnx_cache, tmp_path / "onnx")
    cache = tmp_path / "onnx"
    damaged = broken.with_name(cut)
    damaged.write_bytes(good.with_name(cut).read_bytes()[:5000])
    exports = []

    def export(source, export_head, path):
        exports.append(source)
        copy_export(good, path)

    monkeypatch.setattr(onnx_engine, "export", export)
    with caplog.at_level(logging.INFO, logger="rawserve.onnx"):
        network = onnx_engine.load_network(str(folder), "text-classification", 1, cache)
    assert exports == [folder] and network.graph == broken
    assert damaged.read_bytes() == good.with_name(cut).read_bytes()
    [warning] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warning.startswith(f"ONNX engine: the cached graph {broken} cannot be loaded (")
    assert warning.endswith("): exported again")
    assert "Traceback" not in caplog.text
    assert sorted(path.name for path in cache.iterdir()) == [
        f".{good.parent.name.rpartition('-')[2]}.lock",
        good.parent.name,
    ]


def test_a_cached_graph_removed_while_it_was_loaded_is_exported_again(
    tiny_model, onnx_cache, tmp_path, monkeypatch
):
    """Another server's new export of the folder removes this one's predecessor: a worker
    that had not opened it yet exports it again (it raised FileNotFoundError)."""
    from rawserve.worker import onnx_engine

    folder = Path(tiny_model("text-classification"))
    head = onnx_engine.HEADS["text-classification"]
    good = onnx_engine.exported_graph(folder, head, onnx_cache)
    cache = tmp_path / "onnx"
    shutil.copytree(good.parent, cache / good.parent.name)
    network_class = onnx_engine.OnnxNetwork
    opened = []

    def network(graph, *args):
        if not opened:
            opened.append(graph)
            shutil.rmtree(graph.parent)
            raise RuntimeError(f"NO_SUCHFILE : Load model from {graph} failed")
        return network_class(graph, *args)

    monkeypatch.setattr(onnx_engine, "OnnxNetwork", network)

    def export(source, export_head, path):  # (nothing untrained)
        copy_export(good, path)

    monkeypatch.setattr(onnx_engine, "export", export)
    loaded = onnx_engine.load_network(str(folder), "text-classification", 1, cache)
    assert loaded.graph == opened[0] and loaded.graph.read_bytes() == good.read_bytes()


def test_the_cache_keeps_one_export_per_model_folder_and_head(
    tiny_model, tmp_path, monkeypatch, caplog
):
    """Weights saved again in place (or a new torch) make another export: the one it
    replaces, and what a worker killed while exporting left, are removed, or every
    version of a model kept a whole copy of its weights in the cache."""
    from rawserve.worker import graph_cache, onnx_engine

    folder = tmp_path / "model"
    shutil.copytree(tiny_model("text-classification"), folder)
    cache = tmp_path / "onnx"

    def export(source, head, path):
        path.write_bytes(b"a graph")

    monkeypatch.setattr(onnx_engine, "export", export)
    classifier = onnx_engine.HEADS["text-classification"]
    first = onnx_engine.exported_graph(folder, classifier, cache).parent
    vectors = onnx_engine.exported_graph(folder, onnx_engine.HEADS["feature-extraction"], cache)
    elsewhere = tmp_path / "other" / "model"  # another folder of the same name
    shutil.copytree(folder, elsewhere)
    (elsewhere / "config.json").write_text((folder / "config.json").read_text() + "\n")
    other = onnx_engine.exported_graph(elsewhere, classifier, cache).parent

    (folder / "model.safetensors").write_bytes(
        (folder / "model.safetensors").read_bytes()[:-4] + b"\0\0\0\0"
    )
    digest = graph_cache.key_digest(onnx_engine.cache_key(folder, classifier))
    killed = cache / f".export-{digest}-killed"
    killed.mkdir()
    (killed / "model.onnx").write_bytes(b"half a graph")
    with caplog.at_level(logging.INFO, logger="rawserve.onnx"):
        second = onnx_engine.exported_graph(folder, classifier, cache).parent
    assert second != first and (second / "model.onnx").is_file()
    assert not first.exists() and not killed.exists()
    assert vectors.is_file() and other.exists()  # another head, another folder: kept
    assert f"removed {first}, this model's graph from before" in caplog.text


def test_a_cache_that_fills_up_while_fusing_is_one_line_not_a_traceback(
    tiny_model, onnx_cache, tmp_path, monkeypatch, caplog
):
    """A full disk is the cache folder's failure, said as such in one line (auto then
    serves with torch), not the fusions' failure with a traceback, after which the
    export failed anyway."""
    import errno

    import onnx
    import onnx_ir

    from rawserve.worker import onnx_engine

    folder = Path(tiny_model("text-classification"))
    head = onnx_engine.HEADS["text-classification"]
    good = onnx_engine.exported_graph(folder, head, onnx_cache)

    def export(source, export_head, path):
        exported = path.with_name("exported.onnx")
        onnx.save(onnx.load(good), exported)  # as torch saves a graph: weights inside
        onnx_engine._fuse(exported, path)

    def full(graph, path, *args, **kwargs):
        Path(path).write_bytes(b"half a gra")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(onnx_engine, "export", export)
    monkeypatch.setattr(onnx_ir, "save", full)
    cache = tmp_path / "onnx"
    with caplog.at_level(logging.INFO, logger="rawserve.onnx"), pytest.raises(OSError) as caught:
        onnx_engine.exported_graph(folder, head, cache)
    assert str(caught.value) == (
        f"the ONNX export's cache folder {cache} cannot be written (No space left on device): "
        "set RAWSERVE_CACHE_DIR to one that can"
    )
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert [path.name for path in cache.iterdir() if not path.name.endswith(".lock")] == []


def test_the_exporter_s_own_log_lines_go_to_the_debug_log(
    tiny_model, onnx_cache, tmp_path, monkeypatch, caplog
):
    """torch's exporter warns that torchvision is not installed, four lines at every
    export: nothing for the user to act on (no encoder uses torchvision's operators)."""
    import onnx
    import torch

    from rawserve.worker import onnx_engine

    folder = Path(tiny_model("text-classification"))
    head = onnx_engine.HEADS["text-classification"]
    good = onnx_engine.exported_graph(folder, head, onnx_cache)
    registration = logging.getLogger("torch.onnx._internal.exporter._registration")
    for name in ("torch", "torch.onnx"):  # through the worker's handler, as in a worker
        monkeypatch.setattr(logging.getLogger(name), "handlers", [])
        monkeypatch.setattr(logging.getLogger(name), "propagate", True)

    class Program:
        def save(self, path):
            onnx.save(onnx.load(good), path)  # as torch saves a graph: weights inside

    def exporter(*args, **kwargs):
        registration.warning("torchvision is not installed. Skipping %s", "torchvision::nms")
        return Program()

    monkeypatch.setattr(torch.onnx, "export", exporter)
    with caplog.at_level(logging.DEBUG):
        onnx_engine.export_here(folder, head, tmp_path / "model.onnx")
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert "exporter: torchvision is not installed. Skipping torchvision::nms" in caplog.text
    exporter = logging.getLogger("torch.onnx")
    assert exporter.handlers == [] and exporter.propagate  # as it was, after the export


def shipping_its_graph(tiny_model, onnx_cache, folder: Path, ignore=None) -> Path:
    """`folder`: the tiny feature-extraction model (less what `ignore` leaves out) with an
    ONNX graph of its own at onnx/model.onnx, as a repo on the Hub ships one."""
    from rawserve.worker import onnx_engine

    source = Path(tiny_model("feature-extraction"))
    shutil.copytree(source, folder, ignore=ignore)
    graph = onnx_engine.exported_graph(source, onnx_engine.HEADS["feature-extraction"], onnx_cache)
    ship(graph, folder)
    return folder


def ship(graph: Path, folder: Path) -> None:
    """An exported graph and its weights file put where a Hub repo ships its own."""
    from rawserve.worker import onnx_engine

    (folder / "onnx").mkdir()
    shutil.copy(graph, folder / "onnx" / "model.onnx")
    shutil.copy(graph.with_name(onnx_engine.WEIGHTS_FILE), folder / "onnx")


def test_a_model_s_own_onnx_file_is_used_as_shipped(tiny_model, onnx_cache, tmp_path, caplog):
    from rawserve.worker import onnx_engine

    folder = shipping_its_graph(tiny_model, onnx_cache, tmp_path / "with-onnx")
    with caplog.at_level(logging.INFO, logger="rawserve.onnx"):
        network = onnx_engine.load_network(str(folder), "feature-extraction", 1, tmp_path / "x")
    assert network.graph == folder / "onnx" / "model.onnx"
    assert "the model's own graph" in caplog.text
    assert not (tmp_path / "x").exists()  # nothing exported


def shipping_its_weights_inside(tiny_model, onnx_cache, folder: Path) -> Path:
    """`folder` shipping its own graph with the weights inside the graph's file, as
    torch.onnx and most Hub repos save one."""
    import onnx

    shipping_its_graph(tiny_model, onnx_cache, folder)
    graph = folder / "onnx" / "model.onnx"
    inside = onnx.load(graph)  # (the weights beside it read in)
    (folder / "onnx" / "model.onnx.data").unlink()
    onnx.save(inside, graph)
    return folder


def vectors(network):
    import torch

    ids = torch.tensor([[2, 9, 10, 3], [2, 11, 3, 0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])
    return network(input_ids=ids, attention_mask=mask).last_hidden_state


def test_a_model_s_own_graph_with_its_weights_inside_is_served_from_a_copy_with_them_apart(
    tiny_model, onnx_cache, tmp_path, monkeypatch, caplog
):
    """Read from inside the graph's file, each ONNX Runtime session (two a worker) held a
    copy of the weights (MiniLM's shipped graph, two workers: 446 MB each); a copy of the
    graph with them beside it, made once in the cache, is mapped (357-362 MB)."""
    from rawserve.worker import onnx_engine

    monkeypatch.setattr(onnx_engine, "WEIGHTS_INSIDE_BYTES", 1024)  # the tiny graph's
    folder = shipping_its_weights_inside(tiny_model, onnx_cache, tmp_path / "with-onnx")
    shipped = folder / "onnx" / "model.onnx"
    cache = tmp_path / "cache"
    with caplog.at_level(logging.INFO, logger="rawserve.onnx"):
        network = onnx_engine.load_network(str(folder), "feature-extraction", 1, cache)
    assert network.graph.parent.parent == cache and network.graph.parent.name.startswith(
        "with-onnx-own-"
    )
    assert network.source == onnx_engine.SHIPPED
    assert "onnx/model.onnx copied with its weights apart in " in caplog.text
    assert_weights_mapped(network.graph)
    as_shipped = onnx_engine.OnnxNetwork(
        shipped, network.config, network.head, 1, source=onnx_engine.SHIPPED
    )
    assert np.array_equal(vectors(network).numpy(), vectors(as_shipped).numpy())
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="rawserve.onnx"):  # a second start: found
        again = onnx_engine.load_network(str(folder), "feature-extraction", 1, cache)
    assert again.graph == network.graph and "copied" not in caplog.text
    # the graph shipped anew (another revision): its copy replaces the first
    import onnx

    renamed = onnx.load(shipped)
    renamed.doc_string = "another revision"
    onnx.save(renamed, shipped)
    third = onnx_engine.load_network(str(folder), "feature-extraction", 1, cache)
    assert third.graph != network.graph and not network.graph.parent.exists()


def test_a_model_s_own_graph_with_its_weights_beside_it_is_served_as_shipped_however_large(
    tiny_model, onnx_cache, tmp_path, monkeypatch, caplog
):
    """A graph's file over WEIGHTS_INSIDE_BYTES may be a structure alone, its weights in a
    file beside it. Copied, the copy took those weights along, keyed by the graph's file
    alone: weights saved again beside the same graph (a model trained anew, exported
    again) were served stale from the copy (a tester). Such a graph is served as shipped,
    and a copy made before of the same folder's graph is removed."""
    import onnx
    from onnx import numpy_helper

    from rawserve.worker import onnx_engine

    monkeypatch.setattr(onnx_engine, "WEIGHTS_INSIDE_BYTES", 1024)  # the tiny graph's
    folder = shipping_its_weights_inside(tiny_model, onnx_cache, tmp_path / "with-onnx")
    shipped = folder / "onnx" / "model.onnx"
    cache = tmp_path / "cache"
    first_copy = onnx_engine.load_network(str(folder), "feature-extraction", 1, cache).graph
    assert first_copy.parent.parent == cache

    # exported again, its weights beside it, then trained anew: the same graph file
    graph = onnx.load(shipped)
    onnx.save(graph, shipped, save_as_external_data=True, location="weights")
    assert shipped.stat().st_size > onnx_engine.WEIGHTS_INSIDE_BYTES
    network = onnx_engine.load_network(str(folder), "feature-extraction", 1, cache)
    assert network.graph == shipped and not first_copy.parent.exists()
    assert not [path for path in cache.iterdir() if path.name.startswith("with-onnx-own-")]
    before = vectors(network).numpy()
    structure = shipped.read_bytes()
    graph = onnx.load(shipped)  # (its weights read in from beside it)
    for tensor in graph.graph.initializer:
        values = numpy_helper.to_array(tensor)
        if values.dtype == np.float32 and values.nbytes >= 1024:  # (those saved beside it)
            tensor.raw_data = (values * 1.5).tobytes()
    (folder / "onnx" / "weights").unlink()  # (onnx.save appends to one there)
    onnx.save(graph, shipped, save_as_external_data=True, location="weights")
    assert shipped.read_bytes() == structure
    trained = onnx_engine.load_network(str(folder), "feature-extraction", 1, cache)
    assert trained.graph == shipped
    assert not np.allclose(vectors(trained).numpy(), before, atol=1e-3)
    # a cache that cannot be written is no copy missed: nothing to warn of (a tester)
    not_a_folder = tmp_path / "a-file"
    not_a_folder.write_text("")
    with caplog.at_level(logging.INFO, logger="rawserve.onnx"):
        network = onnx_engine.load_network(str(folder), "feature-extraction", 1, not_a_folder)
    assert network.graph == shipped
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]


def test_a_copy_of_a_model_s_own_graph_that_cannot_be_made_or_loaded_leaves_it_as_shipped(
    tiny_model, onnx_cache, tmp_path, monkeypatch, caplog
):
    """A cache that cannot be written, or a copy cut short (its weights file truncated),
    never stops the model: it is served from its own graph as shipped, with a line, and
    the damaged copy is removed so that the next start makes it again."""
    from rawserve.worker import onnx_engine

    monkeypatch.setattr(onnx_engine, "WEIGHTS_INSIDE_BYTES", 1024)
    folder = shipping_its_weights_inside(tiny_model, onnx_cache, tmp_path / "with-onnx")
    shipped = folder / "onnx" / "model.onnx"
    not_a_folder = tmp_path / "a-file"
    not_a_folder.write_text("")
    with caplog.at_level(logging.INFO, logger="rawserve.onnx"):
        network = onnx_engine.load_network(str(folder), "feature-extraction", 1, not_a_folder)
    assert network.graph == shipped
    [warning] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warning.startswith(
        "ONNX engine: onnx/model.onnx is served as shipped, each session reading its "
        "weights: no copy with them apart could be made (the ONNX export's cache folder "
    )

    cache = tmp_path / "cache"
    copy = onnx_engine.load_network(str(folder), "feature-extraction", 1, cache).graph
    weights = copy.with_name(onnx_engine.WEIGHTS_FILE)
    weights.write_bytes(weights.read_bytes()[:100])
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="rawserve.onnx"):
        network = onnx_engine.load_network(str(folder), "feature-extraction", 1, cache)
    assert network.graph == shipped and not copy.parent.exists()
    [warning] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warning.startswith(f"ONNX engine: the copy {copy} of onnx/model.onnx cannot be loaded (")
    assert warning.endswith("): removed; the graph is served as shipped")
    assert onnx_engine.load_network(str(folder), "feature-extraction", 1, cache).graph == copy


def test_a_graph_onnx_runtime_refuses_is_said_in_rawserve_s_line_alone(tmp_path, capfd):
    """A cached graph whose weights file was cut short failed as ONNX Runtime folded its
    constants, and ONNX Runtime logged the failure itself first: a red line of C++
    signatures before the one line that says it (a tester). It raises it, and says no
    more."""
    import onnx
    from onnx import TensorProto, helper

    from rawserve.worker import onnx_engine

    ones = np.ones((256, 256), np.float32).tobytes()
    weights = [
        helper.make_tensor(name, TensorProto.FLOAT, [256, 256], ones, raw=True) for name in "wb"
    ]
    nodes = [
        helper.make_node("Add", ["w", "b"], ["c"]),
        helper.make_node("MatMul", ["x", "c"], ["y"]),
    ]
    declared = [helper.make_tensor_value_info(name, TensorProto.FLOAT, [1, 256]) for name in "xy"]
    graph = helper.make_graph(nodes, "folded", declared[:1], declared[1:], weights)
    path = tmp_path / "model.onnx"
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.save(model, path, save_as_external_data=True, location="model.onnx.data", size_threshold=0)
    with open(tmp_path / "model.onnx.data", "r+b") as data:
        data.truncate(300_000)  # (the second weight cut short)
    capfd.readouterr()
    assert onnx_engine.unloadable(path) is not None
    with pytest.raises(Exception, match="Exception during initialization"):
        config = SimpleNamespace(model_type="bert")
        onnx_engine.OnnxNetwork(path, config, onnx_engine.HEADS["feature-extraction"], 1)
    assert "onnxruntime" not in capfd.readouterr().err


def graph_file(path, inputs, outputs, batch="batch"):
    """A hand-made graph's declaration alone (no nodes, no weights): `inputs` and
    `outputs` map each name to (element type, rank), or (element type, rank, the fixed
    size of its last dimension)."""
    import onnx
    from onnx import helper

    def value(name, element, rank, last=None):
        dims = [batch, "sequence", "width"][:rank]
        return helper.make_tensor_value_info(name, element, [*dims[:-1], last or dims[-1]])

    graph = helper.make_graph(
        [],
        "shipped",
        [value(name, *kind) for name, kind in inputs.items()],
        [value(name, *kind) for name, kind in outputs.items()],
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(helper.make_model(graph), str(path))
    return path


INT64, FLOAT, FLOAT16 = 7, 1, 10  # onnx.TensorProto's element types
TOKENS = {"input_ids": (INT64, 2), "attention_mask": (INT64, 2), "token_type_ids": (INT64, 2)}


@pytest.mark.parametrize(
    ("task", "inputs", "outputs", "batch", "reason"),
    [
        # sentence-transformers' onnx/model.onnx, and an optimum classifier's
        ("feature-extraction", TOKENS, {"last_hidden_state": (FLOAT, 3)}, "batch", None),
        ("text-classification", TOKENS, {"logits": (FLOAT, 2)}, "batch", None),
        (
            "feature-extraction",
            {**TOKENS, "position_ids": (INT64, 2)},
            {"last_hidden_state": (FLOAT, 3)},
            "batch",
            "inputs the tokenizer does not give (position_ids)",
        ),
        (
            "feature-extraction",
            {"attention_mask": (INT64, 2)},
            {"last_hidden_state": (FLOAT, 3)},
            "batch",
            "no input_ids (it takes attention_mask)",
        ),
        (
            "feature-extraction",
            {"input_ids": (FLOAT, 2)},
            {"last_hidden_state": (FLOAT, 3)},
            "batch",
            "input_ids is not int64",
        ),
        (
            "feature-extraction",
            TOKENS,
            {"last_hidden_state": (FLOAT, 3)},
            1,  # exported for one item at a time
            "input_ids is not of any batch size and length",
        ),
        (
            "feature-extraction",
            TOKENS,
            {"token_embeddings": (FLOAT, 3), "sentence_embedding": (FLOAT, 2)},
            "batch",
            "answers no last_hidden_state (it answers token_embeddings, sentence_embedding)",
        ),
        (
            "feature-extraction",
            TOKENS,
            {"last_hidden_state": (FLOAT16, 3)},
            "batch",
            "last_hidden_state is not float32",
        ),
        (  # a sentence classifier's logits where each token's are read
            "token-classification",
            TOKENS,
            {"logits": (FLOAT, 2)},
            "batch",
            "logits has 2 dimensions, not 3",
        ),
    ],
)
def test_a_shipped_graph_serves_only_what_it_fits(tmp_path, task, inputs, outputs, batch, reason):
    """What the runners feed (the tokenizer's int64 tensors, of any batch and length) and
    read (the head's float32 outputs): a graph that differs failed every request, or
    answered from zeros fed in place of an input it takes."""
    from rawserve.worker import onnx_engine

    graph = graph_file(tmp_path / "model.onnx", inputs, outputs, batch)
    unfit = onnx_engine.shipped_unfit(graph, onnx_engine.HEADS[task])
    assert unfit == reason or (reason is not None and unfit is not None and reason in unfit)


def bert_config(**sizes):
    import transformers

    return transformers.BertConfig(hidden_size=32, num_attention_heads=2, vocab_size=99, **sizes)


@pytest.mark.parametrize(
    ("task", "outputs", "config", "reason"),
    [
        (  # the tester's: 3 logits beside 2 labels (a 500 at top_k 3, /predict's LABEL_2)
            "text-classification",
            {"logits": (FLOAT, 2, 3)},
            bert_config(num_labels=2),
            "its logits has 3 values in its last dimension, where config.json's num_labels is 2",
        ),
        (  # a reranker's one score beside a graph of two (wrong scores, answered 200)
            "text-classification",
            {"logits": (FLOAT, 2, 2)},
            bert_config(num_labels=1),
            "where config.json's num_labels is 1",
        ),
        (  # an NLI head of 3 served 2 (every request a 500)
            "zero-shot-classification",
            {"logits": (FLOAT, 2, 2)},
            bert_config(num_labels=3),
            "where config.json's num_labels is 3",
        ),
        ("text-classification", {"logits": (FLOAT, 2, 3)}, bert_config(num_labels=3), None),
        ("text-classification", {"logits": (FLOAT, 2)}, bert_config(num_labels=3), None),
        (
            "token-classification",
            {"logits": (FLOAT, 3, 4)},
            bert_config(num_labels=5),
            "num_labels is 5",
        ),
        ("token-classification", {"logits": (FLOAT, 3, 5)}, bert_config(num_labels=5), None),
        (
            "feature-extraction",
            {"last_hidden_state": (FLOAT, 3, 384)},
            bert_config(),
            "its last_hidden_state has 384 values in its last dimension, where config.json's "
            "hidden_size is 32",
        ),
        ("feature-extraction", {"last_hidden_state": (FLOAT, 3, 32)}, bert_config(), None),
        ("fill-mask", {"logits": (FLOAT, 3, 100)}, bert_config(), "vocab_size is 99"),
        ("fill-mask", {"logits": (FLOAT, 3, 99)}, bert_config(), None),
        (  # nothing of the config fixes a span's logits
            "question-answering",
            {"start_logits": (FLOAT, 2), "end_logits": (FLOAT, 2)},
            bert_config(),
            None,
        ),
        ("text-classification", {"logits": (FLOAT, 2, 3)}, None, None),  # no config read
    ],
)
def test_a_shipped_graph_s_fixed_sizes_must_be_the_config_s(
    tmp_path, task, outputs, config, reason
):
    """torch refuses weights of another size than config.json's at start; a graph that
    fixed its logits at 3 beside 2 labels was served: a 500 (KeyError in id2label) at
    top_k 3, an invented LABEL_2 in /predict, and a reranker's wrong scores answered 200."""
    from rawserve.worker import onnx_engine

    graph = graph_file(tmp_path / "model.onnx", TOKENS, outputs)
    unfit = onnx_engine.shipped_unfit(graph, onnx_engine.HEADS[task], ALL_GIVEN, config)
    assert unfit == reason or (reason is not None and unfit is not None and reason in unfit)


def test_a_shipped_classifier_whose_logits_are_not_its_labels_is_exported_instead(
    tiny_model, onnx_cache, tmp_path, caplog
):
    """A 2-label classifier shipping a 3-label head's graph (an NLI model's): with its
    torch weights beside it, the engine trial picked that graph and served its wrong
    scores; now the export of its own weights serves."""
    from rawserve.worker import onnx_engine

    source = Path(tiny_model("text-classification"))
    head = onnx_engine.HEADS["text-classification"]
    exported = onnx_engine.exported_graph(source, head, onnx_cache)
    nli = Path(tiny_model("zero-shot-classification"))
    folder = tmp_path / source.name  # the same name and files: the same cached export
    shutil.copytree(source, folder)
    ship(onnx_engine.exported_graph(nli, head, onnx_cache), folder)
    with caplog.at_level(logging.INFO, logger="rawserve.onnx"):
        network = onnx_engine.load_network(str(folder), "text-classification", 1, onnx_cache)
    assert network.graph == exported and network.source == onnx_engine.EXPORTED
    [warning] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warning.endswith(
        "its logits has 3 values in its last dimension, where config.json's num_labels is "
        "2; exported instead"
    )


MASKED = {"input_ids": (INT64, 2), "attention_mask": (INT64, 2)}
SEGMENTED = {"input_ids": (INT64, 2), "token_type_ids": (INT64, 2)}
ALL_GIVEN = frozenset(TOKENS)


@pytest.mark.parametrize(
    ("task", "inputs", "given", "reason"),
    [
        ("feature-extraction", SEGMENTED, ALL_GIVEN, "takes no attention_mask, which the"),
        ("text-classification", MASKED, ALL_GIVEN, "takes no token_type_ids, which the"),
        ("question-answering", MASKED, ALL_GIVEN, "takes no token_type_ids, which the"),
        ("feature-extraction", MASKED, ALL_GIVEN, None),  # single texts: segment 0 alone
        ("text-classification", MASKED, frozenset(MASKED), None),  # (RoBERTa's tokenizer)
        ("feature-extraction", {"input_ids": (INT64, 2)}, frozenset({"input_ids"}), None),
    ],
)
def test_a_shipped_graph_must_take_the_mask_and_a_pair_s_segments_the_tokenizer_gives(
    tmp_path, task, inputs, given, reason
):
    """A graph without the attention mask attended the padding (a text's vector changed
    with the batch it rode in: cosine 0.99996); a classifier's without the segment ids read
    a pair's second text as its first's (torch -0.01887, ONNX Runtime -0.01865)."""
    from rawserve.worker import onnx_engine

    head = onnx_engine.HEADS[task]
    outputs = {name: (FLOAT, head.rank) for name in head.outputs}
    graph = graph_file(tmp_path / "model.onnx", inputs, outputs)
    unfit = onnx_engine.shipped_unfit(graph, head, given)
    assert unfit == reason or (reason is not None and unfit is not None and reason in unfit)


def test_a_shipped_classifier_without_segment_ids_is_exported_instead(
    tiny_model, onnx_cache, tmp_path, caplog
):
    from rawserve.worker import onnx_engine

    source = Path(tiny_model("text-classification"))
    head = onnx_engine.HEADS["text-classification"]
    exported = onnx_engine.exported_graph(source, head, onnx_cache)
    folder = tmp_path / source.name  # the same name and files: the same cached export
    shutil.copytree(source, folder)
    graph_file(folder / "onnx" / "model.onnx", MASKED, {"logits": (FLOAT, 2)})
    with caplog.at_level(logging.INFO, logger="rawserve.onnx"):
        network = onnx_engine.load_network(str(folder), "text-classification", 1, onnx_cache)
    assert network.graph == exported
    assert "it takes no token_type_ids, which the tokenizer gives" in caplog.text


@pytest.mark.parametrize(
    ("shipped", "reason"),
    [
        ("not a graph", "cannot be read ("),
        ("outputs", "answers no last_hidden_state (it answers sentence_embedding)"),
        ("no nodes", "ONNX Runtime cannot load it ("),  # declared as it should be, but empty
    ],
)
def test_a_shipped_graph_that_cannot_serve_is_said_and_the_model_exported(
    tiny_model, onnx_cache, tmp_path, caplog, shipped, reason
):
    """It stopped the server (--engine onnx), kept auto on torch, or was passed over
    without a word: now one line says why, and the export serves."""
    from rawserve.worker import onnx_engine

    source = Path(tiny_model("feature-extraction"))
    head = onnx_engine.HEADS["feature-extraction"]
    exported = onnx_engine.exported_graph(source, head, onnx_cache)
    folder = tmp_path / source.name  # the same name and files: the same cached export
    shutil.copytree(source, folder)
    graph = folder / "onnx" / "model.onnx"
    if shipped == "not a graph":
        graph.parent.mkdir()
        graph.write_bytes(b"version https://git-lfs.github.com/spec/v1\n")
    else:
        outputs = {"sentence_embedding": (FLOAT, 2)} if shipped == "outputs" else None
        graph_file(graph, TOKENS, outputs or {"last_hidden_state": (FLOAT, 3)})
    with caplog.at_level(logging.INFO, logger="rawserve.onnx"):
        network = onnx_engine.load_network(str(folder), "feature-extraction", 1, onnx_cache)
    assert network.graph == exported and network.source == onnx_engine.EXPORTED
    [warning] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warning.startswith(
        "ONNX engine: the model's own onnx/model.onnx does not serve feature-extraction: "
    )
    assert reason in warning and warning.endswith("; exported instead")


def test_a_shipped_graph_s_segment_ids_the_tokenizer_does_not_make_are_the_first_segment(
    tiny_model, onnx_cache, tmp_path
):
    """A repo whose graph takes token_type_ids while its tokenizer makes none (its
    `model_input_names` leave them out): fed as torch's model takes them left out, all
    the first segment, so both engines give the same vectors."""
    from rawserve.worker.loading import load_runner

    folder = shipping_its_graph(tiny_model, onnx_cache, tmp_path / "no-segments")
    settings = json.loads((folder / "tokenizer_config.json").read_text())
    settings["model_input_names"] = ["input_ids", "attention_mask"]
    (folder / "tokenizer_config.json").write_text(json.dumps(settings))
    answers = {}
    for engine in (Engine.TORCH, Engine.ONNX):
        config = WorkerConfig(
            model=str(folder), task="feature-extraction", dtype="float32", engine=engine
        )
        runner = load_runner(config, "cpu")
        assert runner.engine is engine
        answers[engine] = runner.run(["hello world", "the movie was good"], {}, NO_CONTROL)
    assert "token_type_ids" in graph_inputs(folder / "onnx" / "model.onnx")
    assert_close(answers[Engine.ONNX], answers[Engine.TORCH])


def graph_inputs(graph: Path) -> list[str]:
    import onnxruntime

    return [node.name for node in onnxruntime.InferenceSession(str(graph)).get_inputs()]


def test_the_engine_reason_names_the_graph_served(tiny_model, onnx_cache, tmp_path):
    """/info's engine_reason and the ready line say whether the repo's own graph runs."""
    from rawserve.worker import onnx_engine
    from rawserve.worker.loading import load_runner

    source = Path(tiny_model("feature-extraction"))
    folder = tmp_path / "with-onnx"
    shutil.copytree(source, folder)
    graph = onnx_engine.exported_graph(source, onnx_engine.HEADS["feature-extraction"], onnx_cache)
    reasons = {}
    for served in ("exported", "shipped"):
        if served == "shipped":
            ship(graph, folder)
        config = WorkerConfig(
            model=str(source if served == "exported" else folder),
            task="feature-extraction",
            dtype="float32",
            engine=Engine.ONNX,
        )
        reasons[served] = load_runner(config, "cpu").engine_reason
    assert reasons["exported"] == "--engine onnx; graph: exported"
    assert reasons["shipped"] == "--engine onnx; graph: the model's own onnx/model.onnx"


def test_a_folder_with_only_its_onnx_graph_is_served_by_the_default_engine(
    tiny_model, onnx_cache, tmp_path, caplog
):
    """A folder of an ONNX-only repo (transformers.js' kind: onnx/model.onnx, no torch
    weights) was served with --engine onnx, but the default, auto, stopped the start on
    transformers' OSError as it built a torch runner to time against ONNX Runtime."""
    from rawserve.worker.loading import load_runner

    folder = shipping_its_graph(
        tiny_model, onnx_cache, tmp_path / "onnx-only", shutil.ignore_patterns("*.safetensors")
    )
    config = WorkerConfig(
        model=str(folder), task="feature-extraction", dtype="auto", engine=Engine.AUTO
    )
    with caplog.at_level(logging.WARNING):
        runner = load_runner(config, "cpu")
    assert runner.engine is Engine.ONNX
    assert runner.engine_reason.startswith("auto: the model has no weights for torch, only ")
    assert not caplog.records  # nor a bfloat16 trial of weights it has not
    [vector] = runner.run(["hello world"], {}, NO_CONTROL)
    assert np.isfinite(vector).all()


@pytest.mark.parametrize(
    ("shipped", "reason"),
    [
        ("no weights file", "ONNX Runtime cannot load it ([ONNXRuntimeError]"),
        ("opset 99", "ONNX Runtime cannot load it ("),
        ("not a graph", "it cannot be read ("),
        ("no segment ids", "it takes no token_type_ids, which the tokenizer gives"),
        (
            "3 logits",
            "its logits has 3 values in its last dimension, where config.json's num_labels is 2",
        ),
    ],
)
def test_a_folder_with_only_an_onnx_graph_that_cannot_serve_stops_with_the_graph_s_fault(
    tiny_model, onnx_cache, tmp_path, caplog, monkeypatch, shipped, reason
):
    """It said the graph's fault in a warning ending "exported instead", spent 6-100 s on
    an export that could not succeed, and stopped blaming the torch weights the folder
    never had (NotExportable: no file named model.safetensors): now the graph's own fault
    stops the start at once, as the server refuses such a folder for --engine torch."""
    import onnx

    from rawserve.worker import onnx_engine
    from rawserve.worker.loading import load_runner

    source = Path(tiny_model("text-classification"))
    folder = tmp_path / "onnx-only"
    shutil.copytree(source, folder, ignore=shutil.ignore_patterns("*.safetensors"))
    head = onnx_engine.HEADS["text-classification"]
    graph = folder / "onnx" / "model.onnx"
    if shipped in ("no weights file", "opset 99"):
        ship(onnx_engine.exported_graph(source, head, onnx_cache), folder)
        if shipped == "no weights file":
            (folder / "onnx" / "model.onnx.data").unlink()
        else:
            model = onnx.load(str(graph), load_external_data=False)
            for opset in model.opset_import:
                opset.version = 99 if opset.domain == "" else opset.version
            onnx.save(model, str(graph))
    elif shipped == "not a graph":
        graph.parent.mkdir()
        graph.write_bytes(b"not a protobuf at all \x00\xff")
    else:
        inputs = MASKED if shipped == "no segment ids" else TOKENS
        graph_file(graph, inputs, {"logits": (FLOAT, 2, 3 if shipped == "3 logits" else 2)})
    monkeypatch.setenv("RAWSERVE_CACHE_DIR", str(tmp_path / "cache"))
    config = WorkerConfig(
        model=str(folder), task="text-classification", dtype="auto", engine=Engine.AUTO
    )
    with caplog.at_level(logging.WARNING), pytest.raises(ValueError) as raised:
        load_runner(config, "cpu")
    message = str(raised.value)
    assert message.startswith(
        "the folder has no PyTorch weights, only its ONNX graph (onnx/model.onnx), which "
        "does not serve text-classification: "
    )
    assert reason in message and "\n" not in message
    assert not caplog.records  # (no "exported instead")
    assert not (tmp_path / "cache").exists()  # nothing exported


def test_the_cache_key_follows_the_files_content(tiny_model, tmp_path):
    from rawserve.worker import onnx_engine

    source = Path(tiny_model("fill-mask"))
    head = onnx_engine.HEADS["fill-mask"]
    copy = tmp_path / "copy"
    shutil.copytree(source, copy)
    assert onnx_engine.cache_key(copy, head) == onnx_engine.cache_key(source, head)
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "hidden_dropout_prob": 0.2}))
    assert onnx_engine.cache_key(copy, head) != onnx_engine.cache_key(source, head)


@pytest.mark.parametrize(
    ("requested", "task", "device", "dtype", "installed", "engine", "why"),
    [
        (Engine.AUTO, "feature-extraction", "cpu", "auto", True, Engine.ONNX, "onnxruntime"),
        (Engine.AUTO, "fill-mask", "cpu", "float32", True, Engine.ONNX, "on the CPU"),
        (Engine.AUTO, "text-generation", "cpu", "auto", True, Engine.TORCH, "text-generation"),
        (Engine.AUTO, "summarization", "cpu", "auto", True, Engine.TORCH, "encoder tasks"),
        (Engine.AUTO, "feature-extraction", "cuda:0", "auto", True, Engine.TORCH, "cuda:0"),
        (Engine.AUTO, "feature-extraction", "cpu", "bfloat16", True, Engine.TORCH, "bfloat16"),
        (Engine.AUTO, "feature-extraction", "cpu", "auto", False, Engine.TORCH, "rawserve[onnx]"),
        (Engine.TORCH, "feature-extraction", "cpu", "auto", True, Engine.TORCH, "--engine torch"),
        (Engine.ONNX, "question-answering", "cpu", "auto", True, Engine.ONNX, "--engine onnx"),
    ],
)
def test_which_engine_runs_a_task(requested, task, device, dtype, installed, engine, why):
    from rawserve.worker.loading import choose_engine

    chosen, reason = choose_engine(requested, task, device, dtype, installed)
    assert chosen is engine and why in reason


@pytest.mark.parametrize(
    ("task", "device", "installed", "message"),
    [
        ("text-generation", "cpu", True, "encoder tasks"),
        ("feature-extraction", "cuda:0", True, "CPU only"),
        ("feature-extraction", "cpu", False, "pip install 'rawserve[onnx]'"),
    ],
)
def test_engine_onnx_where_it_cannot_run_is_a_clear_error(task, device, installed, message):
    from rawserve.worker.loading import choose_engine

    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        choose_engine(Engine.ONNX, task, device, "auto", installed)


@pytest.mark.slow
def test_the_server_says_which_engine_runs_and_why(tiny_model, onnx_cache):
    import urllib.request

    env = {"RAWSERVE_CACHE_DIR": str(onnx_cache.parent), "RAWSERVE_ENGINE": "auto"}  # the default
    args = ["--model", tiny_model("text-classification"), "--device", "cpu"]
    generation = ["--model", tiny_model("text-generation"), "--device", "cpu"]
    both = {
        "encoder": RunningServer(args, env=env),
        "generation": RunningServer(generation, env=env),
    }
    with running_together(both):  # they load side by side
        server = both["encoder"]
        # both engines serve the task: the faster here, by a trial (tests/test_engine_trial.py)
        assert any("(auto: the faster here" in line for line in server.lines)
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/info") as answer:
            info = json.load(answer)
        assert info["engine"] in ("onnx", "torch") and info["requested_engine"] == "auto"
        assert "onnx" in info["workers"][0]["engine_reason"]
        request = urllib.request.Request(
            f"http://127.0.0.1:{server.port}/",
            data=json.dumps({"inputs": ["i like it", "bad"]}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request) as answer:
            labels = [item["label"] for item in json.load(answer)]
        assert set(labels) <= {"NEGATIVE", "POSITIVE"} and len(labels) == 2
        server = both["generation"]
        assert any("engine torch (auto: ONNX Runtime serves" in line for line in server.lines)


@pytest.mark.slow
def test_fill_mask_input_errors_are_422_on_the_onnx_engine(tiny_model, onnx_cache):
    """The pipeline's own "no mask token" check names the model by an attribute the ONNX
    network must carry, or the client's error became a 500; an input past the positions
    is a 422 naming them (tests/test_task_adapters.py runs every task's on both engines)."""
    env = {"RAWSERVE_CACHE_DIR": str(onnx_cache.parent), "RAWSERVE_ENGINE": "onnx"}
    args = ["--model", tiny_model("fill-mask"), "--device", "cpu"]
    with RunningServer(args, env=env).start() as server:
        status, body = server.post_json({"inputs": "no mask token here"})
        assert status == 422 and "mask" in body["error"], body
        status, body = server.post_json({"inputs": ["a [MASK]", "no mask token here"]})
        assert status == 422 and "mask" in body["error"], body
        status, body = server.post_json({"inputs": " ".join(["hello"] * 200) + " [MASK]"})
        assert status == 422 and "at most 128" in body["error"], body
        status, body = server.post_json({"inputs": "paris is the [MASK]"})
        assert status == 200 and len(body) == 5, body


EXPORT_IN_A_FRESH_PROCESS = """
import json, sys
from pathlib import Path
from rawserve.worker import onnx_engine
head = onnx_engine.HEADS["text-classification"]
graph = onnx_engine.exported_graph(Path(sys.argv[1]), head, Path(sys.argv[2]))
exporter = ("onnxscript", "torch.onnx._internal.exporter._core")
print(json.dumps({"graph": str(graph), "kept": [name for name in exporter if name in sys.modules]}))
"""


def test_the_export_runs_in_a_process_of_its_own_and_leaves_with_it(tiny_model, tmp_path):
    """The worker that exported kept the exporter's libraries and state for its life
    (~370 MB more than its peers on the packaged model): they are loaded in the export's
    own process now, never in the one that asked."""
    folder = tiny_model("text-classification")
    ran = subprocess.run(
        [sys.executable, "-c", EXPORT_IN_A_FRESH_PROCESS, folder, str(tmp_path / "onnx")],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    found = json.loads(ran.stdout.splitlines()[-1])
    assert found["kept"] == []
    graph = Path(found["graph"])
    assert graph.is_file() and (graph.parent / "key.json").is_file()
    assert not (graph.parent / "outcome.json").exists()  # the process's word, not kept
    from rawserve.worker import onnx_engine

    network = onnx_engine.load_network(folder, "text-classification", 1, tmp_path / "onnx")
    assert network.graph == graph


def test_the_export_process_imports_this_process_s_rawserve_not_the_working_directory_s(
    tiny_model, tmp_path, monkeypatch
):
    """The rawserve command run in a checkout of another version: the export's process
    put that directory first and imported its rawserve ("No module named
    rawserve.worker.export_process"; auto then ran torch at every start)."""
    from rawserve.worker import onnx_engine

    shadow = tmp_path / "checkout" / "rawserve"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('another checkout')\n")
    monkeypatch.chdir(shadow.parent)
    head = onnx_engine.HEADS["text-classification"]
    graph = onnx_engine.exported_graph(Path(tiny_model("text-classification")), head, tmp_path)
    assert graph.is_file()


def test_an_export_process_killed_is_said_by_its_signal_and_not_kept_against_the_model(
    tiny_model, tmp_path, monkeypatch, caplog
):
    """Killed (the OOM killer), it says nothing: the error names the signal; `auto` serves
    with torch this once, and the next start tries ONNX Runtime again."""
    from rawserve.worker import engine_trial, graph_cache, onnx_engine
    from rawserve.worker.loading import load_runner

    killed = tmp_path / "killed-python"
    killed.write_text("#!/bin/sh\nkill -9 $$\n")
    killed.chmod(0o755)
    monkeypatch.setattr(onnx_engine.sys, "executable", str(killed))
    folder = Path(tiny_model("text-classification"))
    head = onnx_engine.HEADS["text-classification"]
    cache = tmp_path / "cache"
    with pytest.raises(onnx_engine.ExportInterrupted, match=r"without a word \(SIGKILL\)"):
        onnx_engine.exported_graph(folder, head, cache / "onnx")
    assert [path.name for path in (cache / "onnx").iterdir()] == [
        f".{graph_cache.key_digest(onnx_engine.cache_key(folder, head))}.lock"
    ]  # no half-made export left
    monkeypatch.setenv("RAWSERVE_CACHE_DIR", str(cache))
    config = WorkerConfig(model=str(folder), task="text-classification", engine=Engine.AUTO)
    with caplog.at_level(logging.WARNING):
        runner = load_runner(config, "cpu")
    assert runner.engine is Engine.TORCH
    assert runner.engine_reason == "auto: ONNX Runtime could not load the model (SIGKILL)"
    assert not any(cache.glob(f"**/{engine_trial.UNLOADABLE_PREFIX}*"))


def test_an_export_process_that_ends_well_without_a_word_is_said_by_its_exit_code(
    tmp_path, monkeypatch
):
    """A process that exited 0 and left no outcome was said to have ended by "signal 0":
    a reader of the worker's log went looking for a kill that never happened."""
    from rawserve.worker import onnx_engine

    silent = tmp_path / "silent-python"
    silent.write_text("#!/bin/sh\nexit 0\n")
    silent.chmod(0o755)
    monkeypatch.setattr(onnx_engine.sys, "executable", str(silent))
    head = onnx_engine.HEADS["text-classification"]
    with pytest.raises(onnx_engine.ExportInterrupted, match=r"without a word \(exit code 0\)$"):
        onnx_engine.export(tmp_path, head, tmp_path / "model.onnx")


@pytest.mark.parametrize(
    ("exc", "message"),
    [
        (OSError(28, "No space left on device"), "[Errno 28] No space left on device"),
        (OSError("the disk went away"), "[Errno 5] the disk went away"),  # no errno of its own
    ],
)
def test_an_export_process_s_os_error_crosses_to_the_worker_as_one(exc, message):
    """An OSError with no number (one a library raised with its message alone) could not be
    raised again: the worker failed on the retelling, not with the disk's fault."""
    from rawserve.worker import onnx_engine
    from rawserve.worker.export_process import described

    raised = onnx_engine.raised_again(json.loads(json.dumps(described(exc))))
    assert onnx_engine.failure_name(raised) == "OSError"
    assert str(raised) == message


@pytest.mark.parametrize(
    ("told", "kind", "message"),
    [
        (
            {"kind": "NotExportable", "message": "...", "why": "no file named model.safetensors"},
            "NotExportable",
            "the model cannot be exported to ONNX: no file named model.safetensors",
        ),
        ({"kind": "MemoryError", "message": "out of memory"}, "MemoryError", "out of memory"),
        (
            {"kind": "OSError", "message": "...", "errno": 28, "strerror": "No space left"},
            "OSError",
            "[Errno 28] No space left",
        ),
        (
            {"kind": "TorchExportError", "message": "could not trace"},
            "TorchExportError",
            "could not trace",
        ),
    ],
)
def test_an_export_process_error_is_raised_again_as_its_kind(told, kind, message):
    """What the callers tell apart (the model's fault, memory, the disk) survives the
    process boundary, and the rest keep their class's name for the engine's reason."""
    from rawserve.worker import onnx_engine

    raised = onnx_engine.raised_again(told)
    assert onnx_engine.failure_name(raised) == kind
    assert str(raised) == message


def test_a_layout_timer_exports_in_its_own_process(tmp_path, monkeypatch):
    """A timer ends after its trial: a process of the export's own would only cost a
    first start its imports."""
    from rawserve.worker import onnx_engine

    monkeypatch.setattr(onnx_engine, "_export_apart", True)  # (restored after)
    made = []
    monkeypatch.setattr(onnx_engine, "export_here", lambda *args: made.append(args))
    monkeypatch.setattr(subprocess, "run", lambda *args, **kwargs: pytest.fail("a process"))
    onnx_engine.export_in_this_process()
    head = onnx_engine.HEADS["fill-mask"]
    assert onnx_engine.export(tmp_path, head, tmp_path / "model.onnx") is None
    assert made == [(tmp_path, head, tmp_path / "model.onnx")]
