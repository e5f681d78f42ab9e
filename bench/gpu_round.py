"""One bounded pass over every GPU measurement, for a machine lent for minutes.

    python -m bench.gpu_round --out /tmp/gpu                 # the open targets, then the rest
    python -m bench.gpu_round --out /tmp/gpu --skipped-from /tmp/gpu/summary.json \
        --budget 300                                         # what it skipped, a second command
    python -m bench.gpu_round --out /tmp/dry --dry-run       # every stage on the CPU, tiny

A lent machine runs one command for at most 600 s: the default `--budget` (500 s) holds the
stages that measure the issues' open targets, which run first, and whatever of the rest
still fits (on an H200, by the last round's times, `graphs` and `decode`); the stages it
skipped run in a second command, at once, on the machine still warm, as far as the
session's device time goes (`--skipped-from` reads them from the first's summary;
`--stages others` names them all). `--limit` cuts the budget to what the command itself
may still run. On the machine itself, `scripts/gpu_wheels.sh` prepares what it lacks
(bench/RESULTS.md, "Measuring on a lent GPU"). `--dry-run` runs every stage's command, the
same options at tiny sizes, on the CPU: a wrong option fails here, not on the GPU.

Each stage is one of the benchmarks, run as a command of its own under a time limit
(killed past it: what it printed so far is kept), its output in `OUT/<stage>.log` and its
last lines on the screen as it ends. A stage that would not fit in what is left of
the budget is skipped, and says so. Where `nvidia-smi` is installed, `OUT/dmon.log`
records the GPU's use each second meanwhile. `OUT/summary.json` lists every stage: its
command, exit status, seconds, and whether it ran out of time, was skipped or stopped;
it is rewritten as each stage ends, and with `--back DIR` so are `DIR/summary.json` and
`DIR/round.tar.gz` (all of OUT: a lent machine sends back only a few files, and only
those already in its $OUT when a command is killed). The round exits 1 when a stage
failed, ran out of time or was stopped; a stage skipped for want of budget is no failure.

The open targets (`--stages targets`), in the order they run:

- `http`: the echo handler behind 8 and 16 HTTP processes (`bench.http_processes`):
  20,000 requests/s with 16 cores
- `encoders`: the BERT-base-sized classifier over HTTP, rawserve with no options and with
  a worker of two torch threads (`rawserve-threads2`), each with the 3x overload
  (`bench.compare --quick`): 503 p99 within 10 ms, goodput
- `generation`: GPT-2-small-sized `/v1/completions` against static `generate`
  (`bench.generation_serving`): 64 clients and mixed lengths against static batching,
  the first token at 16 streams against a lone one's, inter-token p99 at 64 streams
- `generation-overload`: the same model at 3x its capacity, 5 s deadlines: goodput,
  503s and 504s (`bench.generation_overload`), and the pace the scheduler learned there
  (a step's seconds beside one row and beside the most rows measured)

The rest (`--stages others`), the most telling first:

- `graphs`: the worker's runner with CUDA graphs and without, in-process
  (`bench.cuda_graphs`)
- `decode`: generation in-process: static `generate`, the continuous loop, and the loop
  replayed from CUDA graphs (`bench.generation`; where requests join one a step, each loop
  with joiners gathered too)
- `generation-gathered`: served generation with joiners waiting up to 4 steps for
  company (`--join-wait-steps 4`), against `generation`'s figures: prefills a step, tokens/s,
  the first token
- `lone`: where a lone request's time goes, with the default HTTP processes and with one
  (`bench.lone_request`)
- `encoders-more`: `encoders`' classifier with CUDA graphs off (`rawserve-eager`), lists
  of 32 texts, room for 8,192 connections (`rawserve-connections`: whether the
  connection cap made the 503s slow at 3x overload) and the seed's server
- `generation-eager`: served generation with CUDA graphs off, every scenario
- `attention`: attention kernels on new shapes (`bench.attention_shapes`)
- `profile`: a sampling profile of the server at 256 clients (`bench.profile`, needs
  py-spy)
- `overlap`: the preparing thread on and off, in-process (`bench.overlap --prepare`)
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import described
from bench.gpu import missing_cuda

TAIL_LINES = 20
# a lent machine sends back files of 16 MiB at most: the archive stays well inside that
PACKED_FILE_LIMIT = 4 * 1024 * 1024
# one command on a lent GPU may run 600 s: the stages, and the wheels' install before them
BUDGET = 500.0
# a dry run's stages may take this many times their GPU limits: a CPU shared by its tools
# builds and loads the models, and runs what the GPU skips (ONNX Runtime's ceiling)
DRY_RUN_SLOWER = 4
# what `--limit` keeps back: a stage's servers stopped, the summary and archive written
LIMIT_MARGIN = 30.0
ARCHIVE = "round.tar.gz"  # in `--back`
# seconds a stopped round's running stage has to stop its servers and remove its files
# (SIGINT: its `finally` blocks run) before its group is killed
STOP_GRACE = 10.0


@dataclass(frozen=True)
class Stage:
    name: str
    seconds: int  # its time limit
    argv: tuple[str, ...]  # after `python -m`
    targets: bool = False  # measures an open target of the issues: runs in the first command


def stages(out: Path, dry_run: bool = False) -> list[Stage]:
    """Every stage, the open targets' first (they fit the default budget together).

    A dry run gives each stage the same options at sizes a CPU runs in seconds (tiny
    models, short runs), so a wrong option or value shows here, not on the GPU.
    """

    def sized(gpu: Any, cpu: Any) -> Any:
        return cpu if dry_run else gpu

    def stage(name: str, seconds: int, argv: tuple[str, ...], targets: bool = False) -> Stage:
        return Stage(name, seconds * sized(1, DRY_RUN_SLOWER), argv, targets)

    device = sized("cuda", "cpu")
    model = ("--layers", sized("12", "2"), "--hidden", sized("768", "64"))
    encoder = sized("bert-base-classification", "classification")
    clients = ("--clients", sized("1,64,256", "1,4"), "--client-processes", sized("6", "1"))
    return [
        stage("http", 30, (
            "bench.http_processes", "--processes", *sized(("8", "16"), ("1", "2")), "--loops",
            "uvloop", "--rounds", "1", "--duration", sized("3", "0.5"), "--clients",
            sized("256", "16"), "--client-processes", sized("6", "1")), targets=True),
        stage("encoders", 140, (
            "bench.compare", "--device", device, "--quick", "--scenarios", encoder,
            "--text-sets", "short", "--servers", "rawserve-default,rawserve-threads2",
            *clients, "--json", str(out / "encoders.json")), targets=True),
        stage("generation", 100, (
            "bench.generation_serving", "--device", device, *model, "--rounds", "1",
            "--duration", sized("20", "2"), "--systems", "rawserve-continuous",
            "static-in-process", "--scenarios", "64 x 64", "mixed 256 x 8-256",
            "stream 1 x 64", "stream 16 x 64", "stream 64 x 64", "stream 16 x 64 spread", "--json",
            str(out / "generation.json")), targets=True),
        stage("generation-overload", 80, (
            "bench.generation_overload", "--device", device, *model, "--rounds", "1",
            "--duration", sized("8", "1")), targets=True),
        stage("graphs", 45, (
            "bench.cuda_graphs", "--device", sized("cuda:0", "cpu"), "--batches",
            *sized(("1", "16", "64", "256"), ("1", "4")), "--seconds", sized("0.5", "0.1"),
            "--rounds", sized("2", "1"))),
        stage("decode", 60, (
            "bench.generation", "--device", device, *model, "--rounds", "1")),
        stage("generation-gathered", 50, (
            "bench.generation_serving", "--device", device, *model, "--rounds", "1",
            "--duration", sized("20", "2"), "--systems", "rawserve-gathered", "--scenarios",
            "64 x 64", "stream 16 x 64", "stream 16 x 64 spread", "stream 64 x 64", "--json",
            str(out / "generation-gathered.json"))),
        stage("lone", 80, (
            "bench.lone_request", "--scenario", encoder, "--requests", sized("300", "5"),
            "--config=", "--config=--http-processes 1", "--out", str(out / "lone"))),
        stage("encoders-more", 165, (
            "bench.compare", "--device", device, "--quick", "--scenarios", encoder,
            "--text-sets", "short", "--servers",
            "rawserve-eager,rawserve-lists,rawserve-connections,seed-batching",
            *clients, "--json", str(out / "encoders-more.json"))),
        stage("generation-eager", 70, (
            "bench.generation_serving", "--device", device, *model, "--rounds", "1",
            "--duration", sized("20", "2"), "--systems", "rawserve-eager", "--json",
            str(out / "generation-eager.json"))),
        stage("attention", 60, (
            "bench.attention_shapes", "--device", device, "--batches", sized("30", "2"),
            "--new-tokens", sized("32", "2"), *sized((), ("--choices", "default", "math")),
            # (a CPU without half-precision units takes a minute a half batch of BERT-base)
            "--dtype", sized("float16", "float32"))),
        stage("profile", 50, (
            "bench.profile", "--scenario", encoder, "--clients", sized("256", "4"),
            "--seconds", sized("6", "1"), "--rate", "200", "--out", str(out / "profile"))),
        stage("overlap", 70, (
            "bench.overlap", "--prepare", "--device", device, "--batch", sized("256", "8"),
            *model, "--rounds", sized("2", "1"), "--seconds", sized("3", "0.5"))),
    ]  # fmt: skip


def run_stage(stage: Stage, out: Path, python: str = sys.executable) -> dict[str, Any]:
    """Run one stage under its time limit; its output goes to OUT/<name>.log."""
    command = [python, "-m", *stage.argv]
    log = out / f"{stage.name}.log"
    started = time.monotonic()
    with log.open("wb") as sink:
        # a group of its own: at its end, past its limit, or when the round is stopped,
        # whatever it started (its servers, their workers) goes with it
        process = subprocess.Popen(
            command, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True
        )
        timed_out = False
        try:
            process.wait(timeout=stage.seconds)
        except subprocess.TimeoutExpired:
            timed_out = True
        except KeyboardInterrupt:  # the round is stopped (SIGINT or SIGTERM: `hear_stops`)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGINT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=STOP_GRACE)
            raise
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            code = process.wait()
    return {
        "stage": stage.name,
        "command": command,
        "exit": code,
        "timed_out": timed_out,
        "seconds": round(time.monotonic() - started, 1),
        "log": str(log),
    }


def tail(path: Path, lines: int = TAIL_LINES) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def run(
    chosen: Sequence[Stage], out: Path, budget: float, back: Path | None = None
) -> list[dict[str, Any]]:
    """Each stage in turn while the budget holds it; OUT/summary.json (and, with `back`,
    the folder a lent machine sends back) rewritten as each ends, so that a command
    killed from outside still returns every stage ended before."""
    out.mkdir(parents=True, exist_ok=True)
    monitor = None
    if shutil.which("nvidia-smi"):
        with (out / "dmon.log").open("wb") as sink:
            command = ["nvidia-smi", "dmon", "-s", "u", "-d", "1"]
            monitor = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + budget
    found: list[dict[str, Any]] = []
    try:
        for stage in chosen:
            left = deadline - time.monotonic()
            if stage.seconds > left:
                found.append({"stage": stage.name, "skipped": f"{left:.0f} s left"})
                print(f"== {stage.name}: skipped, {left:.0f} s left of the budget", flush=True)
                keep(found, out, back, packed=False)
                continue
            print(f"== {stage.name} (at most {stage.seconds} s)", flush=True)
            try:
                result = run_stage(stage, out)
            except KeyboardInterrupt:  # stopped from outside: what ran is kept
                found.append({"stage": stage.name, "interrupted": True})
                print(f"== {stage.name}: interrupted", flush=True)
                break
            found.append(result)
            print(tail(Path(result["log"])), flush=True)
            ended = "ran out of time" if result["timed_out"] else f"exit {result['exit']}"
            print(f"== {stage.name}: {ended} after {result['seconds']} s", flush=True)
            keep(found, out, back)
    finally:
        if monitor is not None:
            monitor.terminate()
            monitor.wait()
        reached = {f["stage"] for f in found}
        # named, so that `--skipped-from` runs them next
        found += [
            {"stage": stage.name, "skipped": "the round was stopped"}
            for stage in chosen
            if stage.name not in reached
        ]
        keep(found, out, back)
    return found


def keep(found: list[dict[str, Any]], out: Path, back: Path | None, packed: bool = True) -> None:
    """The summary so far into OUT and, with `back`, beside OUT's archive there."""
    summary = json.dumps(found, indent=1)
    replace_file(out / "summary.json", summary.encode())
    if back is not None:
        back.mkdir(parents=True, exist_ok=True)
        replace_file(back / "summary.json", summary.encode())
        if packed or not (back / ARCHIVE).exists():
            pack(out, back / ARCHIVE)


def replace_file(path: Path, data: bytes) -> None:
    """Written whole or not at all: a command killed meanwhile leaves the last version."""
    partial = path.with_name(f"{path.name}.partial")
    partial.write_bytes(data)
    partial.replace(path)


def succeeded(found: Sequence[dict[str, Any]]) -> bool:
    """Every stage that ran ended well and none was stopped: a stage skipped for want of
    budget is no failure (`--skipped-from` runs it in the next command)."""
    return all(
        not f.get("interrupted") and not f.get("timed_out") and f.get("exit", 0) == 0 for f in found
    )


def skipped_stages(summary: Path) -> list[str]:
    """The stages an earlier round's summary names skipped or interrupted."""
    found = json.loads(summary.read_text())
    return [f["stage"] for f in found if "skipped" in f or f.get("interrupted")]


def pack(out: Path, archive: Path, limit: int = PACKED_FILE_LIMIT) -> None:
    """Every file of OUT in one archive (a machine may send back only a few files, of 16
    MiB each at most): a file over `limit` bytes (a profile's raw stacks) is left out,
    and named in the archive's `left-out.txt`."""
    archive.parent.mkdir(parents=True, exist_ok=True)
    partial = archive.with_name(f"{archive.name}.partial")  # the last whole one stays meanwhile
    name = out.name or "round"
    too_big = {
        f"{name}/{path.relative_to(out)}": path.stat().st_size
        for path in out.rglob("*")
        if path.is_file() and path.stat().st_size > limit
    }
    with tarfile.open(partial, "w:gz") as tar:
        tar.add(out, arcname=name, filter=lambda info: None if info.name in too_big else info)
        if too_big:
            said = "".join(f"{path}: {size} bytes\n" for path, size in sorted(too_big.items()))
            info = tarfile.TarInfo(f"{name}/left-out.txt")
            info.size = len(said.encode())
            tar.addfile(info, io.BytesIO(said.encode()))
    partial.replace(archive)


def chosen_stages(names: Sequence[str], out: Path, dry_run: bool) -> list[Stage]:
    """The stages named, in the round's order; `targets` and `others` name the two groups."""
    every = stages(out, dry_run)
    wanted = set(names)
    return [
        stage
        for stage in every
        if stage.name in wanted or ("targets" if stage.targets else "others") in wanted
    ]


def hear_stops() -> None:
    """SIGINT and SIGTERM (a timeout's, a kill's) both stop the round as KeyboardInterrupt
    (`run_stage`): the running stage's group is stopped, then killed; the summary written.
    A command started in the background (a shell's `&`, a runner's) inherits SIGINT
    ignored, and Python then raises no KeyboardInterrupt: round.sh's stop went unheard;
    SIGTERM's default ended the round at once, its stage left running in its own group."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.gpu_round", description=described(__doc__)
    )
    parser.add_argument("--out", type=Path, required=True, help="a folder for the logs")
    parser.add_argument(
        "--budget",
        type=float,
        default=None,
        help=f"seconds for all stages (default: {BUDGET:.0f}; none in a dry run)",
    )
    parser.add_argument(
        "--limit",
        type=float,
        help="seconds this command may still run (a lent machine's): the budget is cut to "
        f"end {LIMIT_MARGIN:.0f} s short of it",
    )
    names = [stage.name for stage in stages(Path())]
    parser.add_argument(
        "--stages",
        nargs="+",
        choices=[*names, "targets", "others"],
        help="default: targets and others (none with --skipped-from)",
    )
    parser.add_argument(
        "--skipped-from",
        type=Path,
        metavar="SUMMARY",
        help="also the stages an earlier round's summary.json names skipped or interrupted",
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="every stage on the CPU at tiny sizes"
    )
    parser.add_argument(
        "--back",
        type=Path,
        metavar="DIR",
        help=f"after every stage, OUT packed into DIR/{ARCHIVE} and the summary copied "
        "there (a lent machine's $OUT: what a command killed from outside still returns)",
    )
    args = parser.parse_args(argv)
    hear_stops()
    for flag, seconds in (("--budget", args.budget), ("--limit", args.limit)):
        if seconds is not None and not (0 < seconds < float("inf")):  # 0 read as "default"
            parser.error(f"{flag} must be a positive number of seconds, not {seconds:g}")
    if not args.dry_run and (said := missing_cuda()):  # (else each stage fails at its limit)
        parser.exit(2, f"{parser.prog}: {said} (--dry-run runs every stage on the CPU, tiny)\n")
    wanted = args.stages or ([] if args.skipped_from else ["targets", "others"])
    if args.skipped_from:
        if not args.skipped_from.is_file():
            parser.error(f"no summary at {args.skipped_from}: name the stages (--stages)")
        wanted = [*wanted, *skipped_stages(args.skipped_from)]
    budget = args.budget if args.budget is not None else (float("inf") if args.dry_run else BUDGET)
    if args.limit is not None:
        budget = min(budget, args.limit - LIMIT_MARGIN)
    found = run(chosen_stages(wanted, args.out, args.dry_run), args.out, budget, args.back)
    return 0 if succeeded(found) else 1


if __name__ == "__main__":
    sys.exit(main())
