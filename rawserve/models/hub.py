"""Resolving a named model to a local folder: a folder as it is, a Hub repo through its cache.

Runs in the server process, once per model, before any worker starts: the workers are
given the resolved folder and never look anything up themselves. A Hub repo id goes
through `huggingface_hub.snapshot_download`, so everything it honours applies: the cache
(`HF_HOME`, `HF_HUB_CACHE`), `HF_TOKEN` for private and gated repos, `HF_ENDPOINT` for a
mirror, `HF_HUB_OFFLINE=1` to use the cache alone. Files the worker never reads (other
frameworks' weights, exported ONNX/OpenVINO copies, and the pickled PyTorch weights when
the model's weights are also safetensors) are not downloaded, but for a repo's own float32
`onnx/model.onnx`, fetched apart (`fetch_shipped_graph`) once the model's task says the
ONNX engine may serve it (never its quantized variants: they answer otherwise), the
repo's only weights where it has no others (`only_shipped_graph`). Progress
goes to the log, a line every few seconds; every way resolution can fail becomes one
`ModelNotFound` whose message says what to do, never a traceback. Once the Hub has not
answered in a start (`HubContact`), that start's look-ups are made in the cache alone.

Never imports torch or transformers (huggingface_hub does not either). huggingface_hub
reads its HF_* variables as its modules load (`huggingface_hub.constants`), and a value
it cannot read (HF_HUB_ETAG_TIMEOUT=abc) ends that import in a traceback: those modules
are imported where they are used, once the command line, which refuses such a value in
one line (rawserve.options), has been read.
"""

from __future__ import annotations

import errno
import glob
import json
import logging
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from fnmatch import fnmatchcase
from functools import partial
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import httpx2
from huggingface_hub.errors import (
    CachedRepoTreeNotFoundError,
    DisabledRepoError,
    GatedRepoError,
    HfHubHTTPError,
    HFValidationError,
    IncompleteSnapshotError,
    LocalEntryNotFoundError,
    OfflineModeIsEnabled,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.utils import validate_repo_id
from tqdm.std import tqdm

from rawserve.models.folder import SHIPPED_GRAPH, SHIPPED_GRAPH_DATA, TORCH_WEIGHTS
from rawserve.models.hub_asking import MAX_HUB_WAIT_SECONDS, AskingAgain, wait_asked
from rawserve.models.hub_contact import HubContact, in_short, not_answering
from rawserve.models.hub_integrity import changed_downloads, cut_short, forget
from rawserve.models.names import ModelSpec, default_names, is_folder
from rawserve.models.sentence_folder import dense_paths
from rawserve.shared.logs import first_line, without_credentials

log = logging.getLogger("rawserve.models")

# Files a transformers worker never reads: other frameworks' weights and exported copies.
NOT_NEEDED = [
    "*.h5",
    "*.msgpack",
    "*.ot",
    "*.tflite",
    "*.onnx",
    "*.onnx_data",
    "*.gguf",
    "*.mlmodel",
    "onnx/*",
    "openvino/*",
    "coreml/*",
    # what a training run leaves beside a model: its checkpoints (an optimizer's state is
    # twice the model), logs and settings, which no worker reads
    "*checkpoint-*/*",
    "*global_step*/*",
    "runs/*",
    "*.tfevents.*",
    "*.ckpt",
    "optimizer.pt",
    "scheduler.pt",
    "rng_state*.pth",
    "training_args.bin",
]
PICKLED_WEIGHTS = ["*.bin", "*.pt", "*.pth"]  # skipped when the repo has safetensors
# the model's safetensors, which transformers loads before its .bin (another safetensors
# file, an adapter's or a module's, leaves the .bin the weights)
SAFETENSORS_WEIGHTS = ("model.safetensors", "model.safetensors.index.json")
PROGRESS_SECONDS = 5.0  # a download logs a progress line this often
# a commit as `git log --oneline` and the Hub's pages show it: its first hex digits
SHORT_COMMIT = re.compile(r"[0-9a-f]{7,39}")
COMMIT = re.compile(r"[0-9a-f]{7,40}")  # a commit's id, whole or short
WHOLE_COMMIT = re.compile(r"[0-9a-f]{40}")  # a commit's whole id: what it holds never changes
DISK_FULL = (errno.ENOSPC, errno.EDQUOT)  # a download's write that found no room


class ModelNotFound(Exception):
    """A model that cannot be had; the message is one line saying what to fix."""


@dataclass(frozen=True)
class ResolvedModel:
    """A model name and the local folder that holds its files."""

    spec: ModelSpec
    folder: Path
    commit: str | None = None  # the Hub commit the folder holds; None for a plain folder
    # the repo's file names at that commit, if known: None for a Hub repo where neither the
    # Hub nor the cache's listing said them (`plan.say_unlisted`)
    files: tuple[str, ...] | None = None

    @property
    def names(self) -> tuple[str, ...]:
        """What clients may call it: the alias, then the repo id or the folder's name."""
        return default_names(self.spec)

    @property
    def repo_id(self) -> str | None:
        return None if self.spec.is_folder else self.spec.source


def resolve_model(spec: ModelSpec, hub: HubContact | None = None) -> ResolvedModel:
    """The local folder of `spec`, downloading a Hub repo into the cache if need be
    (`hub`: what this start has found of the Hub so far; a new start's where None)."""
    if spec.is_folder:
        return resolve_folder(spec)
    return resolve_hub(spec, HubContact() if hub is None else hub)


def resolve_folder(spec: ModelSpec) -> ResolvedModel:
    if spec.revision:
        raise ModelNotFound(f"{spec.source} is a folder: a revision applies to Hub ids only")
    if not is_folder(spec.source):
        folder, at, _ = spec.source.rpartition("@")
        if at and is_folder(folder):  # (a folder's name may hold an '@': read whole first)
            raise ModelNotFound(
                f"no model folder {spec.source}: {folder} is a folder, and a revision "
                "('@...') applies to Hub ids only"
            )
        raise ModelNotFound(f"no model folder {spec.source}")
    return ResolvedModel(spec, Path(spec.source).expanduser().resolve())


def resolve_hub(spec: ModelSpec, hub: HubContact) -> ResolvedModel:
    """`spec`'s snapshot in the cache, downloaded where need be; once `hub` has not
    answered (in this start), the cache's alone."""
    repo_id, revision = spec.source, spec.revision
    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        head, equals, _ = repo_id.partition("=")
        alias = (  # (a head with '/' is read as a path's: vLLM's served names have them)
            f"; an alias before '=' ({head!r} here) takes letters, digits, '.', '_' and '-'"
            if equals and "/" in head
            else ""
        )
        raise ModelNotFound(
            f"{repo_id!r} is neither an existing folder nor a Hub repo id (org/name){alias}"
        ) from None
    at = f"{repo_id}@{revision}" if revision else repo_id
    from huggingface_hub import constants, snapshot_download  # (see the module's docstring)

    hub_logs_through_ours()
    hub_requests_bounded()
    started = time.monotonic()
    since = time.time() - 1.0  # blobs written from here on are this start's downloads
    changed: list[str] = []
    files: list[str] | None = None
    try:
        asked = cached_commit(repo_id, revision)  # the user's words stay in the messages
        if cache_alone(hub, repo_id, asked):
            hub.passes_over(repo_id)
        files = repo_files(repo_id, asked, hub)
        cached = cache_alone(hub, repo_id, asked)  # (its own file list may have failed)
        dense = dense_modules(repo_id, asked, files, cached=cached, hub=hub)

        def download() -> str:
            try:
                return snapshot_download(
                    repo_id,
                    revision=asked,
                    ignore_patterns=files_to_skip(files, dense),
                    tqdm_class=LoggedProgress,
                    local_files_only=cache_alone(hub, repo_id, asked),
                )
            except LocalEntryNotFoundError as exc:
                if hub.lost and exc.__cause__ is None:  # the Hub's failure is the why
                    raise exc from hub.silence
                raise

        folder = download()
        if cut := cut_short(Path(folder), listed_sizes(repo_id, Path(folder).name)):
            said = f"{', '.join(cut)} in the Hub cache {'is' if len(cut) == 1 else 'are'}"
            if constants.is_offline_mode():  # nothing deleted that cannot come again
                raise ModelNotFound(
                    f"{at}: {said} shorter than the Hub lists (cut short): download the "
                    "model again (without HF_HUB_OFFLINE=1)"
                )
            log.warning("model %s: %s shorter than the Hub lists: downloading again", at, said)
            forget(Path(folder), cut)
            folder = download()
        changed = changed_downloads(Path(folder), since)
        if changed:  # deleted: downloaded again, once
            say_changed(at, changed)
            folder = download()
            changed = changed_downloads(Path(folder), since)
    except ModelNotFound:  # said already
        raise
    except Exception as exc:  # noqa: BLE001 - every failure becomes one line (below)
        hub.notes(exc, repo_id, say=False)  # (said below) the next models are not asked
        standing_in = cache_in_place_of_the_hub(exc, repo_id, revision, asked)
        if standing_in is None:
            raise ModelNotFound(explain(exc, repo_id, revision)) from exc
        snapshot, which = standing_in
        log.warning(
            "model %s: %s; serving %s snapshot %s, found in the cache",
            at,
            explain(exc, repo_id, revision),
            which,
            snapshot.name,
        )
        folder, files = str(snapshot), cached_files(repo_id, snapshot.name)
    if changed:
        raise ModelNotFound(f"{at}: {changed_twice(changed)}")
    commit = Path(folder).name
    if files is None:  # the download may have listed them (its info refused, say)
        files = cached_files(repo_id, commit)
    log.info(
        "model %s: commit %s in %s (%.1f s)",
        at,
        commit,
        Path(folder).parent.parent,
        time.monotonic() - started,
    )
    return ResolvedModel(spec, Path(folder), commit, None if files is None else tuple(files))


def fetch_shipped_graph(
    resolved: ResolvedModel, only_weights: bool = False, hub: HubContact | None = None
) -> None:
    """The repo's own `onnx/model.onnx` (and its weights file, if kept apart) into the
    model's folder, for the ONNX engine: loaded in a second where an export takes tens.
    Nothing where the repo has none; a failure is a log line, and the engine exports,
    but ModelNotFound where the graph is the repo's `only_weights`. From the cache alone
    where `hub` has not answered in this start. What it downloads is hashed as the
    snapshot's files are: downloaded again once where changed on the way, ModelNotFound
    where changed again."""
    files = resolved.files or ()
    if resolved.repo_id is None or SHIPPED_GRAPH not in files:
        return
    if (resolved.folder / SHIPPED_GRAPH).is_file():
        return
    from huggingface_hub import hf_hub_download  # (here: see the module's docstring)

    repo_id = resolved.repo_id
    names = (SHIPPED_GRAPH, *(name for name in SHIPPED_GRAPH_DATA if name in files))

    def download() -> None:
        for name in names:
            hf_hub_download(
                repo_id,
                name,
                revision=resolved.commit,
                tqdm_class=LoggedProgress,
                local_files_only=hub is not None and hub.lost,
            )

    started = time.monotonic()
    since = time.time() - 1.0  # blobs written from here on are this fetch's downloads
    changed: list[str] = []
    try:
        # hashed as the snapshot's files are (resolve_hub): a byte changed on the way was
        # kept in the cache, and every later start failed to load or export the model
        download()
        if changed := changed_downloads(resolved.folder, since, names):
            say_changed(repo_id, changed)
            download()
            changed = changed_downloads(resolved.folder, since, names)
    except Exception as exc:  # noqa: BLE001 - the engine exports the model instead
        if hub is not None and hub.lost and exc.__cause__ is None:
            exc.__cause__ = hub.silence  # the why of "not in the Hub cache"
        reason = explain(exc, repo_id, resolved.commit)
        if only_weights:
            raise ModelNotFound(
                f"the repo's {SHIPPED_GRAPH}, its only weights, was not downloaded: {reason}"
            ) from exc
        log.warning(
            "the repo's %s was not downloaded (%s): the ONNX engine exports the model instead",
            SHIPPED_GRAPH,
            reason,
        )
        return
    if changed:  # the network on the way changes it: exporting instead would hide that
        raise ModelNotFound(changed_twice(changed))
    log.info(
        "model %s: the repo's %s, for the ONNX engine (%.1f s)",
        repo_id,
        SHIPPED_GRAPH,
        time.monotonic() - started,
    )


def say_changed(at: str, changed: Sequence[str]) -> None:
    """Says that this start's downloads `changed` (deleted) are downloaded again."""
    log.warning(
        "model %s: %s did not match the hash the Hub named (changed on the way): downloading again",
        at,
        ", ".join(changed),
    )


def changed_twice(changed: Sequence[str]) -> str:
    """Why files whose second download did not match its hash either are refused."""
    return (
        f"{', '.join(changed)} did not match the hash the Hub named, downloaded twice (a "
        "proxy or the network on the way changes it): deleted from the cache; check the "
        "way to HF_ENDPOINT"
    )


def only_shipped_graph(resolved: ResolvedModel) -> bool:
    """Whether the model's weights are its own ONNX graph alone, none that torch loads (an
    ONNX-only repo, as transformers.js ones are, or a folder of one): the repo's files as
    the Hub lists them, else those its folder holds."""
    if resolved.files is None:
        folder = resolved.folder
        files = {name for name in (SHIPPED_GRAPH, *TORCH_WEIGHTS) if (folder / name).is_file()}
    else:
        files = set(resolved.files)
    return SHIPPED_GRAPH in files and not files.intersection(TORCH_WEIGHTS)


def pinned(revision: str | None) -> bool:
    """Whether `revision` names a commit (which nothing else may stand in for)."""
    return revision is not None and bool(COMMIT.fullmatch(revision))


# the Hub's answers that no such repo, revision or access is there
HUB_SAYS_NO = (RepositoryNotFoundError, RevisionNotFoundError, DisabledRepoError)


def cache_in_place_of_the_hub(
    exc: BaseException, repo_id: str, revision: str | None, asked: str | None
) -> tuple[Path, str] | None:
    """A whole snapshot in the cache to serve where a download failed without the Hub
    saying no (no such repo, revision or access), and which one it is; None: none.
    huggingface_hub serves the cache itself where the Hub cannot be reached or answers an
    error, but not where its API answers something that is not the Hub's (a web page, a
    proxy's login form: not JSON; a 404 without the Hub's error code, `not_the_hubs_answer`,
    which it took for the Hub failing and served the cache without a word) or never
    answers (a redirect loop), nor where a proxy fails: those stopped a start that the
    cache could serve. Where the revision's own snapshot is not whole, a branch's whole
    earlier one serves (`earlier_whole_snapshot`). The Hub's own no (its errors are httpx's
    too) stops the start, as huggingface_hub has it: a branch deleted on the Hub is not
    served from the cache."""
    if isinstance(exc, HUB_SAYS_NO):
        return None
    if isinstance(exc, (json.JSONDecodeError, httpx2.HTTPError)):
        from huggingface_hub import snapshot_download  # (here: see the module's docstring)

        try:
            files = cached_files(repo_id, asked)
            dense = dense_modules(repo_id, asked, files, cached=True)
            folder = snapshot_download(
                repo_id,
                revision=asked,
                local_files_only=True,
                ignore_patterns=files_to_skip(files, dense),
            )
            return Path(folder), "its"
        except Exception:  # noqa: BLE001 - not whole in the cache: an earlier one, if any
            pass
    elif not isinstance(exc, LocalEntryNotFoundError):
        return None
    earlier = None if pinned(revision) else earlier_whole_snapshot(repo_id, revision or "main")
    return None if earlier is None else (earlier, "the whole earlier")


def earlier_whole_snapshot(repo_id: str, branch: str) -> Path | None:
    """The newest snapshot of `repo_id` in the cache that no branch or tag names now (the
    one asked for names the one not whole; another's is its own model: a start asking
    for main served dev's) and that holds every file a download of it fetches, where the
    cache has `branch` at all (a branch or tag it never held, `@mian`, was served from a
    snapshot of another). The cache keeps no history of which branch a commit was: one no
    ref names any more may have been another branch's. huggingface_hub moves the ref
    before it downloads the files: a branch that moved on, its new commit's download
    stopped or failed, left every later start that the Hub could not serve failing, its
    earlier snapshot whole in the cache."""
    from huggingface_hub import constants  # (here: see the module's docstring)
    from huggingface_hub.file_download import repo_folder_name

    storage = Path(constants.HF_HUB_CACHE) / repo_folder_name(repo_id=repo_id, repo_type="model")
    if not (storage / "refs" / branch).is_file():
        return None
    named = named_now(storage / "refs")
    snapshots = [s for s in (storage / "snapshots").glob("*") if s.is_dir() and s.name not in named]
    for snapshot in sorted(snapshots, key=lambda s: s.stat().st_mtime, reverse=True):
        files = cached_files(repo_id, snapshot.name)
        dense = dense_paths(snapshot / "modules.json")
        if files is not None and all((snapshot / n).exists() for n in fetched(files, dense)):
            return snapshot
    return None


def named_now(refs: Path) -> set[str]:
    """The commits a cache's branches and tags name now (its `refs` folder): not those of
    refs named by a commit (a start that asked for a short commit wrote one: a pin, no
    branch), nor files that cannot be read (a stray `.DS_Store` stopped the start with a
    traceback)."""
    named = set()
    for path in refs.rglob("*"):
        if not path.is_file() or COMMIT.fullmatch(path.name):
            continue
        try:
            named.add(path.read_text().strip())
        except (OSError, UnicodeDecodeError):
            continue
    return named


def cached_files(repo_id: str, revision: str | None) -> list[str] | None:
    """The file names at `revision` as its download listed them in the cache; None
    unknown."""
    entries = cached_listing(repo_id, revision)
    return None if entries is None else [entry.path for entry in entries]


def listed_sizes(repo_id: str, commit: str) -> dict[str, int]:
    """Each file's size as the download's listing of `commit` in the cache gives it; {}
    where there is none."""
    entries = cached_listing(repo_id, commit) or []
    return {e.path: e.size for e in entries if isinstance(getattr(e, "size", None), int)}


def cached_listing(repo_id: str, revision: str | None) -> list[Any] | None:
    """The repo's files at `revision` as its download listed them in the cache (with
    their sizes); None where there is no such listing."""
    from huggingface_hub import get_cached_repo_tree  # (here: see the module's docstring)

    try:
        return list(get_cached_repo_tree(repo_id, revision=revision))
    except CachedRepoTreeNotFoundError:
        return None


def fetched(files: Sequence[str], dense: Sequence[str] = ()) -> list[str]:
    """Those of the repo's `files` that a download fetches (`files_to_skip`)."""
    from huggingface_hub.utils import filter_repo_objects  # (see the module's docstring)

    return list(filter_repo_objects(files, ignore_patterns=files_to_skip(files, dense)))


def cached_commit(repo_id: str, revision: str | None) -> str | None:
    """`revision`, or the full id of the one cached commit it abbreviates. huggingface_hub
    finds a short commit in the cache only by the ref that a download under that same
    name left: a commit cached by its full id or by a branch was "not in the Hub cache"
    offline, though it was. (Online, the Hub reads the short form as that commit too.)"""
    if revision is None or not SHORT_COMMIT.fullmatch(revision):
        return revision
    from huggingface_hub import constants  # (here: see the module's docstring)
    from huggingface_hub.file_download import repo_folder_name

    storage = Path(constants.HF_HUB_CACHE) / repo_folder_name(repo_id=repo_id, repo_type="model")
    if (storage / "refs" / revision).is_file():  # a branch or tag of that name, or a download
        return revision
    commits = [snapshot.name for snapshot in (storage / "snapshots").glob(revision + "*")]
    return commits[0] if len(commits) == 1 else revision


def hub_logs_through_ours() -> None:
    """huggingface_hub's log lines (a download retried, a file skipped) go through the
    server's handler only, in its format: the stderr handler the library gives its own
    loggers wrote each of them a second time, bare, between the server's lines (and
    between the JSON objects of --log-format json)."""
    logging.getLogger("huggingface_hub").handlers.clear()


def hub_requests_bounded() -> None:
    """Every request to the Hub gives up after HF_HUB_ETAG_TIMEOUT seconds (10 unless set)
    without a byte, and waits MAX_HUB_WAIT_SECONDS at most where the Hub asks it to
    (`bounded_client`); one that went silent is not sent again, and a 429 for the repo's
    info is waited (`AskingAgain`, one for this model's resolution). In a client factory:
    huggingface_hub makes a new client after a refused connection, and hooks on the old one
    were lost with it."""
    from huggingface_hub import set_client_factory  # (here: see the module's docstring)

    asking = AskingAgain()
    set_client_factory(lambda: bounded_client(asking))


def bounded_client(asking: AskingAgain) -> httpx2.Client:
    """huggingface_hub's client, with bounded waits: it sets a limit on file requests,
    but none on the repo's info (model_info, and snapshot_download's own call), so a Hub
    or a proxy that took the connection and never answered held the server's start
    forever; and it waits as long as a 429 or 503 says (an hour a retry where the Hub
    said 3600). A download that goes on, however slowly, is not cut: the limit is on
    each wait for bytes. Its requests are sent through `asking`."""
    # no public way to add hooks to its own client: its factory builds it
    from huggingface_hub.utils._http import default_client_factory

    client = default_client_factory()
    client.event_hooks["request"].append(bounded_waits)
    client.event_hooks["response"].append(bounded_retry_after)
    # (no hook can send a request again, nor leave one unsent)
    client.send = partial(asking.send, client.send)  # type: ignore[method-assign]
    return client


def bounded_waits(request: httpx2.Request) -> None:
    """A request's waits (connect, read, write, pool) that have no limit get the Hub's; a
    file's HEAD (its ETag) gets it whatever it was given: huggingface_hub asks again
    with 60 s of its own, and a Hub whose HEADs never answered held a start 6.5 minutes
    with HF_HUB_ETAG_TIMEOUT at 10."""
    from huggingface_hub import constants  # (here: see the module's docstring)

    limit = float(constants.HF_HUB_ETAG_TIMEOUT)
    head = request.method == "HEAD"
    waits = request.extensions.get("timeout") or dict.fromkeys(("connect", "read", "write", "pool"))
    request.extensions["timeout"] = {
        name: limit if seconds is None or (head and seconds > limit) else seconds
        for name, seconds in waits.items()
    }


def bounded_retry_after(response: httpx2.Response) -> None:
    """A wait the Hub asks for (`Retry-After`, or its rate limit's reset) past
    MAX_HUB_WAIT_SECONDS is not taken: its headers are dropped, and huggingface_hub's
    own backoff (1 to 8 s) retries; after its last try the cache serves, or the start
    says to try again later."""
    if response.status_code < 400:  # only failures are tried again
        return
    asked = wait_asked(response)
    if asked <= MAX_HUB_WAIT_SECONDS:
        return
    for name in ("retry-after", "ratelimit", "ratelimit-policy"):
        response.headers.pop(name, None)
    log.warning(
        "the Hub answered %d and asks to wait %d s before trying again: not waited (over "
        "%d s); tried again sooner, then the cache decides",
        response.status_code,
        asked,
        MAX_HUB_WAIT_SECONDS,
    )


def repo_files(repo_id: str, revision: str | None, hub: HubContact) -> list[str] | None:
    """The repo's file names at `revision`: from the Hub, else from the listing cached
    by an earlier download (offline, the Hub not answering, or a whole commit's, which
    cannot change: the Hub is not asked for it), else None (unknown: nothing is skipped
    by name)."""
    from huggingface_hub import HfApi, constants  # (here: see the module's docstring)

    listed = cached_files(repo_id, revision)
    pinned_and_listed = listed is not None and WHOLE_COMMIT.fullmatch(revision or "")
    if constants.is_offline_mode() or pinned_and_listed or cache_alone(hub, repo_id, revision):
        return listed
    try:
        info = HfApi().model_info(repo_id, revision=revision)
        return [sibling.rfilename for sibling in info.siblings or []]
    except OfflineModeIsEnabled:
        pass
    except (httpx2.ConnectError, httpx2.TimeoutException, HfHubHTTPError) as exc:
        if not_the_hubs_answer(exc):  # said, and the cache stands in (resolve_hub)
            raise
        # no network, or the Hub failing (5xx), must not stop a start the cache can
        # serve: the start asks it nothing more (`hub`), and the cache decides
        if not hub.notes(exc, repo_id) and isinstance(exc, HfHubHTTPError):
            hub_refused(exc, repo_id)
    return listed


def not_the_hubs_answer(exc: BaseException) -> bool:
    """Whether `exc` is a 404 without the Hub's own error code (`X-Error-Code`: no such
    repo, revision or file), as a web server or a proxy answers a path it does not have
    (HF_ENDPOINT naming a wrong one): huggingface_hub reads it as the Hub failing, and
    served the cache without a word, a moved branch stale, or the start failed with "the
    Hub answered 404"."""
    response = exc.response if isinstance(exc, HfHubHTTPError) else None
    return (
        response is not None
        and response.status_code == 404
        and "X-Error-Code" not in response.headers
        and not isinstance(exc, HUB_SAYS_NO)
    )


def cache_alone(hub: HubContact, repo_id: str, revision: str | None) -> bool:
    """Whether `repo_id` is looked up in the cache alone: the Hub has not answered in this
    start, for this model (its retries have run), or for an earlier one where the cache
    lists this one's files. A model the cache does not hold is asked of the Hub all the
    same: one 503 for another model's file list failed it, never asked."""
    if not hub.lost:
        return False
    return hub.lost_for == repo_id or cached_files(repo_id, revision) is not None


def hub_refused(exc: HfHubHTTPError, repo_id: str) -> None:
    """Says a 429 or a token's refusal where the cache may hide it (the Hub is asked
    again by snapshot_download, which serves the cache or says what is wrong)."""
    status = exc.response.status_code if exc.response is not None else 0
    if later(status):
        log.warning("the Hub answered %d for %s: the cache decides", status, repo_id)
    elif status in (401, 403) and not isinstance(exc, HUB_SAYS_NO):
        # a token revoked or mistyped: the cache hides it (the Hub's 401 for a
        # repo that is not there, or not shown without a token, is said below)
        log.warning(
            "the Hub refused %s (%d: a token it does not take, HF_TOKEN, or a repo "
            "not shared with it): the cache decides, and a start without it fails",
            repo_id,
            status,
        )


def files_to_skip(files: Sequence[str] | None, dense: Sequence[str] = ()) -> list[str]:
    """The glob patterns of files not to download, given the repo's file names and the
    folders of its sentence-transformers Dense modules (`dense_modules`)."""
    patterns = list(NOT_NEEDED)
    if files is None or not any(name in SAFETENSORS_WEIGHTS for name in files):
        return patterns
    # a Dense module's pytorch_model.bin where it has no model.safetensors: its only
    # weights (LaBSE's), needed though the model's own are safetensors
    needed = {
        f"{folder}/pytorch_model.bin"
        for folder in dense
        if f"{folder}/model.safetensors" not in files
    }.intersection(files)
    if not needed:
        return patterns + PICKLED_WEIGHTS
    pickled = [name for name in files if any(fnmatchcase(name, p) for p in PICKLED_WEIGHTS)]
    return patterns + [glob.escape(name) for name in pickled if name not in needed]


def dense_modules(
    repo_id: str,
    revision: str | None,
    files: Sequence[str] | None,
    cached: bool = False,
    hub: HubContact | None = None,
) -> tuple[str, ...]:
    """The folders the repo's modules.json names for its Dense modules (fetched, or from
    the cache where `cached`); () for a repo without one, or where it cannot be had. A
    fetch the Hub did not answer (its retries run) is noted in `hub`: the snapshot
    after it is not asked of the Hub again, retried as long."""
    from huggingface_hub import hf_hub_download  # (here: see the module's docstring)

    if files is None or "modules.json" not in files:
        return ()
    try:
        path = hf_hub_download(repo_id, "modules.json", revision=revision, local_files_only=cached)
    except Exception as exc:  # noqa: BLE001 - the download proper says what is wrong, if anything
        if hub is not None:
            hub.notes(exc, repo_id)
        return ()
    return dense_paths(Path(path))


def explain(exc: BaseException, repo_id: str, revision: str | None) -> str:
    """One line for a failed resolution: what went wrong and what to do about it."""
    from huggingface_hub import constants, get_token  # (here: see the module's docstring)

    at = f"{repo_id}@{revision}" if revision else repo_id
    if isinstance(exc, GatedRepoError):
        if get_token() is None:
            return (
                f"the Hub repo {repo_id} is gated: accept its conditions on the Hub, "
                "then set HF_TOKEN to a token of that account"
            )
        return (
            f"the Hub repo {repo_id} is gated and the token in use (HF_TOKEN) has no access "
            "to it: accept its conditions on the Hub with that account"
        )
    if isinstance(exc, RevisionNotFoundError):
        return f"the Hub repo {repo_id} has no revision {revision!r} (a branch, tag or commit)"
    if isinstance(exc, RemoteEntryNotFoundError) and exc.response is not None:
        # (it read as though the repo were missing, naming no file)
        _, resolved, rest = str(exc.response.url.path).partition("/resolve/")
        name = unquote(rest.split("/", 1)[-1]) if resolved else "a file"
        return f"the Hub has no {name} in {at}, which lists it: try again, or pin a commit"
    if isinstance(exc, DisabledRepoError):
        return f"the Hub repo {repo_id} is disabled"
    if isinstance(exc, RepositoryNotFoundError):
        hint = (
            "check the name" if get_token() else "check the name, or set HF_TOKEN if it is private"
        )
        return f"no Hub repo {repo_id} (or no access to it): {hint}"
    if isinstance(exc, LocalEntryNotFoundError):
        cached = "only partly" if isinstance(exc, IncompleteSnapshotError) else "not"
        where = f"{at} is {cached} in the Hub cache ({constants.HF_HUB_CACHE})"
        hub = without_credentials(constants.ENDPOINT)  # (a mirror's user and password)
        if constants.is_offline_mode():
            return f"{where} and HF_HUB_OFFLINE=1 forbids downloading it"
        failed = exc.__cause__
        if failed is not None and not_the_hubs_answer(failed):
            return f"{where} and {not_the_hub(hub)}"
        if isinstance(failed, HfHubHTTPError) and failed.response is not None:
            status = failed.response.status_code
            return f"{where} and the Hub ({hub}) answered {status}{later(status)}"
        root = None if failed is None else not_answering(failed)
        cause = "" if root is None else f" ({in_short(root)})"
        return f"{where} and the Hub ({hub}) cannot be reached{cause}"
    if isinstance(exc, json.JSONDecodeError):  # a web page, a proxy's login form
        return (
            f"{without_credentials(constants.ENDPOINT)} answered for {at} with something other "
            "than the Hub's API (not JSON): check HF_ENDPOINT, or a proxy in the way"
        )
    if not_the_hubs_answer(exc):
        return not_the_hub(without_credentials(constants.ENDPOINT), f" for {at}")
    if isinstance(exc, HfHubHTTPError) and exc.response is not None:
        if exc.response.status_code == 401 and get_token():  # a token the Hub does not know
            return (
                f"the Hub refused the token in use (HF_TOKEN, or the one `hf auth login` "
                f"saved) for {at}: it is not valid; set a valid token, or none for a public repo"
            )
        status = exc.response.status_code
        return f"the Hub answered {status} for {at}{later(status)}"
    if isinstance(exc, OSError) and exc.errno in DISK_FULL:  # (it named no folder)
        return (
            f"could not download {at}: the Hub cache's disk is full ({constants.HF_HUB_CACHE}: "
            f"{first_line(exc)[:200]}): free space there, or set HF_HUB_CACHE to a folder "
            "on a disk with room"
        )
    if isinstance(exc, (httpx2.HTTPError, OSError)):
        return f"could not download {at}: {first_line(exc)[:200]}"
    return f"could not resolve {at}: {type(exc).__name__}"


def not_the_hub(endpoint: str, asked: str = "") -> str:
    """What a 404 without the Hub's error code says (`not_the_hubs_answer`)."""
    return (
        f"{endpoint} answered 404{asked} without the Hub's error code (a path that is not the "
        "Hub's API): check HF_ENDPOINT, or a proxy in the way"
    )


def later(status: int) -> str:
    """What to do about an answer of `status`: the Hub failing or busy passes."""
    return ": the Hub is failing or busy; try again later" if status >= 500 or status == 429 else ""


class LoggedProgress(tqdm):
    """A tqdm bar that writes a log line every PROGRESS_SECONDS instead of drawing itself.

    snapshot_download makes three: files fetched, bytes written (its total is the files'
    sizes) and bytes received (its total is a guess, so it stays quiet). The files bar
    also logs when it closes, so a download ends with a line.
    """

    def __init__(self, *args: Any, **kwargs: Any):
        kwargs["mininterval"] = PROGRESS_SECONDS
        kwargs["file"] = _Discard()
        self._bytes = kwargs.get("unit") == "B"
        self._quiet = str(kwargs.get("desc") or "").startswith("Downloading bytes")
        self._logged_at: float | None = None
        super().__init__(*args, **kwargs)

    def display(self, msg: str | None = None, pos: int | None = None) -> bool:
        """A line, at most one every PROGRESS_SECONDS: huggingface_hub's refresh() after
        each file passes tqdm's own interval (3,000 small files made 3,011 lines)."""
        if self._quiet or self.disable:
            return True
        now = time.monotonic()
        if self._logged_at is not None and now - self._logged_at < PROGRESS_SECONDS:
            return True
        self._logged_at = now
        self._line()
        return True

    def _line(self) -> None:
        done, total = self.n, self.total
        if self._bytes and done:
            log.info("downloading: %s of %s", _size(done), _size(total or done))
        elif not self._bytes:
            log.info("downloading: %d of %s files", done, total if total else "?")

    def close(self) -> None:
        if not self._bytes and not self.disable and not self._quiet:
            self._line()  # (whenever the last was)
        self._quiet = True  # tqdm's close draws once more
        super().close()


class _Discard:
    """Where a LoggedProgress bar would draw: nowhere."""

    def write(self, text: str) -> None:
        pass

    def flush(self) -> None:
        pass


def _size(count: float) -> str:
    for unit in ("B", "kB", "MB"):
        if count < 1000:
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1000
    return f"{count:.1f} GB"
