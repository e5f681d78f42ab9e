"""The models a server will serve, settled before any worker starts.

From the command line's model names (`--model`, repeatable, with `--task` and `--revision`
as defaults) to one `ModelPlan` per model: the names clients use, the local folder its
workers load (a Hub repo resolved through the cache), and what that folder says (task,
pooling). Every way this can fail is one `ModelNotFound` line naming the model.

Server process; never imports torch or transformers.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from rawserve.models.folder import (
    DEFAULT_MODEL_NAME,
    SHIPPED_GRAPH,
    TASK_ALIASES,
    FolderFacts,
    default_model,
    infer_task,
    read_facts,
)
from rawserve.models.hub import (
    ModelNotFound,
    ResolvedModel,
    fetch_shipped_graph,
    only_shipped_graph,
    resolve_model,
)
from rawserve.models.hub_contact import HubContact
from rawserve.models.names import ModelNameError, ModelSpec, default_names, parse_model_spec
from rawserve.shared.messages import Engine
from rawserve.tasks import onnx_unfit

log = logging.getLogger("rawserve")

PACKAGED_REPO_ID = "sentence-transformers/all-MiniLM-L6-v2"  # what the packaged model is
# what a file-by-file cache (transformers' from_pretrained) may lack (`say_unlisted`)
SENTENCE_MODULES = "modules.json"
SENTENCE_CONFIG = "config_sentence_transformers.json"
GENERATION_CONFIG = "generation_config.json"
# why an ONNX-only repo is not served where the ONNX engine may not run
ONNX_ELSEWHERE = (
    "ONNX Runtime serves it only on the CPU, in float32, with onnxruntime installed and "
    "--engine auto or onnx"
)


@dataclass(frozen=True)
class ModelPlan:
    """One model to serve: how clients name it, and what its workers load."""

    names: tuple[str, ...]  # the first is the one /v1/models and answers show
    source: str  # as the command line named it (a folder or a Hub id), for /info
    folder: str | None  # the local folder the workers load; None for a --handler
    commit: str | None = None  # the Hub commit in that folder
    facts: FolderFacts | None = None  # None for a --handler: it says nothing of itself
    handler: str | None = None  # "module:factory" instead of a model folder
    requested_task: str | None = None

    @property
    def name(self) -> str:
        return self.names[0]


def plan_models(
    models: Sequence[str],
    *,
    task: str | None = None,
    pooling: str | None = None,
    revision: str | None = None,
    handler: str | None = None,
    chat_template: bool = False,
    engine: Engine = Engine.AUTO,
    onnx_graphs: bool = False,
) -> list[ModelPlan]:
    """The plans of the models named on the command line (the packaged model when none
    is), in order: the first is the default. Raises ModelNotFound (one line) on a name
    that cannot be read, a model that cannot be had, one whose task is unknown, one
    whose task `engine` does not serve, or a `task`, `pooling` (--pooling), `revision` or
    `chat_template` (--chat-template given) that no model takes. `onnx_graphs`: whether
    the ONNX engine may serve an encoder task here (a Hub repo's own onnx/model.onnx is
    then fetched)."""
    plans = _plans(models, task, revision, handler, onnx_graphs, pooling)
    for plan in plans:
        facts = plan.facts
        unfit = (
            onnx_unfit(facts.task, pooling=facts.pooling)
            if facts and engine is Engine.ONNX
            else None
        )
        if unfit:  # said before any worker starts, not by each worker as it loads
            raise ModelNotFound(f"model {plan.name}: --engine onnx: {unfit}")
    if chat_template and not generates(plans):  # only a text-generation model's chat reads it
        raise ModelNotFound("--chat-template applies to text-generation models, and none is served")
    if pooling and not any(plan.facts and plan.facts.pooling == pooling for plan in plans):
        served = (
            "a masked language model named without another task"
            if pooling == "splade"
            else "feature-extraction models"
        )
        raise ModelNotFound(f"--pooling {pooling} applies to {served}, and none is served")
    return plans


def _task_of(folder: Path, task: str | None) -> str | None:
    """The task served from `folder` (`task`: as named, if named); None where the folder
    cannot say (its facts say what is wrong)."""
    try:
        return TASK_ALIASES.get(task, task) if task else infer_task(folder)
    except (OSError, ValueError):
        return None


def generates(plans: Sequence[ModelPlan]) -> bool:
    """Whether a text-generation model is among those planned."""
    return any(plan.facts is not None and plan.facts.task == "text-generation" for plan in plans)


def _plans(
    models: Sequence[str],
    task: str | None,
    revision: str | None,
    handler: str | None,
    onnx_graphs: bool = False,
    pooling: str | None = None,
) -> list[ModelPlan]:
    if handler:
        if models:
            raise ModelNotFound("--handler serves its own callable: give no --model with it")
        return [ModelPlan((handler,), handler, None, handler=handler)]
    specs = []
    for text in models:
        try:
            specs.append(parse_model_spec(text))
        except ModelNameError as exc:
            raise ModelNotFound(f"--model {text!r}: {exc}") from None
    if revision and not any(not spec.is_folder and not spec.revision for spec in specs):
        # it would be silently unused, as though honoured (the packaged model is a folder)
        raise ModelNotFound(
            f"--revision {revision!r} applies to Hub repos named without @REVISION, "
            "and no --model names one"
        )
    if task and specs and all(spec.task for spec in specs):
        raise ModelNotFound(
            f"--task {task!r} applies to the models named without :TASK, and no --model is one"
        )
    if not specs:
        folder = Path(default_model())
        facts = _facts(folder, task, DEFAULT_MODEL_NAME, pooling)
        names = (DEFAULT_MODEL_NAME, PACKAGED_REPO_ID)
        plans = [ModelPlan(names, PACKAGED_REPO_ID, str(folder), None, facts, None, task)]
    else:
        # a clash the command line shows is refused before anything is downloaded
        _refuse_shared_own_names([default_names(spec)[0] for spec in specs])
        hub = HubContact()  # one for the start: a Hub that did not answer is not asked again
        plans = [
            _plan(
                spec.with_defaults(task=task, revision=revision),
                as_named(spec, task),
                onnx_graphs,
                pooling,
                hub,
            )
            for spec in specs
        ]
    return _unique_names(plans)


def as_named(spec: ModelSpec, task: str | None) -> str:
    """A model as the command line named it, for its errors: its --model text, and the
    --task it takes where that names none of its own (never a `:TASK` the user did not
    type)."""
    return f"{spec} (--task {task})" if task and not spec.task else str(spec)


def _plan(
    spec: ModelSpec,
    named: str,
    onnx_graphs: bool = False,
    pooling: str | None = None,
    hub: HubContact | None = None,
) -> ModelPlan:
    """`spec` with --task and --revision applied (`named`: as the command line named it;
    `onnx_graphs`: fetch the repo's own ONNX graph where the engine may read it;
    `pooling`: --pooling's mode; `hub`: what the start has found of the Hub so far)."""
    resolved = resolve_model(spec, hub)
    say_unlisted(resolved, spec.task, named)
    if only_shipped_graph(resolved):  # its graph is the model, or nothing is
        _fetch_only_graph(resolved, spec.task, named, onnx_graphs, hub)
    facts = _facts(resolved.folder, spec.task, named, pooling)
    if onnx_graphs and onnx_unfit(facts.task, pooling=facts.pooling) is None:  # where read
        try:
            fetch_shipped_graph(resolved, hub=hub)
        except ModelNotFound as exc:
            raise ModelNotFound(f"model {named}: {exc}") from None
    return ModelPlan(
        names=resolved.names,
        source=spec.source,
        folder=str(resolved.folder),
        commit=resolved.commit,
        facts=facts,
        requested_task=spec.task,
    )


def say_unlisted(resolved: ResolvedModel, task: str | None, named: str) -> None:
    """Says, in one line, where a Hub repo's snapshot is served though neither the Hub nor
    the cache listed its files (`ResolvedModel.files`): served offline or with the Hub
    unreachable, a cache filled file by file (transformers' from_pretrained,
    hf_hub_download) looked whole, and a sentence-transformers repo without its
    modules.json was served with another pooling, without a word. Served all the same,
    as transformers and sentence-transformers serve such a cache; what its absence
    changes is named where the folder shows it."""
    if resolved.repo_id is None or resolved.files is not None:
        return
    folder = resolved.folder
    task = _task_of(folder, task)
    missing = ""
    if not (folder / SENTENCE_MODULES).is_file():
        if (folder / SENTENCE_CONFIG).is_file():
            missing = (
                f" (it has {SENTENCE_CONFIG} but no {SENTENCE_MODULES}: a sentence-transformers "
                f"model, served without the pooling, normalization and Dense layers its "
                f"{SENTENCE_MODULES} names)"
            )
        elif task == "feature-extraction":
            missing = (
                f" (it has no {SENTENCE_MODULES}: served with pooling none, where a "
                f"sentence-transformers repo's {SENTENCE_MODULES} names its own pooling, "
                "normalization and Dense layers)"
            )
    if task == "text-generation" and not (folder / GENERATION_CONFIG).is_file():
        missing = f" (it has no {GENERATION_CONFIG}: the repo's generation defaults are not read)"
    log.warning(
        "model %s: the Hub cache holds no listing of %s's files at %s (a cache filled by "
        "transformers' from_pretrained or hf_hub_download), so files the Hub has may be "
        "missing%s: to complete it, start once with the Hub reachable (--download-only does, "
        "without serving)",
        named,
        resolved.repo_id,
        resolved.commit,
        missing,
    )


def _fetch_only_graph(
    resolved: ResolvedModel,
    task: str | None,
    named: str,
    onnx_graphs: bool,
    hub: HubContact | None = None,
) -> None:
    """An ONNX-only repo's graph, where the ONNX engine may serve the model here; else
    ModelNotFound saying why it cannot be served (nothing is downloaded for it). A task
    the folder does not say is left to its facts to report."""
    task = _task_of(resolved.folder, task)
    if task is None:
        return
    unfit = onnx_unfit(task) or (None if onnx_graphs else ONNX_ELSEWHERE)
    if unfit:
        holder = "repo" if resolved.repo_id else "folder"
        raise ModelNotFound(
            f"model {named}: the {holder} has no PyTorch weights, only its ONNX graph "
            f"({SHIPPED_GRAPH}), and {unfit}"
        )
    try:
        fetch_shipped_graph(resolved, only_weights=True, hub=hub)
    except ModelNotFound as exc:
        raise ModelNotFound(f"model {named}: {exc}") from None


def _facts(folder: Path, task: str | None, named: str, pooling: str | None) -> FolderFacts:
    try:
        return read_facts(folder, task, pooling)
    except ValueError as exc:
        raise ModelNotFound(f"model {named}: {exc}") from None


def _refuse_shared_own_names(names: Sequence[str]) -> None:
    """Each model's own name (its first) must be unique: ModelNotFound where two share one.
    Checked on the command line's names before any download (`--model org/emb --model
    org/emb@v2` was refused only once both were downloaded), and on the plans after."""
    own: set[str] = set()
    for name in names:
        if name in own:
            raise ModelNotFound(  # (an alias may be one of the two: it needs another)
                f"two models are named {name!r} (an alias, or a folder's or Hub id's "
                "name): give each a name of its own (ALIAS=MODEL)"
            )
        own.add(name)


def _unique_names(plans: Sequence[ModelPlan]) -> list[ModelPlan]:
    """Each model keeps its own name, which must be unique; a second name (the Hub id or
    folder name beside an alias) that two models share is ambiguous and neither keeps it."""
    _refuse_shared_own_names([plan.name for plan in plans])
    own = {plan.name for plan in plans}
    counts: dict[str, int] = {}
    for plan in plans:
        for name in plan.names[1:]:
            counts[name] = counts.get(name, 0) + 1
            if name in own:  # its requests go to the model of that alias (a tester)
                log.warning(
                    "model %s is not also named %r: that is another model's alias, which "
                    "requests by that name reach",
                    plan.name,
                    name,
                )
    return [
        replace(
            plan,
            names=(
                plan.name,
                *(n for n in plan.names[1:] if counts[n] == 1 and n not in own),
            ),
        )
        for plan in plans
    ]
