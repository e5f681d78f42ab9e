"""The ONNX Runtime engine: an encoder's forward pass run by onnxruntime instead of torch.

Worker process only (imports torch, transformers and, from the `onnx` extra, onnxruntime).
`OnnxNetwork` stands where the runners put a transformers model: called with the
tokenizer's tensors, it answers the same output class with the same fields (logits,
start/end logits, last hidden state) as torch tensors, so every runner and pipeline keeps
its own pre- and post-processing and answers as the torch engine does (within 1e-4).

The graph comes from the model folder when it ships one (`onnx/model.onnx`, as many Hub
repos do) that fits what the runners feed and read (`shipped_unfit`; one that does not,
or that onnxruntime cannot load, is said in a line), otherwise it is exported once into
a cache folder keyed by the model's files, the head, and the exporter's versions, so a
restart loads it in a second. The recipe, measured on all-MiniLM-L6-v2 with torch 2.13,
transformers 5.23, onnxruntime 1.32 on 2 cores: `torch.onnx.export(dynamo=True)` with
dynamic batch and sequence dims (about 18 s), then onnxscript's onnxruntime fusions
(about 4 s), which fuse each layer's attention into one `Attention` node, plus
SkipLayerNormalization and BiasGelu; outputs within 1e-5 of torch. Without the fusions
the graph runs about 5 % slower at batch 64 (216 against 228 items/s with 2 threads;
torch: 202). The legacy exporter followed by onnxruntime's BERT optimizer fuses as well,
but needs the head count per architecture and is deprecated; optimum-onnx pins
transformers 4.

ONNX Runtime sets its intra-op threads per session, not per call: a session is made at
load for each thread count the core sharing may ask for (a worker's even share of the
cores, and every core for a lone item), so no request waits for one to be made. The
export keeps its weights in a file beside the graph, which each session maps instead of
reading its own copy (MiniLM, two workers: each 436-455 -> 351 MB proportional set size);
a model's own graph with its weights inside is served from a copy in the cache with them
beside it (`own_graph_apart`; MiniLM's shipped graph: 446 -> 357-362 MB).
"""

from __future__ import annotations

import contextlib
import gc
import importlib.metadata
import importlib.util
import io
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import modeling_outputs

from rawserve.models.folder import SHIPPED_GRAPH, TORCH_WEIGHTS
from rawserve.shared.devices import cpu_cores
from rawserve.shared.logs import first_line
from rawserve.shared.memory import give_back_free_memory
from rawserve.worker import engine_trial
from rawserve.worker.graph_cache import CacheNotWritable, NothingToCache, cached_graph, identity
from rawserve.worker.model_classes import Untrained, every_output_labelled, load_model

log = logging.getLogger("rawserve.onnx")

# bump when the export recipe changes: cached graphs are made again (2: the export keeps
# what its model had random, which a graph of recipe 1 never said; 3: the weights in a
# file beside the graph, which ONNX Runtime maps instead of copying into each session)
RECIPE = 3
SHIPPED = f"the model's own {SHIPPED_GRAPH}"  # where the served graph came from, for /info
EXPORTED = "exported"
# What the runners feed a network: the tokenizer's tensors, (batch, sequence) of int64
FED_INPUTS = frozenset({"input_ids", "attention_mask", "token_type_ids"})
WEIGHTS_FILE = "model.onnx.data"  # the graph's weights, beside it (optimum's name)
# ONNX Runtime maps a weight from the file only where it starts at a multiple of the
# page size; one it cannot map is read into each session's memory
WEIGHTS_ALIGNMENT = 65536
# A model's own graph whose file is this large holds its weights (one whose weights are in
# a file beside it is their structure alone: MiniLM's, 200 KB); bump APART_RECIPE when the
# copy with the weights apart changes
WEIGHTS_INSIDE_BYTES = 2**20
APART_RECIPE = 2  # 2: no copy of a graph whose weights are beside it (it went stale)
# ONNX Runtime's own log: fatal lines only. An error it logs it also raises, which the
# callers say in one line; logged, it came first, a red line of C++ signatures (a
# graph whose weights file was cut short, failing as its constants were folded)
ONLY_FATAL_LOGS = 4
EXPORT_BATCH = 2  # the example batch traced at export (its sizes are made dynamic)
UNTRAINED = "untrained"  # key.json's record of the weights the export's model had at random
EXPORT_OUTCOME = "outcome.json"  # beside the graph while the export's process makes it


@dataclass(frozen=True)
class Head:
    """What a task's model answers: its transformers class, ONNX outputs, output class,
    and the dimensions of each output (batch, then labels, or sequence and more), the
    last of them the config's `size` where it names one."""

    auto_class: str
    outputs: tuple[str, ...]
    output_class: type
    rank: int
    pairs: bool = False  # it reads text pairs, whose halves the token_type_ids tell apart
    size: str | None = None  # the config's attribute that each output's last dimension is


HEADS: dict[str, Head] = {
    "feature-extraction": Head(
        "AutoModel",
        ("last_hidden_state",),
        modeling_outputs.BaseModelOutput,
        3,
        size="hidden_size",
    ),
    "text-classification": Head(
        "AutoModelForSequenceClassification",
        ("logits",),
        modeling_outputs.SequenceClassifierOutput,
        2,
        pairs=True,
        size="num_labels",
    ),
    "zero-shot-classification": Head(
        "AutoModelForSequenceClassification",
        ("logits",),
        modeling_outputs.SequenceClassifierOutput,
        2,
        pairs=True,
        size="num_labels",
    ),
    "token-classification": Head(
        "AutoModelForTokenClassification",
        ("logits",),
        modeling_outputs.TokenClassifierOutput,
        3,
        size="num_labels",
    ),
    "fill-mask": Head(
        "AutoModelForMaskedLM", ("logits",), modeling_outputs.MaskedLMOutput, 3, size="vocab_size"
    ),
    "question-answering": Head(
        "AutoModelForQuestionAnswering",
        ("start_logits", "end_logits"),
        modeling_outputs.QuestionAnsweringModelOutput,
        2,
        pairs=True,
    ),
}
ONNX_TASKS = frozenset(HEADS)


class NotExportable(RuntimeError):
    """The model could not be read for its export (transformers' "no file named ..."):
    said as the model's fault, not as the cache's (it was "the cache folder cannot be
    written")."""

    def __init__(self, why: str):
        super().__init__(f"the model cannot be exported to ONNX: {why}")
        self.why = why


class ExportFailed(RuntimeError):
    """The export's process failed with an error of `kind` (its class's name there), or
    ended without saying (killed: `kind` names the signal or exit code)."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


class ExportInterrupted(ExportFailed):
    """The export's process ended without telling how (killed: the kernel's OOM killer, an
    operator): the machine's doing, which the next start may not meet."""


def failure_name(exc: BaseException) -> str:
    """The kind of error that stopped an engine's load, an export's as it was raised in
    the export's own process."""
    return exc.kind if isinstance(exc, ExportFailed) else type(exc).__name__


def onnxruntime_installed() -> bool:
    """Whether `onnxruntime` can be imported: from the `onnx` extra's onnxruntime, or from
    onnxruntime-gpu, -openvino and the others that provide the same module."""
    return importlib.util.find_spec("onnxruntime") is not None


def _version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "none"


class OnnxNetwork(torch.nn.Module):
    """A transformers model's forward pass, run by onnxruntime on the CPU."""

    def __init__(
        self,
        graph: Path,
        config: Any,
        head: Head,
        threads: int,
        cores: int = 1,
        source: str = EXPORTED,
    ):
        super().__init__()
        import onnxruntime  # the optional `onnx` extra: imported only when the engine runs

        self.ort = onnxruntime
        self.graph = graph
        self.source = source  # SHIPPED or EXPORTED, for the log and /info
        # what the export's model had no trained weights for, kept beside the graph
        # (None: nothing, or a shipped graph, whose weights are the repo's)
        self.untrained = Untrained.from_dict(kept_untrained(graph)) if source == EXPORTED else None
        self.config = config
        # transformers' pipelines name the model by it in their errors (fill-mask's "no
        # mask token"): without it the client's error would become an AttributeError.
        # The model type is what most of transformers' own classes use.
        self.base_model_prefix = config.model_type
        self.head = head
        self.device = torch.device("cpu")
        self.dtype = torch.float32
        self._sessions: dict[int, Any] = {}
        self._threads = max(1, threads)
        session = self._session(self._threads)
        self._session(max(1, cores))  # a lone item's: every core
        self.input_names = tuple(node.name for node in session.get_inputs())

    def can_generate(self) -> bool:
        return False

    def set_threads(self, count: int) -> None:
        """The intra-op threads of the next calls (a session per count, made once)."""
        self._threads = max(1, count)

    def _session(self, threads: int) -> Any:
        session = self._sessions.get(threads)
        if session is None:
            options = self.ort.SessionOptions()
            options.intra_op_num_threads = threads
            options.inter_op_num_threads = 1
            options.graph_optimization_level = self.ort.GraphOptimizationLevel.ORT_ENABLE_ALL
            # Threads that spin after a call keep a core from the other worker and the
            # event loop; on a shared machine that costs more than the wake-up saves.
            options.add_session_config_entry("session.intra_op.allow_spinning", "0")
            options.log_severity_level = ONLY_FATAL_LOGS
            session = self.ort.InferenceSession(
                str(self.graph), options, providers=["CPUExecutionProvider"]
            )
            self._sessions[threads] = session
        return session

    def forward(self, **inputs: Any) -> Any:
        session = self._session(self._threads)
        feeds = {}
        for name in self.input_names:
            value = inputs.get(name)
            if value is None:  # e.g. token_type_ids that a pipeline did not send: zeros
                value = torch.zeros_like(inputs["input_ids"])
            feeds[name] = value.detach().cpu().numpy().astype("int64", copy=False)
        outputs = session.run(list(self.head.outputs), feeds)
        return self.head.output_class(
            **{
                name: torch.from_numpy(array)
                for name, array in zip(self.head.outputs, outputs, strict=True)
            }
        )


def load_network(model: str, task: str, threads: int, cache_dir: Path | None = None) -> Any:
    """The model folder's network for `task`, run by onnxruntime."""
    head = HEADS[task]
    folder = Path(model)
    config = transformers.AutoConfig.from_pretrained(model)
    every_output_labelled(config)
    cores = cpu_cores()
    cache_dir = cache_dir or engine_trial.default_cache_dir()
    shipped = folder / SHIPPED_GRAPH
    if shipped.is_file():
        unfit = shipped_unfit(shipped, head, tokenizer_inputs(model), config)
        if unfit is None:
            try:
                network = _own_network(folder, cache_dir, config, head, threads, cores)
            except Exception as exc:  # noqa: BLE001 - onnxruntime's errors derive from Exception
                unfit = f"ONNX Runtime cannot load it ({first_line(exc)})"
            else:
                log.info("ONNX engine: the model's own graph %s", SHIPPED_GRAPH)
                return network
        if not any((folder / name).is_file() for name in TORCH_WEIGHTS):
            # nothing to export: an export spent 6-100 s to fail blaming the weights
            raise ValueError(
                f"the folder has no PyTorch weights, only its ONNX graph ({SHIPPED_GRAPH}), "
                f"which does not serve {task}: {unfit}"
            )
        log.warning("ONNX engine: %s does not serve %s: %s; exported instead", SHIPPED, task, unfit)
    graph = exported_graph(folder, head, cache_dir)
    try:
        return OnnxNetwork(graph, config, head, threads, cores)
    except (MemoryError, ImportError):
        # the process's memory, not the graph (onnxruntime's library that could not be
        # mapped is an ImportError): a good graph was removed and exported again, at every
        # restart under memory pressure
        raise
    except Exception as exc:  # noqa: BLE001 - onnxruntime's errors derive from Exception only
        # A graph cut short (a crash before its data reached the disk, a full disk, a hand
        # edit) would fail every start: it is made again.
        damaged = identity(graph)
        log.warning(
            "ONNX engine: the cached graph %s cannot be loaded (%s): exported again",
            graph,
            first_line(exc),
        )
    graph = exported_graph(folder, head, cache_dir, damaged)
    return OnnxNetwork(graph, config, head, threads, cores)


def _own_network(
    folder: Path, cache_dir: Path, config: Any, head: Head, threads: int, cores: int
) -> OnnxNetwork:
    """The network of the model's own graph: from its copy with the weights apart
    (`own_graph_apart`) where there is one, else from the graph as shipped."""
    shipped = folder / SHIPPED_GRAPH
    copy = own_graph_apart(folder, cache_dir)
    if copy is not None:
        try:
            return OnnxNetwork(copy, config, head, threads, cores, SHIPPED)
        except (MemoryError, ImportError):  # the process's memory, not the copy
            raise
        except Exception as exc:  # noqa: BLE001 - onnxruntime's errors derive from Exception only
            # cut short (a crash before its data reached the disk, a hand edit): the
            # next start makes it again
            log.warning(
                "ONNX engine: the copy %s of %s cannot be loaded (%s): removed; the graph "
                "is served as shipped",
                copy,
                SHIPPED_GRAPH,
                first_line(exc),
            )
            shutil.rmtree(copy.parent, ignore_errors=True)
    return OnnxNetwork(shipped, config, head, threads, cores, SHIPPED)


def own_graph_apart(folder: Path, cache_dir: Path) -> Path | None:
    """A copy in the cache of the model's own graph, made once, with its weights moved
    from inside the graph's file to WEIGHTS_FILE beside it, which ONNX Runtime maps: read
    from inside the file, each session (two a worker) held a copy of them. None where its
    weights are beside it already, or where no copy can be made (without onnx_ir, in a
    cache that cannot be written, of a graph onnx_ir cannot read): the graph is then
    served as shipped. A graph's file over WEIGHTS_INSIDE_BYTES may still be a structure
    alone, its weights beside it (a large one, or one with a long doc string): copied,
    those weights went with the copy, keyed by the graph's file alone, and weights saved
    again beside the same graph (a model trained anew, exported again) were served stale
    from the copy."""
    shipped = folder / SHIPPED_GRAPH
    if shipped.stat().st_size < WEIGHTS_INSIDE_BYTES:
        return None
    key = {
        "head": SHIPPED_GRAPH,  # (what the cache keeps one of per model folder)
        "graph": engine_trial.fingerprint(shipped),
        "recipe": APART_RECIPE,
        "onnx_ir": _version("onnx_ir"),
    }

    def make(path: Path) -> dict[str, Any]:
        import onnx_ir

        graph = onnx_ir.load(shipped)  # (weights in a file beside it are not read)
        if weights_beside(graph):
            raise NothingToCache(str(folder.resolve()))
        _save_apart(graph, path)
        # the loaded graph's reference cycles hold its weights until a collection that
        # may not come soon (MiniLM, in a bare process: 168 MB resident, 82 collected)
        gc.collect()
        give_back_free_memory()
        return {"folder": str(folder.resolve())}

    try:
        found = cached_graph(cache_dir, f"{folder.resolve().name}-own", key, make)
    except NothingToCache:
        return None
    except Exception as exc:  # noqa: BLE001 - a saving of memory, never a reason to fail
        if isinstance(exc, CacheNotWritable) and not _weights_inside(shipped):
            return None  # (none was wanted, its weights beside it: nothing to warn of)
        log.warning(
            "ONNX engine: %s is served as shipped, each session reading its weights: no "
            "copy with them apart could be made (%s)",
            SHIPPED_GRAPH,
            first_line(exc),
        )
        return None
    if found.made_in is not None:
        log.info(
            "ONNX engine: %s copied with its weights apart in %.1f s into %s",
            SHIPPED_GRAPH,
            found.made_in,
            found.graph.parent,
        )
    return found.graph


# why a graph must take a tensor the tokenizer gives, where it does (`shipped_unfit`)
NEEDED_INPUTS = {
    "attention_mask": "its answers would change with the padding of the batch they ride in",
    "token_type_ids": "a pair's second text would be read as part of the first",
}


def tokenizer_inputs(model: str) -> frozenset[str] | None:
    """The tensors the model's tokenizer gives (its `model_input_names`); None where it
    cannot be loaded here (the runner's own load then says why)."""
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(model)
    except Exception:  # noqa: BLE001 - any failure: the runner's load reports it
        return None
    return frozenset(tokenizer.model_input_names)


def shipped_unfit(
    graph: Path, head: Head, given: frozenset[str] | None = None, config: Any = None
) -> str | None:
    """Why a shipped graph cannot serve this head (None: it can), read from the graph
    alone, without its weights: it must take only the tokenizer's int64 tensors, of any
    batch and length, among them the attention mask and (for a head that reads text
    pairs) the segment ids where the tokenizer gives them (`given`), and answer the
    head's outputs in float32 with the head's dimensions, the last of the size `config`
    gives where the graph fixes it (`config_size`). Whether its answers are the model's
    is not checked: the repo's export is trusted."""
    import onnx  # the optional `onnx` extra

    try:
        model = onnx.load(str(graph), load_external_data=False)
    except Exception as exc:  # noqa: BLE001 - protobuf's DecodeError, an OSError
        return f"it cannot be read ({first_line(exc) or type(exc).__name__})"
    weights = {tensor.name for tensor in model.graph.initializer}  # listed as inputs by old graphs
    inputs = {value.name: value for value in model.graph.input if value.name not in weights}
    outputs = {value.name: value for value in model.graph.output}
    if "input_ids" not in inputs:
        return f"it takes no input_ids (it takes {', '.join(inputs) or 'nothing'})"
    unfed = sorted(set(inputs) - FED_INPUTS)
    if unfed:
        return f"it takes inputs the tokenizer does not give ({', '.join(unfed)})"
    needed = {"attention_mask", "token_type_ids"} if head.pairs else {"attention_mask"}
    left_out = sorted((needed & (given or frozenset())) - set(inputs))
    if left_out:
        return "; ".join(
            f"it takes no {name}, which the tokenizer gives: {NEEDED_INPUTS[name]}"
            for name in left_out
        )
    for name, value in inputs.items():
        tensor = value.type.tensor_type
        if tensor.elem_type != onnx.TensorProto.INT64:
            return f"its {name} is not int64"
        if tensor.HasField("shape") and (
            len(tensor.shape.dim) != 2 or any(dim.HasField("dim_value") for dim in tensor.shape.dim)
        ):
            return f"its {name} is not of any batch size and length"
    missing = [name for name in head.outputs if name not in outputs]
    if missing:
        return f"it answers no {', '.join(missing)} (it answers {', '.join(outputs) or 'nothing'})"
    for name in head.outputs:
        tensor = outputs[name].type.tensor_type
        if tensor.elem_type != onnx.TensorProto.FLOAT:
            return f"its {name} is not float32"
        if not tensor.HasField("shape"):
            continue
        if len(tensor.shape.dim) != head.rank:
            return f"its {name} has {len(tensor.shape.dim)} dimensions, not {head.rank}"
        last, size = tensor.shape.dim[-1], config_size(config, head)
        if size is not None and last.HasField("dim_value") and last.dim_value != size:
            # a classifier's 3 logits under 2 labels: a 500 at top_k 3 (no id2label[2]),
            # or, a reranker's 2 under 1 label, wrong scores answered 200
            return (
                f"its {name} has {last.dim_value} values in its last dimension, where "
                f"config.json's {head.size} is {size}"
            )
    return None


def config_size(config: Any, head: Head) -> int | None:
    """The size the model's config gives each of the head's outputs in its last
    dimension (None: the head's has none, or the config does not say it)."""
    value = getattr(config, head.size, None) if head.size and config is not None else None
    return value if type(value) is int and value > 0 else None


def cache_key(folder: Path, head: Head) -> dict[str, Any]:
    """What an exported graph depends on: the model's files (by content, so a Hub
    revision or a re-saved folder is another graph), the head and the exporter."""
    return {
        "files": engine_trial.fingerprints(folder, (".json", ".safetensors", ".bin")),
        "head": head.auto_class,
        "recipe": RECIPE,
        "torch": _version("torch"),
        "transformers": _version("transformers"),
        "onnxscript": _version("onnxscript"),
    }


def exported_graph(
    folder: Path, head: Head, cache_dir: Path, damaged: tuple[int, int, int] | None = None
) -> Path:
    """The cached export of `folder` for `head`; made now (once, under a lock) if missing,
    or if it is still the file `damaged` identifies (`identity`), one that would not load."""

    def make(path: Path) -> dict[str, Any]:
        untrained = export(folder, head, path)
        return {
            "folder": str(folder.resolve()),
            # so that a start from the cache warns as the export's did
            UNTRAINED: untrained.as_dict() if untrained is not None else None,
        }

    found = cached_graph(cache_dir, folder.resolve().name, cache_key(folder, head), make, damaged)
    if found.made_in is not None:
        log.info(
            "ONNX engine: exported %s (%s) in %.1f s into %s",
            folder.name,
            head.auto_class,
            found.made_in,
            found.graph.parent,
        )
    elif found.by_another:
        log.info("ONNX engine: the graph another worker exported meanwhile, %s", found.graph)
    else:
        log.info("ONNX engine: the graph exported before, %s", found.graph)
    return found.graph


class _Forward(torch.nn.Module):
    """The model with named tensor inputs and the head's outputs as a tuple."""

    def __init__(self, model: Any, input_names: tuple[str, ...], outputs: tuple[str, ...]):
        super().__init__()
        self.model = model
        self.input_names = input_names
        self.outputs = outputs

    def forward(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        result = self.model(**dict(zip(self.input_names, tensors, strict=True)))
        return tuple(result[name] for name in self.outputs)


# Whether an export runs in a process of its own (`export`): a worker serves for long
# after it; a layout timer ends after its trial and takes what the exporter loaded with it.
_export_apart = True


def export_in_this_process() -> None:
    """Export here from now on: for a process that ends after its trial (a layout timer),
    which a process of the export's own would only cost its imports (a few seconds)."""
    global _export_apart
    _export_apart = False


def export(folder: Path, head: Head, path: Path) -> Untrained | None:
    """`export_here` in a process of its own (rawserve.worker.export_process), so that
    what the exporter loads is not kept by this one; its error raised again here."""
    if not _export_apart:
        return export_here(folder, head, path)
    outcome = path.with_name(EXPORT_OUTCOME)
    # this process's own modules, not what the working directory holds (`-P`: no
    # directory put first; a checkout of another version there was imported instead)
    command = [sys.executable, "-P", "-m", "rawserve.worker.export_process"]
    command += [str(folder), task_of(head), str(path), str(outcome)]
    found = os.pathsep.join(entry or os.getcwd() for entry in sys.path)
    try:
        ended = subprocess.run(
            command, stdin=subprocess.DEVNULL, check=False, env={**os.environ, "PYTHONPATH": found}
        )
        try:
            told = json.loads(outcome.read_text())
        except (OSError, ValueError):
            told = None
    finally:
        outcome.unlink(missing_ok=True)  # (not part of the graph's folder)
    if not isinstance(told, dict):
        kind = ended_how(ended.returncode)
        raise ExportInterrupted(kind, f"the export's process ended without a word ({kind})")
    if "error" in told:
        raise raised_again(told["error"])
    return Untrained.from_dict(told.get("untrained"))


def raised_again(error: dict[str, Any]) -> Exception:
    """The error the export's process described (export_process.described), as the kind
    this process's callers tell apart: the model's fault, memory, the disk, or the rest."""
    kind, message = str(error.get("kind")), str(error.get("message"))
    if "why" in error:
        return NotExportable(str(error["why"]))
    if kind == "MemoryError":
        return MemoryError(message)
    if "errno" in error:
        return OSError(int(error["errno"]), str(error.get("strerror", message)))
    return ExportFailed(kind, message)


def ended_how(code: int) -> str:
    """A process's return code in words: its signal's name, or its exit code."""
    if code >= 0:
        return f"exit code {code}"
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def task_of(head: Head) -> str:
    """A task whose head `head` is (two tasks may share one: the same export)."""
    return next(task for task, known in HEADS.items() if known == head)


def export_here(folder: Path, head: Head, path: Path) -> Untrained | None:
    """torch.onnx's dynamo exporter, dynamic batch and sequence, then the ORT fusions;
    what the model's checkpoint left untrained, which the graph keeps random."""
    try:
        model, untrained = load_model(head.auto_class, str(folder), dtype=torch.float32)
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
    except OSError as exc:  # the model's files (no weights), not the cache's
        raise NotExportable(first_line(exc)) from exc
    model.eval()
    example = tokenizer(
        ["an example input", "a longer example input for the export"][:EXPORT_BATCH],
        padding=True,
        return_tensors="pt",
    )
    input_names = tuple(name for name in example if name in _forward_inputs(model))
    batch = torch.export.Dim("batch", max=4096)
    sequence = torch.export.Dim("sequence", max=max(8, _max_positions(model)))
    wrapper = _Forward(model, input_names, head.outputs).eval()
    chatter = io.StringIO()
    # The exporter's progress lines, its log lines ("torchvision is not installed") and its
    # libraries' deprecation warnings are not the user's to act on: they go to the debug log.
    with (
        torch.inference_mode(False),
        torch.no_grad(),
        warnings.catch_warnings(),
        contextlib.redirect_stdout(chatter),
        _exporter_logs_at_debug(),
    ):
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            wrapper,
            tuple(example[name] for name in input_names),
            dynamo=True,
            input_names=list(input_names),
            output_names=list(head.outputs),
            # one entry: the wrapper's *tensors, each dynamic in batch and sequence
            dynamic_shapes=(tuple({0: batch, 1: sequence} for _ in input_names),),
            optimize=True,
            verbose=False,
        )
    log.debug("exporter: %s", chatter.getvalue())
    assert program is not None
    exported = path.with_name("exported-" + path.name)
    program.save(str(exported))  # (a graph past 2 GB with its weights in "<name>.data")
    del program, model, wrapper
    _fuse(exported, path)
    exported.unlink()
    exported.with_name(exported.name + ".data").unlink(missing_ok=True)
    return untrained


def kept_untrained(graph: Path) -> Any:
    """What the export of `graph` recorded of its model's untrained weights (None: none,
    or a graph exported before this was recorded)."""
    try:
        return json.loads((graph.parent / "key.json").read_text()).get(UNTRAINED)
    except (OSError, ValueError, AttributeError):
        return None


class _AtDebug(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        level = record.levelno if record.levelno >= logging.ERROR else logging.DEBUG
        log.log(level, "exporter: %s", record.getMessage())


@contextlib.contextmanager
def _exporter_logs_at_debug() -> Iterator[None]:
    """torch.onnx's log lines as debug lines of this module's log (an error stays one)."""
    exporter = logging.getLogger("torch.onnx")
    handlers, propagate = exporter.handlers, exporter.propagate
    exporter.handlers, exporter.propagate = [_AtDebug()], False
    try:
        yield
    finally:
        exporter.handlers, exporter.propagate = handlers, propagate


def _forward_inputs(model: Any) -> set[str]:
    import inspect

    return set(inspect.signature(model.forward).parameters)


def _max_positions(model: Any) -> int:
    return int(getattr(model.config, "max_position_embeddings", 0) or 512)


def _fuse(exported: Path, path: Path) -> None:
    """The `exported` graph with onnxscript's onnxruntime fusions (fused attention, layer
    norms, GELU) saved at `path`, its weights in WEIGHTS_FILE beside it. A graph they
    cannot rewrite, or whose fused form ONNX Runtime refuses, is saved as exported: slower,
    not wrong. A graph that cannot be written (a full disk) is the cache folder's failure:
    raised as the export's."""
    import onnx_ir

    try:
        from onnxscript.rewriter.ort_fusions import optimize_for_ort

        graph = onnx_ir.load(exported)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            graph, counts = optimize_for_ort(graph)
    except Exception:  # noqa: BLE001 - an optimisation, never a reason to fail
        log.warning("ONNX engine: the fusions failed; the graph stays as exported", exc_info=True)
        _save_apart(onnx_ir.load(exported), path)
        return
    _save_apart(graph, path)
    if (refused := unloadable(path)) is not None:
        # GPT-2's: a Gemm fused over 3-D inputs, which ONNX Runtime's shape checks refuse
        log.warning(
            "ONNX engine: the fused graph does not load (%s); it stays as exported", refused
        )
        _save_apart(onnx_ir.load(exported), path)
        return
    fused = {name: count for name, count in counts.items() if count}
    log.info("ONNX engine: fused %s", fused or "nothing")


def _weights_inside(path: Path) -> bool:
    """Whether the graph at `path` keeps all its weights inside its file (True where it
    cannot be read: the warning then says so)."""
    try:
        import onnx_ir

        return not weights_beside(onnx_ir.load(path))
    except Exception:  # noqa: BLE001 - without onnx_ir, or unreadable
        return True


def weights_beside(graph: Any) -> bool:
    """Whether an onnx_ir graph keeps any of its weights in a file beside it."""
    import onnx_ir

    values = graph.graph.initializers.values()
    return any(isinstance(value.const_value, onnx_ir.ExternalTensor) for value in values)


def _save_apart(graph: Any, path: Path) -> None:
    """`graph` saved at `path` with its weights in WEIGHTS_FILE beside it. Kept inside the
    graph's file, each ONNX Runtime session (one per thread count, in each worker) held a
    copy of them: MiniLM's two sessions took 281 MB, mapped from the file 174."""
    import onnx_ir

    onnx_ir.save(graph, path, external_data=WEIGHTS_FILE, alignment=WEIGHTS_ALIGNMENT)


def unloadable(graph: Path) -> str | None:
    """Why ONNX Runtime refuses to load `graph` (its first line), or None where it loads."""
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.log_severity_level = ONLY_FATAL_LOGS
    try:
        onnxruntime.InferenceSession(str(graph), options, providers=["CPUExecutionProvider"])
    except Exception as exc:  # noqa: BLE001 - any refusal: the graph is not served
        return first_line(exc)
    return None
