"""The ONNX export, run in a process of its own that exits when it is done.

torch.onnx's dynamo exporter leaves its libraries and state in the process that ran it:
a worker that exported its model at a first start kept about 370 MB more than its peers
for its whole life (920 MB against 530 MB, all-MiniLM-L6-v2 on two CPU workers; glibc's
malloc_trim gave back 37 MB, `torch._dynamo.reset()` nothing). Exported here, it leaves
with this process; the first start pays this process's imports (a few seconds, on an
export of about twenty).

A worker is a daemonic multiprocessing process, which may not start processes of its own
through multiprocessing: `onnx_engine.export` runs this module with the same Python,

    python -m rawserve.worker.export_process FOLDER TASK GRAPH OUTCOME

and reads what happened from OUTCOME, a JSON object: the export's record of the weights it
left untrained (`{"untrained": ...}`), or the error that stopped it (`{"error": ...}`).
"""

from __future__ import annotations

import errno
import json
import sys
from pathlib import Path
from typing import Any

from rawserve.shared.logs import setup_worker_logging
from rawserve.worker.parent_watch import exit_with_parent


def main(argv: list[str]) -> int:
    folder, task, graph, outcome = argv
    exit_with_parent()  # a worker killed meanwhile: its export is nobody's
    setup_worker_logging("export")  # the worker's --log-level and --log-format (its env)
    from rawserve.worker import onnx_engine  # (torch: imported once the logging is set)

    told: dict[str, Any]
    try:
        untrained = onnx_engine.export_here(Path(folder), onnx_engine.HEADS[task], Path(graph))
    except Exception as exc:  # noqa: BLE001 - each one told to the worker, which decides
        told = {"error": described(exc)}
    else:
        told = {"untrained": untrained.as_dict() if untrained is not None else None}
    Path(outcome).write_text(json.dumps(told))
    return 0


def described(exc: Exception) -> dict[str, Any]:
    """What the worker needs to raise the error again as its own kind (onnx_engine's
    `raised_again`): its class's name, its message, and an OSError's number and words."""
    from rawserve.worker.onnx_engine import NotExportable

    found: dict[str, Any] = {"kind": type(exc).__name__, "message": str(exc)}
    if isinstance(exc, NotExportable):
        found["why"] = exc.why
    if isinstance(exc, OSError):
        found["errno"] = exc.errno or errno.EIO
        found["strerror"] = exc.strerror or str(exc)
    return found


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
