"""Turn a comparison's figures into a table of ratios, a picture, and the RESULTS.md section.

The table compares, in the same run, each server at 64 clients with the model's own
offline throughput (the plain tokenizer + forward-pass ceiling; for mixed lengths the
length-sorted one), and checks rawserve against the targets of the performance issues: on
the CPU the 2-core rows; on a GPU (`--device cuda`) the GPU rows of the "feed the GPU" and
"schedule for the GPU" issues, for every scenario and rawserve server the run measured, a
target whose figure is missing named with why it is not measured.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from functools import partial
from pathlib import Path

from rawserve.options import GPU_MAX_BATCH_SIZE

# a row of the targets table: the target, what was measured, met (None: not judged)
Check = Callable[[str, str, bool | None], None]
SERVER_LABELS = {
    "rawserve": "rawserve (torch)",
    "rawserve-onnx": "rawserve (ONNX Runtime)",
    "rawserve-default": "rawserve, no options",
    "rawserve-lists": "rawserve, lists of 32 texts",
    "rawserve-threads2": "rawserve, 2 torch threads",
    "rawserve-eager": "rawserve, no CUDA graphs",
    "rawserve-connections": "rawserve, 8,192 connections",
    "rawserve-http4": "rawserve, 4 HTTP processes",
    "rawserve-count": "rawserve, queue-order batching",
    "seed-batching": "seed, 1 ms batching",
    "seed-per-item": "seed, per item",
    "infinity-torch": "Infinity (torch)",
    "infinity-optimum": "Infinity (optimum/ONNX)",
}
SECTION = "## Performance"
BEGIN = "<!-- performance figures: written by `python -m bench.compare --record` -->"
END = "<!-- end of performance figures -->"


def _point(server: dict, text_set: str, clients: int) -> dict | None:
    points = server.get("text_sets", {}).get(text_set, {}).get("points", [])
    return next((p for p in points if p["clients"] == clients), None)


def ceiling_of(scenario: dict, text_set: str, mode: str = "forward") -> float | None:
    ceiling = scenario["ceiling"].get(text_set, {})
    order = "sorted" if f"{mode}/sorted" in ceiling else "arrival"
    curve = ceiling.get(f"{mode}/{order}")
    return curve["best"] if curve else None


def _fmt(value: float | None, digits: int = 2) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def ratio_table(results: dict) -> str:
    """Markdown: throughput at 64 clients, as a ratio to the ceiling, per server."""
    ran = [name for scenario in results["scenarios"] for name in scenario["servers"]]
    # the known servers in their usual order, then any other that ran: each has a column
    names = list(dict.fromkeys([n for n in SERVER_LABELS if n in ran] + ran))
    header = ["workload (64 clients)", "ceiling: forward / pipeline / ONNX (items/s)"]
    header += [SERVER_LABELS.get(n, n) for n in names]
    rows = [header, ["---"] * len(header)]
    for scenario in results["scenarios"]:
        for text_set in scenario["ceiling"]:
            forward = ceiling_of(scenario, text_set, "forward")
            pipeline = ceiling_of(scenario, text_set, "pipeline")
            onnx = ceiling_of(scenario, text_set, "onnx")
            sorted_note = " (length-sorted)" if text_set == "mixed" else ""
            row = [
                f"{scenario['model']}, {text_set} texts",
                f"{_fmt(forward, 0)} / {_fmt(pipeline, 0)} / {_fmt(onnx, 0)}{sorted_note}",
            ]
            for name in names:
                point = _point(scenario["servers"].get(name, {}), text_set, 64)
                if point is None or not forward:
                    row.append("–")
                    continue
                rate = point["throughput"]
                row.append(f"{rate:.0f}/s = **{rate / forward:.2f}** × ceiling")
            rows.append(row)
    return _markdown(rows) + "\n\n" + targets_table(results)


def targets_table(results: dict) -> str:
    """Markdown: each target of the performance issue, what rawserve did, met or not."""
    rows = [["target", "measured", "met"], ["---", "---", "---"]]

    def check(target: str, measured: str, met: bool | None) -> None:
        rows.append([target, measured, "–" if met is None else ("yes" if met else "**no**")])

    def against_ceiling(target: str, point: dict | None, ceiling: float | None, floor: float):
        if point and ceiling:
            ratio = point["throughput"] / ceiling
            measured = f"{ratio:.2f} ({point['throughput']:.0f} of {ceiling:.0f} items/s)"
            check(target, measured, ratio >= floor)

    if ran_on_gpu(results):
        gpu_targets(results, check)
    else:
        cpu_targets(results, check, against_ceiling)
    soak = results.get("soak")
    if soak:
        growth = soak["rss_after"] - soak["rss_before"]
        check(
            f"server RSS flat across {soak['requests']:,} requests (echo handler)",
            f"{soak['rss_before'] / 2**20:.1f} → {soak['rss_after'] / 2**20:.1f} MiB "
            f"({growth / 2**20:+.1f} MiB)",
            growth <= soak.get("tolerance_bytes", 4 * 2**20),
        )
    for run in results.get("soak_model", []):
        first, last = run["rss"][0], run["rss"][-1]
        growth = max((last[part] - first[part]) / first[part] for part in ("server", "workers"))
        check(
            f"{sum(run['statuses'].values()):,} MiniLM requests ({run['engine']}): "
            "server and worker RSS flat (±5 %), first vs last tenth",
            f"server {first['server'] / 2**20:.0f} → {last['server'] / 2**20:.0f} MiB, "
            f"workers {first['workers'] / 2**20:.0f} → {last['workers'] / 2**20:.0f} MiB",
            growth <= 0.05,
        )
    return _markdown(rows)


def cpu_targets(results: dict, check: Check, against_ceiling: Callable[..., None]) -> None:
    """The 2-core CPU's targets: the classification and embedding scenarios' rows."""
    by_name = {s["model"]: s for s in results["scenarios"]}
    classification = by_name.get("classification")
    embeddings = by_name.get("token-embeddings")
    if classification:
        raw = classification["servers"].get("rawserve", {})
        saturated = _point(raw, "short", 64)
        against_ceiling(
            "saturation (classification, short, 64 clients) ≥ 0.90 × forward ceiling",
            saturated,
            ceiling_of(classification, "short"),
            0.90,
        )
        against_ceiling(
            "mixed lengths (classification, 64 clients) ≥ 0.95 × length-sorted ceiling",
            _point(raw, "mixed", 64),
            ceiling_of(classification, "mixed"),
            0.95,
        )
        single = classification["ceiling"].get("short", {}).get("single_item_ms", {}).get("p50")
        point = _point(raw, "short", 1)
        if point and single:
            check(
                "1 client: p50 ≤ single-item forward + 1 ms",
                f"{point['p50_ms']:.2f} ms vs {single:.2f} + 1 ms",
                point["p50_ms"] <= single + 1.0,
            )
        for name, engine in (("rawserve", "torch"), ("rawserve-onnx", "ONNX Runtime")):
            server = classification["servers"].get(name, {})
            overload = server.get("text_sets", {}).get("short", {}).get("overload")
            if overload:
                overload_targets(overload, engine, check)
        if saturated and "health" in saturated:
            p99 = saturated["health"]["p99_ms"]
            check(
                "GET /health p99 ≤ 5 ms while saturated",
                f"{_fmt(p99)} ms ({saturated['health']['requests']} probes)",
                None if p99 is None else p99 <= 5.0,
            )
    if embeddings:
        raw = _point(embeddings["servers"].get("rawserve", {}), "short", 64)
        seed = _point(embeddings["servers"].get("seed-batching", {}), "short", 64)
        against_ceiling(
            "large outputs (token vectors, short, 64 clients) ≥ 0.80 × ceiling",
            raw,
            ceiling_of(embeddings, "short"),
            0.80,
        )
        if raw and seed and seed["throughput"]:
            ratio = raw["throughput"] / seed["throughput"]
            check(
                "large outputs ≥ 3 × the seed's batching server",
                f"{ratio:.1f}× ({raw['throughput']:.0f} vs {seed['throughput']:.0f}/s)",
                ratio >= 3.0,
            )
    engine_targets(results, check, against_ceiling)


def overload_targets(overload: dict, engine: str, check) -> None:
    """The open-loop run at 3× capacity: goodput, the refusals' latency, late answers."""
    share = overload["goodput"] / overload["capacity"]
    check(
        f"overload at 3× capacity ({engine}): goodput ≥ 0.95 × capacity",
        f"{share:.2f} ({overload['goodput']:.0f} of {overload['capacity']:.0f}/s)",
        share >= 0.95,
    )
    rejected = overload.get("503", {}).get("p99_ms")
    check(
        f"overload ({engine}): 503 answered with p99 ≤ 5 ms",
        f"{_fmt(rejected)} ms ({overload['statuses'].get('503', 0)} answers)",
        None if rejected is None else rejected <= 5.0,
    )
    check(
        f"overload ({engine}): no 200 later than its deadline",
        f"{overload['late_200']} late (deadline {1000 * 2:.0f} ms, "
        f"slowest 200: {overload['late_200_max_ms']:.0f} ms)",
        overload["late_200"] == 0,
    )


def engine_targets(results: dict, check, against_ceiling) -> None:
    """The targets of the ONNX Runtime engine, default layout and embedding servers issue."""
    by_name = {s["model"]: s for s in results["scenarios"]}
    classification = by_name.get("classification")
    if classification:
        onnx = _point(classification["servers"].get("rawserve-onnx", {}), "short", 64)
        torch_ceiling = ceiling_of(classification, "short", "forward")
        ort_ceiling = ceiling_of(classification, "short", "onnx")
        against_ceiling(
            "ONNX engine, 64 clients, short ≥ 1.15 × the PyTorch forward ceiling",
            onnx,
            torch_ceiling,
            1.15,
        )
        against_ceiling(
            "ONNX engine, 64 clients, short ≥ 0.9 × the ONNX Runtime ceiling",
            onnx,
            ort_ceiling,
            0.90,
        )
        single = classification["ceiling"].get("short", {}).get("onnx_single_item_ms", {})
        one = _point(classification["servers"].get("rawserve-onnx", {}), "short", 1)
        if one and single.get("p50"):
            check(
                "ONNX engine, 1 client: p50 ≤ ONNX Runtime batch-1 time + 1 ms",
                f"{one['p50_ms']:.2f} ms vs {single['p50']:.2f} + 1 ms",
                one["p50_ms"] <= single["p50"] + 1.0,
            )
        default = _point(classification["servers"].get("rawserve-default", {}), "short", 64)
        against_ceiling(
            "no options (auto: ONNX Runtime), 64 clients ≥ 0.9 × the ceiling of its engine",
            default,
            ort_ceiling,
            0.90,
        )
    sentences = by_name.get("sentence-embeddings")
    if sentences:
        best = max(
            (
                _point(sentences["servers"].get(name, {}), "short", 64) or {"throughput": 0}
                for name in ("rawserve-onnx", "rawserve-default")
            ),
            key=lambda point: point["throughput"],
        )
        for name, label, floor in (
            ("infinity-torch", "Infinity (torch)", 1.5),
            ("infinity-optimum", "Infinity (optimum/ONNX)", 1.0),
        ):
            other = _point(sentences["servers"].get(name, {}), "short", 64)
            if other and other["throughput"] and best["throughput"]:
                ratio = best["throughput"] / other["throughput"]
                check(
                    f"sentence embeddings, 64 clients: rawserve ≥ {floor:g} × {label}",
                    f"{ratio:.2f}× ({best['throughput']:.0f} vs {other['throughput']:.0f}/s)",
                    ratio >= floor,
                )


# --- the GPU's targets (issues 25 and 26: a BERT-base-sized classifier, short texts) ---

GPU_TEXT_SET = "short"
SINGLE_TEXTS_FLOOR = 0.7  # × the ceiling at the server's batch cap, at 256 clients
LISTS_FLOOR = 0.9  # lists of 32 texts, × the same ceiling
SINGLE_TEXTS_CLIENTS = 256
SEED_FACTOR = 3.0  # × the seed's batching server, at 64 and at 256 clients
SEED_CLIENTS = (64, 256)
SPREAD_CLIENTS = 64
SPREAD_FACTOR = 3.0  # p99 ≤ this × p50 at 64 clients
SLOWEST_MS = 1000.0  # no answer slower at 64 clients
LONE_MARGIN_MS = 1.0  # 1 client: p50 ≤ the ceiling's batch-1 time + this
GPU_GOODPUT_FLOOR = 0.9  # overload at 3× capacity, × capacity
GPU_REFUSAL_P99_MS = 10.0


class NotMeasured(Exception):
    """A target's figure is missing from the results; its message says why."""


def ran_on_gpu(results: dict) -> bool:
    return results.get("settings", {}).get("device", "cpu") != "cpu"


def judged(check: Check, target: str, verdict: Callable[[], tuple[str, bool]]) -> None:
    """One row: what `verdict` measured and whether it met `target`, or why not measured."""
    try:
        measured, met = verdict()
    except NotMeasured as missing:
        check(target, f"not measured: {missing}", None)
    else:
        check(target, measured, met)


def batch_cap(results: dict) -> int:
    """rawserve's item cap a batch in the run: `--max-batch-size` where given, else a GPU's."""
    args = list(results.get("settings", {}).get("rawserve_args", ()))
    for at, arg in enumerate(args):
        if arg == "--max-batch-size" and at + 1 < len(args):
            return int(args[at + 1])
        if arg.startswith("--max-batch-size="):
            return int(arg.split("=", 1)[1])
    return GPU_MAX_BATCH_SIZE


def ceiling_at(scenario: dict, batch: int) -> float:
    """The in-process forward ceiling at batches of `batch` items (short texts, arrival)."""
    curve = scenario["ceiling"].get(GPU_TEXT_SET, {}).get("forward/arrival", {}).get("curve", {})
    if not curve.get(str(batch)):
        measured = ", ".join(curve) or "none"
        raise NotMeasured(f"the ceiling has no batch of {batch} (batches: {measured})")
    return curve[str(batch)]


def points_of(server: dict | None, name: str) -> list[dict]:
    """The closed-loop points of `name` on short texts; why there are none, if so."""
    if server is None:
        raise NotMeasured(f"{name} did not run")
    if "error" in server:
        raise NotMeasured(f"{name} failed: {server['error']}")
    points = server.get("text_sets", {}).get(GPU_TEXT_SET, {}).get("points", [])
    if not points:
        raise NotMeasured(f"{name} ran no {GPU_TEXT_SET} texts")
    return points


def point_at(server: dict | None, name: str, clients: int) -> dict:
    points = points_of(server, name)
    point = next((p for p in points if p["clients"] == clients), None)
    if point is None:
        ran = ", ".join(str(p["clients"]) for p in points)
        raise NotMeasured(f"{name} ran no {clients}-client point (clients: {ran})")
    if not point["throughput"]:
        raise NotMeasured(f"{name} answered nothing with 200 at {clients} clients")
    return point


def gpu_targets(results: dict, check: Check) -> None:
    """The GPU rows, for each scenario and each rawserve server the run measured."""
    cap = batch_cap(results)
    overload_skipped = results.get("settings", {}).get("overload_duration") == 0
    for scenario in results["scenarios"]:
        servers = scenario["servers"]
        singles = [n for n in servers if n.startswith("rawserve") and n != "rawserve-lists"]
        for name in singles:
            single_text_targets(scenario, name, cap, check)
            gpu_overload_targets(scenario, name, overload_skipped, check)
        if not singles:
            check(
                f"{scenario['model']}: single-text targets",
                "not measured: no rawserve server of single texts ran",
                None,
            )
        judged(
            check,
            f"{scenario['model']}, {SERVER_LABELS['rawserve-lists']}: best point "
            f"≥ {LISTS_FLOOR:g} × the ceiling at batch {cap}",
            partial(lists_verdict, scenario, cap),
        )


def lists_verdict(scenario: dict, cap: int) -> tuple[str, bool]:
    points = points_of(scenario["servers"].get("rawserve-lists"), "rawserve-lists")
    best = max(points, key=lambda point: point["throughput"])
    if not best["throughput"]:
        raise NotMeasured("rawserve-lists answered nothing with 200")
    ceiling = ceiling_at(scenario, cap)
    ratio = best["throughput"] / ceiling
    measured = (
        f"{ratio:.2f} ({best['throughput']:.0f} of {ceiling:.0f} items/s, "
        f"{best['clients']} clients)"
    )
    return measured, ratio >= LISTS_FLOOR


def single_text_targets(scenario: dict, name: str, cap: int, check: Check) -> None:
    """The "feed the GPU" issue's rows for one rawserve server of single texts."""
    server = scenario["servers"][name]
    where = f"{scenario['model']}, {SERVER_LABELS.get(name, name)}"

    def against_ceiling() -> tuple[str, bool]:
        point = point_at(server, name, SINGLE_TEXTS_CLIENTS)
        ceiling = ceiling_at(scenario, cap)
        ratio = point["throughput"] / ceiling
        measured = f"{ratio:.2f} ({point['throughput']:.0f} of {ceiling:.0f} items/s)"
        return measured, ratio >= SINGLE_TEXTS_FLOOR

    def against_seed(clients: int) -> Callable[[], tuple[str, bool]]:
        def verdict() -> tuple[str, bool]:
            point = point_at(server, name, clients)
            seed = point_at(scenario["servers"].get("seed-batching"), "seed-batching", clients)
            ratio = point["throughput"] / seed["throughput"]
            measured = f"{ratio:.2f}× ({point['throughput']:.0f} vs {seed['throughput']:.0f}/s)"
            return measured, ratio >= SEED_FACTOR

        return verdict

    def spread() -> tuple[str, bool]:
        point = point_at(server, name, SPREAD_CLIENTS)
        p50, p99 = point["p50_ms"], point["p99_ms"]
        measured = f"{p99 / p50:.1f}× ({p50:.1f} / {p99:.1f} ms)"
        return measured, p99 <= SPREAD_FACTOR * p50

    def slowest() -> tuple[str, bool]:
        point = point_at(server, name, SPREAD_CLIENTS)
        if point.get("max_ms") is None:
            raise NotMeasured("the slowest answer was not recorded (max_ms)")
        return f"slowest {point['max_ms']:.1f} ms", point["max_ms"] <= SLOWEST_MS

    def lone() -> tuple[str, bool]:
        point = point_at(server, name, 1)
        single = scenario["ceiling"].get(GPU_TEXT_SET, {}).get("single_item_ms", {}).get("p50")
        if not single:
            raise NotMeasured("the ceiling's batch-1 time was not recorded (single_item_ms)")
        measured = f"{point['p50_ms']:.2f} ms vs {single:.2f} + {LONE_MARGIN_MS:g} ms"
        return measured, point["p50_ms"] <= single + LONE_MARGIN_MS

    judged(
        check,
        f"{where}, {SINGLE_TEXTS_CLIENTS} clients ≥ {SINGLE_TEXTS_FLOOR:g} × the ceiling at "
        f"batch {cap}",
        against_ceiling,
    )
    for clients in SEED_CLIENTS:
        judged(
            check,
            f"{where}, {clients} clients ≥ {SEED_FACTOR:g} × the seed's batching server",
            against_seed(clients),
        )
    judged(check, f"{where}, {SPREAD_CLIENTS} clients: p99 ≤ {SPREAD_FACTOR:g} × p50", spread)
    judged(check, f"{where}, {SPREAD_CLIENTS} clients: no answer over {SLOWEST_MS:.0f} ms", slowest)
    judged(check, f"{where}, 1 client: p50 ≤ the ceiling's batch-1 time + 1 ms", lone)


def gpu_overload_targets(scenario: dict, name: str, skipped: bool, check: Check) -> None:
    """The scheduling issue's encoder rows: goodput and the refusals' p99 at 3× capacity."""
    server = scenario["servers"][name]
    where = f"{scenario['model']}, {SERVER_LABELS.get(name, name)}"

    def overload() -> dict:
        points_of(server, name)  # why there is no overload where the server did not run
        found = server["text_sets"][GPU_TEXT_SET].get("overload")
        if not found:
            why = "the run was --no-overload" if skipped else f"bench.compare overloads no {name}"
            raise NotMeasured(why)
        return found

    def goodput() -> tuple[str, bool]:
        run = overload()
        share = run["goodput"] / run["capacity"]
        measured = f"{share:.2f} ({run['goodput']:.0f} of {run['capacity']:.0f}/s)"
        return measured, share >= GPU_GOODPUT_FLOOR

    def refusals() -> tuple[str, bool]:
        run = overload()
        p99 = run.get("503", {}).get("p99_ms")
        if p99 is None:
            raise NotMeasured(f"no 503 answered (statuses {run['statuses']})")
        return f"{p99:.1f} ms ({run['statuses'].get('503', 0)} answers)", p99 <= GPU_REFUSAL_P99_MS

    judged(
        check,
        f"{where}, overload at 3× capacity: goodput ≥ {GPU_GOODPUT_FLOOR:g} × capacity",
        goodput,
    )
    judged(check, f"{where}, overload: 503 answered with p99 ≤ {GPU_REFUSAL_P99_MS:g} ms", refusals)


def _markdown(rows: list[list[str]]) -> str:
    return "\n".join("| " + " | ".join(row) + " |" for row in rows)


def plot(results: dict, path: Path) -> Path | None:
    """Throughput against p99 latency, one panel per workload, one line per server."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    panels = [(s, t) for s in results["scenarios"] for t in s["ceiling"]]
    figure, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4.4), squeeze=False)
    for axis, (scenario, text_set) in zip(axes[0], panels, strict=True):
        for name, label in SERVER_LABELS.items():
            server = scenario["servers"].get(name, {})
            points = server.get("text_sets", {}).get(text_set, {}).get("points", [])
            points = [p for p in points if p["throughput"] and p["p99_ms"]]
            if not points:
                continue
            xs = [p["throughput"] for p in points]
            ys = [p["p99_ms"] for p in points]
            (line,) = axis.plot(xs, ys, marker="o", label=label)
            for point, x, y in zip(points, xs, ys, strict=True):
                axis.annotate(
                    str(point["clients"]),
                    (x, y),
                    textcoords="offset points",
                    xytext=(4, 4),
                    fontsize=7,
                    color=line.get_color(),
                )
        for mode, style in (("forward", "-"), ("pipeline", ":"), ("onnx", "--")):
            ceiling = ceiling_of(scenario, text_set, mode)
            if ceiling:
                axis.axvline(ceiling, color="grey", linestyle=style, linewidth=1)
                axis.annotate(
                    f"{mode} ceiling",
                    (ceiling, 1),
                    xycoords=("data", "axes fraction"),
                    rotation=90,
                    va="top",
                    ha="right",
                    fontsize=7,
                    color="grey",
                )
        sorted_note = ", length-sorted ceiling" if text_set == "mixed" else ""
        axis.set_title(f"{scenario['model']}, {text_set} texts{sorted_note}", fontsize=10)
        axis.set_xlabel("throughput (items/s)")
        axis.set_ylabel("p99 latency (ms), log scale")
        axis.set_yscale("log")
        plain = matplotlib.ticker.FuncFormatter(lambda y, _: f"{y:g}")
        axis.yaxis.set_major_formatter(plain)
        axis.yaxis.set_minor_formatter(plain)
        axis.set_xlim(left=0)
        axis.grid(True, which="both", alpha=0.3)
        axis.legend(fontsize=8, loc="upper left")
    figure.suptitle("Throughput against p99 latency at 1, 4, 16, 64 clients (labels)", fontsize=11)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def tools_table(results: dict) -> str:
    """wrk and hey at the saturation point (`--tools`), next to bench.load's own figures."""
    rows = []
    for scenario in results["scenarios"]:
        for name, server in scenario["servers"].items():
            for text_set, entry in server.get("text_sets", {}).items():
                own = _point(server, text_set, 64)
                for tool, figures in entry.get("tools", {}).items():
                    if not rows:
                        rows = [
                            ["server, workload", "tool", "items/s", "p50 ms", "p99 ms"],
                            ["---"] * 5,
                        ]
                    if own and tool == sorted(entry["tools"])[0]:
                        rows.append(
                            [
                                f"{SERVER_LABELS.get(name, name)}, {scenario['model']}",
                                "bench.load",
                                f"{own['throughput']:.0f}",
                                _fmt(own["p50_ms"], 1),
                                _fmt(own["p99_ms"], 1),
                            ]
                        )
                    rows.append(
                        [
                            f"{SERVER_LABELS.get(name, name)}, {scenario['model']}",
                            tool,
                            _fmt(figures.get("throughput"), 0),
                            _fmt(figures.get("p50_ms"), 1),
                            _fmt(figures.get("p99_ms"), 1),
                        ]
                    )
    return "\n".join("| " + " | ".join(row) + " |" for row in rows)


def ceiling_table(results: dict) -> str:
    rows = []
    for scenario in results["scenarios"]:
        for text_set, ceiling in scenario["ceiling"].items():
            for key, curve in ceiling.items():
                if not isinstance(curve, dict) or "curve" not in curve:
                    continue
                sizes = list(curve["curve"])
                if not rows:
                    rows.append(["model, texts", "way, order", *sizes])
                    rows.append(["---"] * len(rows[0]))
                rows.append(
                    [f"{scenario['model']}, {text_set}", key, *map(str, curve["curve"].values())]
                )
    return "\n".join("| " + " | ".join(row) + " |" for row in rows)


def record(results: dict, table: str, picture: Path | None, path: Path) -> None:
    """Write the generated figures between the markers of the Performance section."""
    machine = results["machine"]
    lines = [
        BEGIN,
        "",
        f"Measured with `{results['command'].strip()}` in {results['seconds']:.0f} s on "
        f"{machine['cores']} cores ({machine['cpu']}), Python {machine['python']}, "
        f"torch {machine['torch']}, transformers {machine['transformers']}; the server, "
        "its model workers and the load generator share those cores. rawserve ran as "
        "`--device cpu,cpu --engine torch` (torch), `--device cpu,cpu --engine onnx` (ONNX "
        "Runtime) and with no options"
        + (
            f" beyond `{' '.join(results['settings']['rawserve_args'])}`"
            if results["settings"]["rawserve_args"]
            else ""
        )
        + "; the seed's servers with uvicorn's defaults, Infinity with `--batch-size 64`.",
        "",
        table,
        "",
    ]
    if picture is not None:
        lines += [f"![throughput against p99 latency]({picture.name})", ""]
    lines += [
        "The ceiling, items/s by batch size (one process, best of 3 timed rounds; mixed "
        "lengths: best of whole passes over 256 texts; "
        f"{results['scenarios'][0]['ceiling'].get('short', {}).get('threads', '?')} "
        "torch threads):",
        "",
        ceiling_table(results),
        "",
    ]
    tools = tools_table(results)
    if tools:
        lines += ["The saturation point through `wrk` and `hey` (64 connections, one body):", ""]
        lines += [tools, ""]
    lines.append(END)
    generated = "\n".join(lines)
    text = path.read_text() if path.exists() else "# Benchmark results\n"
    if SECTION not in text:
        text = text.rstrip("\n") + f"\n\n{SECTION}\n\n{BEGIN}\n{END}\n"
    start = text.index(SECTION)
    following = re.search(r"^## ", text[start + len(SECTION) :], flags=re.MULTILINE)
    end = start + len(SECTION) + following.start() if following else len(text)
    section = text[start:end]
    if BEGIN in section and END in section:
        before, rest = section.split(BEGIN, 1)
        after = rest.split(END, 1)[1]
        section = before + generated + after
    else:
        section = section.rstrip("\n") + "\n\n" + generated + "\n\n"
    path.write_text(text[:start] + section + text[end:])
