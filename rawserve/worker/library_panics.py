"""A Rust library's panic, as an error of the input that caused it.

The tokenizers library (and safetensors) panic on some inputs they cannot handle, and pyo3
raises a panic as `pyo3_runtime.PanicException`, a BaseException: it passes every
`except Exception` that turns one input's failure into that input's answer, and ends the
worker process (or, in the thread that prepares batches, that thread, and the worker
waits for it forever). The class cannot be imported, so it is known by its name.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


class LibraryPanic(RuntimeError):
    """A library panicked on this input (its message says where)."""


def is_library_panic(exc: BaseException) -> bool:
    kind = type(exc)
    return kind.__name__ == "PanicException" and kind.__module__ == "pyo3_runtime"


@contextmanager
def panics_as_errors() -> Iterator[None]:
    """Within it, a library's panic is raised as a LibraryPanic, an ordinary Exception."""
    try:
        yield
    except BaseException as exc:
        if is_library_panic(exc):
            first_line = (str(exc).strip().splitlines() or ["a library panicked"])[0]
            raise LibraryPanic(first_line) from exc
        raise
