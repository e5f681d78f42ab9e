"""How the command line names a model: `[ALIAS=]SOURCE[@REVISION][:TASK]`.

SOURCE is a local folder or a Hugging Face Hub repo id (`org/name`, or a canonical
`name` such as `gpt2`); `@REVISION` pins a Hub branch, tag or commit; `:TASK` sets the
pipeline task where the model's files do not say it; `ALIAS=` is the name clients use
to pick the model when several are served. Examples:

    /models/bge                               a folder
    BAAI/bge-small-en-v1.5                    a Hub repo, its default branch
    BAAI/bge-small-en-v1.5@5c38ec7c           ... at a commit (or a branch or tag)
    emb=BAAI/bge-small-en-v1.5@v1.0           ... served as "emb"
    cls=/models/sst2:text-classification      a folder served as "cls", task given

A string that names an existing folder is that folder, whatever characters it holds.
This module only parses; it touches no network (`rawserve.models.hub` resolves) and
never imports torch or transformers.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path, PurePath
from urllib.parse import urlsplit

ALIAS = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}")
TASK_NAME = re.compile(r"[a-z][a-z0-9]*(?:-[a-z0-9]+)*")
# a URL's start (`https://`): a repo's page copied whole, read as a name and a task after ':'
URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")
HUB_HOSTS = ("huggingface.co", "www.huggingface.co", "hf.co")  # whose paths start org/name
NOT_MODEL_PAGES = ("datasets", "spaces", "docs", "models", "collections")  # ... but these
# What starts a folder name for sure (a Hub id never starts so).
FOLDER_PREFIXES = ("/", "~", ".")  # (".": "./" and "../" too)


class ModelNameError(ValueError):
    """A model name that cannot be read; the message says what is wrong in one line."""


@dataclass(frozen=True)
class ModelSpec:
    """One model as the command line names it (nothing resolved yet)."""

    source: str  # a folder or a Hub repo id, as given
    revision: str | None = None  # Hub only
    alias: str | None = None
    task: str | None = None

    @property
    def is_folder(self) -> bool:
        return looks_like_folder(self.source)

    def with_defaults(self, *, task: str | None, revision: str | None) -> ModelSpec:
        """The spec with `--task` / `--revision` filled in where it names none of its own
        (`--revision` applies to Hub ids only: a folder has no revisions)."""
        return ModelSpec(
            source=self.source,
            revision=self.revision or (None if self.is_folder else revision),
            alias=self.alias,
            task=self.task or task,
        )

    def __str__(self) -> str:
        text = self.source
        if self.alias:
            text = f"{self.alias}={text}"
        if self.revision:
            text += f"@{self.revision}"
        if self.task:
            text += f":{self.task}"
        return text


def looks_like_folder(source: str) -> bool:
    return source.startswith(FOLDER_PREFIXES) or is_folder(source)


def is_folder(text: str) -> bool:
    """Whether `text` names a folder here (a name the system cannot look up, one part of
    it past 255 bytes say, names none: its OSError was a traceback at start)."""
    try:
        return Path(text).expanduser().is_dir()
    except (OSError, ValueError):
        return False


def parse_model_spec(text: str) -> ModelSpec:
    """Read `[ALIAS=]SOURCE[@REVISION][:TASK]`; raise ModelNameError if it cannot be read."""
    text = text.strip()
    if not text:
        raise ModelNameError("a model name is empty")
    if is_folder(text):  # an existing folder is taken as it is
        return ModelSpec(source=text)
    alias = None
    head, equals, rest = text.partition("=")
    if equals and ALIAS.fullmatch(head):
        alias, text = head, rest
    elif equals and "/" not in head:
        raise ModelNameError(
            f"{head!r} is not a model alias: use letters, digits, '.', '_' and '-', "
            "a letter or digit first, at most 96 of them"
        )
    if not text:
        raise ModelNameError(f"the model alias {alias!r} names no folder or Hub id")
    if is_folder(text):
        return ModelSpec(source=text, alias=alias)
    if URL.match(text):
        raise ModelNameError(not_a_url(text))
    task = None
    body, colon, suffix = text.rpartition(":")
    if colon and TASK_NAME.fullmatch(suffix):
        text, task = body, suffix
    elif colon:
        raise ModelNameError(f"{suffix!r} (after ':') is not a task name, in {text!r}")
    if not text:
        raise ModelNameError("a model name has an alias or a task but no folder or Hub id")
    if looks_like_folder(text):
        return ModelSpec(source=text, alias=alias, task=task)
    source, at, revision = text.partition("@")
    if at and not revision:
        raise ModelNameError(f"{text!r} ends with '@' but names no revision")
    return ModelSpec(source=source, revision=revision or None, alias=alias, task=task)


def not_a_url(url: str) -> str:
    """Why a URL is refused, and the repo id to give where it is a Hub repo's page."""
    parts = [part for part in urlsplit(url).path.split("/") if part]
    host = (urlsplit(url).hostname or "").lower()
    if host in HUB_HOSTS and parts and parts[0] not in NOT_MODEL_PAGES:
        repo = "/".join(parts[:2])
        if len(parts) > 3 and parts[2] in ("tree", "blob", "resolve"):  # a revision's page
            repo += f"@{parts[3].split(':')[0]}"  # (a task given after it: not the revision's)
        return f"a URL is not a model id: name the Hub repo as {repo!r}"
    return (
        "a URL is not a model id: name a Hub repo as 'org/name' (HF_ENDPOINT "
        "sets the Hub, or a mirror, to download it from), or a local folder"
    )


def default_names(spec: ModelSpec) -> tuple[str, ...]:
    """The names clients may use for a model: the alias first if there is one, then the
    repo id as given, or the folder's last component (what /v1/models lists)."""
    names: list[str] = []
    if spec.alias:
        names.append(spec.alias)
    if spec.is_folder:
        names.append(folder_name(spec.source))
    else:
        names.append(spec.source)
    return tuple(dict.fromkeys(names))


def folder_name(source: str) -> str:
    """A folder's last component; `.` or `..` (`--model .` in the model's folder) name
    the folder they are: served as ".", the model was out of reach of `/models/<name>`
    (clients drop a path's dot segments) and answered `"model": "."`."""
    name = PurePath(source).name
    if name in ("", ".", ".."):
        name = Path(source).resolve().name
    return as_text(name or source)


def as_text(path: str) -> str:
    """A path as the text clients read and send (UTF-8, in JSON and URLs). Where Python
    reads the command line in an ASCII locale (`LC_ALL=C PYTHONUTF8=0`), a non-ASCII
    folder name holds its bytes as lone surrogates, which no UTF-8 writer takes; they
    are read back as the UTF-8 they are (a byte that is not: U+FFFD)."""
    if path.isascii():
        return path
    return path.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
