"""`--handler module:factory`: a user's callable instead of a transformers model.

Worker process only. Imports neither torch nor transformers: a handler that uses neither
is not made to load them (they were most of such a worker's start); one that does gets
them set up as a model's worker sets them up.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import importlib
import inspect
import ipaddress
import logging
import os
import pickle
import re
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path, PurePath
from types import ModuleType
from typing import Any

from rawserve.shared.devices import gpu_present
from rawserve.shared.messages import NO_CONTROL, Control, Engine, ItemFailure, WorkerConfig
from rawserve.tasks import CUSTOM_TASK
from rawserve.worker.libraries import library_logs_through_ours
from rawserve.worker.runner import Runner, choose_attention_kernels, resolve_device

log = logging.getLogger("rawserve.worker")

# Packages whose objects a handler's answer may hold as they are: the server unpickles
# them without loading anything it does not load already (or a module of the standard
# library), and its JSON encoder writes them (`rawserve.http.encoding`).
SENT_AS_THEY_ARE = frozenset(
    {"builtins", "copyreg", "rawserve", "numpy", "datetime", "uuid", "decimal", "collections"}
)
# the builtin types whose subclasses (a namedtuple, a dict or str of the handler's own
# class) are sent as that type, as the JSON encoder writes them, each copied by the
# type's own method (a subclass's `__str__` or `__int__` is not what JSON writes)
PLAIN_COPIES: dict[type[Any], Callable[[Any], Any]] = {
    int: int.__int__,
    float: float.__float__,
    str: str.__str__,
    bytes: bytes.__bytes__,
    tuple: tuple,
    list: list,
    dict: dict,
}
ADDRESSES = (ipaddress.IPv4Address, ipaddress.IPv6Address)
NETWORKS = (ipaddress.IPv4Network, ipaddress.IPv6Network)


class AnswerPickler(pickle.Pickler):
    """Writes a handler's answers for the server as plain data. Pickled as they are, a
    torch tensor loaded torch into the server's process to be read (and then failed to be
    encoded: 500), and an object of the handler's own classes imported the handler's module
    there (running its top-level code in the server), or, where the server could not
    import it, made the message unreadable: the worker was killed as broken, three times,
    and the input quarantined."""

    def reducer_override(self, obj: Any) -> Any:
        torch = sys.modules.get("torch")  # an answer holds a tensor only where torch is loaded
        if torch is not None and isinstance(obj, torch.Tensor):
            import numpy as np  # loaded with torch

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
        if (plain := plain_form(obj)) is not None:
            return plain
        raise pickle.PicklingError(
            f"the handler answered an object of {module}.{type(obj).__qualname__}: "
            "answer plain data (dicts, lists, strings, numbers, numpy arrays or torch tensors)"
        )


def plain_form(obj: Any) -> tuple[type, tuple[Any]] | None:
    """How a value FastAPI writes as a plain one is sent (a reduction to a builtin type):
    a namedtuple (or another subclass of a builtin type of the handler's own) as that
    type, an Enum member as its value, a path or an IP address as its text; None where
    it is none such. (A namedtuple, as the README says, was a 500.)"""
    if isinstance(obj, enum.Enum):
        obj = obj.value
    for plain, copied in PLAIN_COPIES.items():
        if isinstance(obj, plain):
            return plain, (copied(obj),)
    if isinstance(obj, (PurePath, *ADDRESSES, *NETWORKS)):
        return str, (str(obj),)
    return None


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
        try:
            told = f": {exc}" if str(exc) else ""
        except BaseException:  # noqa: BLE001 - its str() raises (SystemExit too): untold
            told = ""
        raise HandlerStopped(f"the handler raised {type(exc).__name__}{told}") from exc


class HandlerRunner(Runner):
    """`--handler module:factory`: the factory returns `f(inputs: list, **params) -> list`."""

    answer_pickler = AnswerPickler

    def __init__(self, spec: str, device: str):
        factory_name = spec.partition(":")[2]
        module = handler_module(spec)
        with exits_as_errors():
            factory = getattr(module, factory_name or "handler")
            self.handler = factory()
        self.signature = handler_signature(spec, self.handler)
        # what it runs, and in what precision, is its own code's (/info says so)
        super().__init__(CUSTOM_TASK, device, dtype="")
        self.engine = Engine.HANDLER
        self.engine_reason = self.dtype_reason = "the handler's own code"

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
        # a copy: a handler may consume its list, or change its inputs in place (a dict's
        # pop, a list's sort), which a failed batch is split from again (its batch-mates
        # failed with a KeyError, and the input at fault with them)
        # (and of its parameters, which a split batch's halves are called with again)
        own = {name: own_copy(value) for name, value in params.items()}
        with exits_as_errors():
            try:
                answers = self.handler([own_copy(value) for value in inputs], **own)
            except TypeError as exc:
                if not refused_call(exc):
                    raise  # (raised in the handler's own code)
                # the call itself refused them: one named as a method's hidden `self`
                raise ValueError(f"invalid parameters for the handler: {exc}") from None
            # one answer where a list of them was due: a dict or a text would be read as its
            # keys or characters, each the answer of an input
            if isinstance(answers, (Mapping, str, bytes)) or not isinstance(answers, Iterable):
                raise TypeError(
                    f"the handler returned {type(answers).__name__}, not a list of one answer "
                    "per input"
                )
            # (a generator's, or map's, answers run the handler's code as they are read)
            return list(answers)

    def describe_failure(self, exc: BaseException) -> ItemFailure:
        # an exception of the handler's own class may raise SystemExit as it is read: then
        # an ordinary error, which the batch's run tells as the model's failure
        with exits_as_errors():
            return super().describe_failure(exc)


# Python's words where a call's arguments do not fit the function's parameters
REFUSED_CALL = re.compile(
    r"got multiple values for argument|got an unexpected keyword argument|"
    r"missing \d+ required|takes \d+ positional argument"
)


def refused_call(exc: TypeError) -> bool:
    """Whether `exc` is the call's own refusal of its arguments, raised before any frame
    of the handler ran: not one of its code's, nor of a wrapper written in C (an
    `lru_cache`'s "unhashable type" was a 422)."""
    no_frame = exc.__traceback__ is not None and exc.__traceback__.tb_next is None
    return no_frame and REFUSED_CALL.search(str(exc)) is not None


def own_copy(value: Any) -> Any:
    """A request's input as the handler may change it: texts and numbers as they are (they
    cannot be changed), JSON's lists and objects copied."""
    return copy.deepcopy(value) if isinstance(value, (dict, list)) else value


def handler_module(spec: str) -> ModuleType:
    """The module `spec` names, imported from the folder the server was started in, as
    `python -m rawserve` finds it (its sys.path[0]); the `rawserve` command's sys.path
    starts at its script's folder."""
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    name = spec.partition(":")[0]
    try:
        with exits_as_errors():  # a module that parses sys.argv as it is imported, say
            module = importlib.import_module(name)
        refuse_shadowed(name)
        return module
    except ModuleNotFoundError as exc:
        if exc.name is None or not (name == exc.name or name.startswith(f"{exc.name}.")):
            raise  # a module the handler imports is missing: its own line says which
        raise ModuleNotFoundError(  # said of the handler itself: where it was looked for
            f"no module named {exc.name!r} in {os.getcwd()} (the folder the server was "
            "started in) or on PYTHONPATH: start the server in the handler's folder, or "
            "add that folder to PYTHONPATH",
            name=exc.name,
        ) from None


def refuse_shadowed(name: str) -> None:
    """ImportError where the folder the server started in holds the handler's module
    (`types.py`) but the name was Python's own, or a library's, imported before that
    folder was searched: its factory was then "missing" from a module it never was in."""
    top = name.partition(".")[0]
    here = Path.cwd()
    written = [here / f"{top}.py", here / top / "__init__.py"]
    loaded = getattr(sys.modules.get(top), "__file__", None)
    mine = next((path for path in written if path.is_file()), None)
    if mine is None or loaded is None or Path(loaded).resolve() == mine.resolve():
        return
    raise ImportError(
        f"the handler's module {top!r} is {mine}, but that name is taken by a module "
        f"imported before it ({loaded}): name the file another way"
    )


def load_handler(config: WorkerConfig, device: str) -> HandlerRunner:
    """`config.handler`'s runner. The libraries its code loads are set up as for a model:
    those its module's imports loaded before its factory runs, those the factory loaded
    after it."""
    assert config.handler is not None
    handler_module(config.handler)
    set_up_libraries(config, device)
    runner = HandlerRunner(config.handler, device)
    runner.device, runner.attention = set_up_libraries(config, device)
    if runner.attention:  # a handler's own model attends as ours do
        log.info("attention: %s", runner.attention)
    return runner


def set_up_libraries(config: WorkerConfig, device: str) -> tuple[str, str]:
    """Set up the libraries loaded by now as a model's worker sets them up (again, for
    those set up before): their log lines through ours and, where torch is loaded, its
    threads and, on a GPU, its attention kernels. The device the handler runs on, and
    the attention kernels chosen ("": torch's own, or no torch), are returned: `auto` is
    what torch sees where it is loaded (a GPU it cannot use is refused in words), or
    else what the machine shows."""
    library_logs_through_ours()
    torch = sys.modules.get("torch")
    if torch is None:
        if device == "auto":
            return ("cuda:0" if gpu_present() else "cpu"), ""
        return device, ""
    if config.threads:
        torch.set_num_threads(config.threads)
    device = resolve_device(device)
    return device, choose_attention_kernels(device) or ""


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
    if any(
        inspect.iscoroutinefunction(function) or inspect.isasyncgenfunction(function)
        for function in (handler, called)
    ):
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
