"""One bounded pass over every GPU measurement, for a machine lent for minutes.

    python -m bench.gpu_round --out /tmp/gpu                  # every stage, 11-19 minutes
    python -m bench.gpu_round --out /tmp/gpu --budget 400 --stages encoders generation

Each stage is one of the benchmarks, run as a command of its own under a time limit
(killed past it: what it printed so far is kept), its output in `OUT/<stage>.log` and its
last lines on the screen as it ends. A stage that would not fit in what is left of
`--budget` is skipped, and says so. Where `nvidia-smi` is installed, `OUT/dmon.log`
records the GPU's use each second meanwhile. `OUT/summary.json` lists every stage: its
command, exit status, seconds, and whether it ran out of time.

The stages, in the order they run (the in-process ones first: they need no server):

- `attention`: attention kernels on new shapes (`bench.attention_shapes`)
- `graphs`: the worker's runner with CUDA graphs and without, in-process
  (`bench.cuda_graphs`)
- `decode`: GPT-2-small-sized generation in-process: static `generate`, the continuous
  loop, and the loop replayed from CUDA graphs (`bench.generation --device cuda`)
- `encoders`: BERT-base-sized classifier over HTTP, with CUDA graphs and without
  (`rawserve-eager`), with a worker of two torch threads (`rawserve-threads2`: the cores
  it leaves the HTTP processes), against the seed's server, with the 3x overload
  (`bench.compare --quick`)
- `generation`: GPT-2-small-sized `/v1/completions`, with CUDA graphs and without
  (`rawserve-eager`), against static `generate` (`bench.generation_serving`)
- `generation-overload`: the same model at 3x its capacity, 5 s deadlines: goodput,
  503s and 504s (`bench.generation_overload`)
- `http`: the echo handler behind 4, 8 and 16 HTTP processes (`bench.http_processes`)
- `lone`: where a lone request's time goes, with the default HTTP processes and with one
  (`bench.lone_request`)
- `profile`: a sampling profile of the server at 256 clients (`bench.profile`, needs
  py-spy)
- `overlap`: the preparing thread on and off, in-process (`bench.overlap --prepare`)
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TAIL_LINES = 20


@dataclass(frozen=True)
class Stage:
    name: str
    seconds: int  # its time limit
    argv: tuple[str, ...]  # after `python -m`


def stages(out: Path) -> list[Stage]:
    return [
        Stage("attention", 80, (
            "bench.attention_shapes", "--device", "cuda", "--batches", "30",
            "--new-tokens", "32")),
        Stage("graphs", 70, (
            "bench.cuda_graphs", "--batches", "1", "16", "64", "256", "--seconds", "0.5",
            "--rounds", "2")),
        Stage("decode", 70, (
            "bench.generation", "--device", "cuda", "--layers", "12", "--hidden", "768",
            "--rounds", "1")),
        Stage("encoders", 300, (
            "bench.compare", "--device", "cuda", "--quick", "--scenarios",
            "bert-base-classification", "--text-sets", "short", "--servers",
            "rawserve-default,rawserve-eager,rawserve-threads2,rawserve-lists,seed-batching",
            "--json",
            str(out / "encoders.json"))),
        Stage("generation", 230, (
            "bench.generation_serving", "--device", "cuda", "--layers", "12", "--hidden",
            "768", "--rounds", "1", "--duration", "20", "--systems", "rawserve-continuous",
            "rawserve-eager", "static-in-process", "--json", str(out / "generation.json"))),
        Stage("generation-overload", 100, (
            "bench.generation_overload", "--device", "cuda", "--layers", "12", "--hidden",
            "768", "--rounds", "1", "--duration", "8")),
        Stage("http", 120, (
            "bench.http_processes", "--processes", "4", "8", "16", "--loops", "uvloop",
            "--rounds", "1", "--duration", "3", "--clients", "256",
            "--client-processes", "6")),
        Stage("lone", 80, (
            "bench.lone_request", "--scenario", "bert-base-classification", "--requests",
            "300", "--config=", "--config=--http-processes 1", "--out",
            str(out / "lone"))),
        Stage("profile", 60, (
            "bench.profile", "--scenario", "bert-base-classification", "--clients", "256",
            "--seconds", "6", "--rate", "200", "--out", str(out / "profile"))),
        Stage("overlap", 60, (
            "bench.overlap", "--prepare", "--device", "cuda", "--batch", "256", "--layers",
            "12", "--hidden", "768", "--rounds", "2", "--seconds", "3")),
    ]  # fmt: skip


def run_stage(stage: Stage, out: Path, python: str = sys.executable) -> dict[str, Any]:
    """Run one stage under its time limit; its output goes to OUT/<name>.log."""
    command = [python, "-m", *stage.argv]
    log = out / f"{stage.name}.log"
    started = time.monotonic()
    with log.open("wb") as sink:
        process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT)
        try:
            code = process.wait(timeout=stage.seconds)
            timed_out = False
        except subprocess.TimeoutExpired:
            process.kill()
            code = process.wait()
            timed_out = True
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


def run(chosen: Sequence[Stage], out: Path, budget: float) -> list[dict[str, Any]]:
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
                continue
            print(f"== {stage.name} (at most {stage.seconds} s)", flush=True)
            result = run_stage(stage, out)
            found.append(result)
            print(tail(Path(result["log"])), flush=True)
            ended = "ran out of time" if result["timed_out"] else f"exit {result['exit']}"
            print(f"== {stage.name}: {ended} after {result['seconds']} s", flush=True)
    finally:
        if monitor is not None:
            monitor.terminate()
            monitor.wait()
        (out / "summary.json").write_text(json.dumps(found, indent=1))
    return found


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.gpu_round", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--out", type=Path, required=True, help="a folder for the logs")
    parser.add_argument("--budget", type=float, default=1200.0, help="seconds for all stages")
    names = [stage.name for stage in stages(Path())]
    parser.add_argument("--stages", nargs="+", choices=names, default=names)
    args = parser.parse_args(argv)
    chosen = [stage for stage in stages(args.out) if stage.name in args.stages]
    found = run(chosen, args.out, args.budget)
    return 0 if all(f.get("exit") == 0 for f in found) else 1


if __name__ == "__main__":
    sys.exit(main())
