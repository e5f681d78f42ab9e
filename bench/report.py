"""Turn a comparison's figures into a table of ratios, a picture, and the RESULTS.md section.

The table compares, in the same run, each server at 64 clients with the model's own
offline throughput (the plain tokenizer + forward-pass ceiling; for mixed lengths the
length-sorted one), and checks rawserve against the targets of the performance issue.
"""

from __future__ import annotations

import re
from pathlib import Path

SERVER_LABELS = {
    "rawserve": "rawserve (torch)",
    "rawserve-onnx": "rawserve (ONNX Runtime)",
    "rawserve-default": "rawserve, no options",
    "rawserve-lists": "rawserve, lists of 32 texts",
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
    names = [n for n in SERVER_LABELS if any(n in s["servers"] for s in results["scenarios"])]
    header = ["workload (64 clients)", "ceiling: forward / pipeline / ONNX (items/s)"]
    header += [SERVER_LABELS[n] for n in names]
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
