"""`--handler module:factory`: a user's callable instead of a transformers model.

Worker process only.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import os
import pickle
import sys
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from rawserve.shared.messages import NO_CONTROL, Control
from rawserve.tasks import CUSTOM_TASK
from rawserve.worker.runner import Runner

# Packages whose objects a handler's answer may hold as they are: the server unpickles
# them without loading anything it does not load already (or a module of the standard
# library), and its JSON encoder writes them.
SENT_AS_THEY_ARE = frozenset(
    {"builtins", "copyreg", "rawserve", "numpy", "datetime", "uuid", "decimal", "collections"}
)


class AnswerPickler(pickle.Pickler):
    """Writes a handler's answers for the server as plain data. Pickled as they are, a
    torch tensor loaded torch into the server's process to be read (and then failed to be
    encoded: 500), and an object of the handler's own classes imported the handler's module
    there (running its top-level code in the server), or, where the server could not
    import it, made the message unreadable: the worker was killed as broken, three times,
    and the input quarantined."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            data = obj.detach().cpu()
            if data.dtype == torch.bfloat16:  # numpy has no bfloat16
                data = data.float()
            return np.asarray, (data.numpy(),)
        named = obj if isinstance(obj, type) or callable(obj) else type(obj)
        module = getattr(named, "__module__", None) or ""
        if module.partition(".")[0] in SENT_AS_THEY_ARE:
            return NotImplemented
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type):  # as JSON writes it
            return dict, (
                {field.name: getattr(obj, field.name) for field in dataclasses.fields(obj)},
            )
        raise pickle.PicklingError(
            f"the handler answered an object of {module}.{type(obj).__qualname__}: "
            "answer plain data (dicts, lists, strings, numbers, numpy arrays or torch tensors)"
        )


class HandlerStopped(RuntimeError):
    """The handler raised an exception that is no `Exception` (SystemExit and the like)."""


@contextmanager
def exits_as_errors() -> Iterator[None]:
    """Within it, SystemExit, KeyboardInterrupt (the worker ignores SIGINT: only the
    handler's code raises it) or a BaseException class of the handler's own is raised as
    a HandlerStopped, an ordinary error: of an input, which fails alone while the worker
    lives on (it died, and again on the input alone), or of the load, which stops the
    server with its reason (the worker died, and was restarted to die again, forever)."""
    try:
        yield
    except Exception:
        raise
    except BaseException as exc:
        told = f": {exc}" if str(exc) else ""
        raise HandlerStopped(f"the handler raised {type(exc).__name__}{told}") from exc


class HandlerRunner(Runner):
    """`--handler module:factory`: the factory returns `f(inputs: list, **params) -> list`."""

    answer_pickler = AnswerPickler

    def __init__(self, spec: str, device: str):
        module_name, _, factory_name = spec.partition(":")
        # a module of the folder the server was started in, as `python -m rawserve` finds it
        # (its sys.path[0]); the `rawserve` command's sys.path starts at its script's folder
        if os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())
        with exits_as_errors():  # a module that parses sys.argv as it is imported, say
            factory = getattr(importlib.import_module(module_name), factory_name or "handler")
            self.handler = factory()
        self.signature = handler_signature(spec, self.handler)
        super().__init__(CUSTOM_TASK, device)

    def run(
        self, inputs: list[Any], params: dict[str, Any], control: Control = NO_CONTROL
    ) -> list[Any]:
        if self.signature is not None:
            # parameters the handler cannot take (one it does not name, where it has no
            # **params; `inputs`, its own) are the client's to fix (422), not its failure
            try:
                self.signature.bind(inputs, **params)
            except TypeError as exc:
                raise ValueError(f"invalid parameters for the handler: {exc}") from None
        # a copy: a handler may consume its list, which a failed batch is split from again
        with exits_as_errors():
            answers = self.handler(list(inputs), **params)
        # one answer where a list of them was due: a dict or a text would be read as its
        # keys or characters, each the answer of an input
        if isinstance(answers, (Mapping, str, bytes)) or not isinstance(answers, Iterable):
            raise TypeError(
                f"the handler returned {type(answers).__name__}, not a list of one answer per input"
            )
        return list(answers)


def handler_signature(spec: str, handler: Any) -> inspect.Signature | None:
    """The signature of what the factory returned (None: it has none to read); what cannot
    be called as `f(inputs, **params)` is refused at load, not served as ready with every
    request failing."""
    if not callable(handler):
        raise TypeError(
            f"--handler {spec}: the factory returned {type(handler).__name__}, "
            "not a callable f(inputs, **params)"
        )
    called = type(handler).__call__  # an instance's own `async def __call__`
    if inspect.iscoroutinefunction(handler) or inspect.iscoroutinefunction(called):
        raise TypeError(
            f"--handler {spec}: the factory returned an async function; "
            "the handler is called in the worker's thread: make it a plain def"
        )
    try:
        signature = inspect.signature(handler)
    except (TypeError, ValueError):  # a callable written in C may have none
        return None
    try:
        signature.bind_partial([])
    except TypeError:
        raise TypeError(
            f"--handler {spec}: the factory returned a callable that takes no "
            "positional argument, not f(inputs, **params)"
        ) from None
    return signature
