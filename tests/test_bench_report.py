"""The targets table of `bench.compare`: the verdicts a GPU round prints, read from the
figures as `bench.compare` writes them (`--json`), here made by hand.

A lent GPU runs for minutes: the encoder stages of `bench.gpu_round` (`encoders`,
`encoders-more`) must print each open target of the GPU issues with its verdict, or say
why it was not measured, for whichever rawserve servers they ran."""

from __future__ import annotations

import copy

import pytest

from bench import report

# the in-process ceiling of the BERT-base-sized classifier on an H200 (items/s by batch)
CEILING = {"1": 204.0, "4": 790.0, "16": 1569.0, "64": 4507.0, "256": 9008.0, "1024": 16382.0}
BATCH_ONE_MS = 4.9


def point(clients: int, throughput: float, p50: float, p99: float, slowest: float) -> dict:
    """One closed-loop point as `bench.load`'s summary (and `bench.compare`) writes it."""
    return {
        "mode": "closed",
        "clients": clients,
        "rate": None,
        "duration_s": 3.0,
        "requests": int(throughput * 3),
        "statuses": {"200": int(throughput * 3)},
        "throughput": throughput,
        "p50_ms": p50,
        "p90_ms": (p50 + p99) / 2,
        "p99_ms": p99,
        "max_ms": slowest,
        "client_cpu_share": 0.8,
        "idle_cores": 3.1,
    }


def overload(capacity: float, goodput: float, refused_p99: float) -> dict:
    """The open-loop run at 3× capacity, as `bench.compare.overload` writes it."""
    return {
        "mode": "open",
        "clients": None,
        "rate": 3 * capacity,
        "statuses": {"200": int(goodput * 4), "503": 20_000},
        "throughput": goodput,
        "p50_ms": 30.0,
        "p99_ms": 80.0,
        "goodput": goodput,
        "late_200": 0,
        "late_200_max_ms": 90.0,
        "503": {"p50_ms": 2.0, "p90_ms": 5.0, "p99_ms": refused_p99, "max_ms": 40.0},
        "dropped_by_client": 0,
        "capacity": capacity,
    }


def server(points: list[dict], overloaded: dict | None = None) -> dict:
    short: dict = {"points": points}
    if overloaded is not None:
        short["overload"] = overloaded
    return {"ready_seconds": 14.2, "text_sets": {"short": short}, "rss_bytes": 600 * 2**20}


def gpu_results(servers: dict, rawserve_args: tuple[str, ...] = ()) -> dict:
    """A `bench.compare --device cuda --scenarios bert-base-classification` run's JSON."""
    names = list(servers)
    return {
        "command": "python -m bench.compare --device cuda --quick ...",
        "machine": {"cores": 16, "device": "cuda", "gpu": "NVIDIA H200", "cuda": "13.0"},
        "settings": {
            "duration": 2.0,
            "saturation_duration": 3.0,
            "warmup": 1.0,
            "ceiling_seconds": 0.5,
            "overload_duration": 4.0,
            "client_counts": [1, 64, 256],
            "servers": names,
            "scenarios": ["bert-base-classification"],
            "rawserve_args": list(rawserve_args),
            "tools": False,
            "device": "cuda",
            "client_processes": 6,
        },
        "scenarios": [
            {
                "model": "bert-base-classification",
                "task": "text-classification",
                "outputs": "small",
                "ceiling": {
                    "short": {
                        "threads": 16,
                        "sample": 1024,
                        "device": "cuda",
                        "dtype": "float16",
                        "gpu": "NVIDIA H200",
                        "single_item_ms": {"p50": BATCH_ONE_MS, "mean": 5.1},
                        "forward/arrival": {
                            "curve": CEILING,
                            "best": CEILING["1024"],
                            "best_batch": 1024,
                        },
                        "pipeline/arrival": {
                            "curve": {"1": 167.0, "256": 5977.0},
                            "best": 5977.0,
                            "best_batch": 256,
                        },
                    }
                },
                "servers": servers,
            }
        ],
        "seconds": 120.0,
    }


# the `encoders` stage: rawserve with no options and with two torch threads
ENCODERS = {
    "rawserve-default": server(
        [
            point(1, 102.0, 9.9, 14.0, 20.0),
            point(64, 2947.0, 21.4, 40.1, 120.0),
            point(256, 6051.0, 41.5, 67.1, 150.0),
        ],
        overload(capacity=6051.0, goodput=11088.0, refused_p99=26.0),
    ),
    "rawserve-threads2": server(
        [
            point(1, 105.0, 5.5, 9.0, 12.0),
            point(64, 3397.0, 17.5, 34.9, 1500.0),
            point(256, 6723.0, 38.0, 52.9, 90.0),
        ],
        overload(capacity=6723.0, goodput=3000.0, refused_p99=8.0),
    ),
}
# the `encoders-more` stage: no CUDA graphs, lists of 32 texts, the seed's server
ENCODERS_MORE = {
    "rawserve-eager": server(
        [
            point(1, 123.0, 7.8, 11.0, 15.0),
            point(64, 3028.0, 20.7, 37.5, 80.0),
            point(256, 5508.0, 45.1, 72.2, 110.0),
        ],
        overload(capacity=5508.0, goodput=5200.0, refused_p99=34.5),
    ),
    "rawserve-lists": server(
        [
            point(1, 2944.0, 10.7, 15.0, 20.0),
            point(64, 13227.0, 163.0, 290.0, 400.0),
            point(256, 12448.0, 600.0, 900.0, 1200.0),
        ]
    ),
    "seed-batching": server(
        [
            point(1, 89.0, 10.7, 15.0, 20.0),
            point(64, 161.0, 267.0, 2783.0, 3100.0),
            point(256, 797.0, 160.0, 2579.0, 2900.0),
        ]
    ),
}
PREFIX = "bert-base-classification, "
VERDICT_OF_EACH_SINGLE_TEXT_SERVER = (
    "256 clients ≥ 0.7 × the ceiling at batch 256",
    "64 clients ≥ 3 × the seed's batching server",
    "256 clients ≥ 3 × the seed's batching server",
    "64 clients: p99 ≤ 3 × p50",
    "64 clients: no answer over 1000 ms",
    "1 client: p50 ≤ the ceiling's batch-1 time + 1 ms",
    "overload at 3× capacity: goodput ≥ 0.9 × capacity",
    "overload: 503 answered with p99 ≤ 10 ms",
)


def rows(table: str) -> dict[str, tuple[str, str]]:
    """The targets table as {target: (measured, met)}."""
    found = {}
    for line in table.splitlines()[2:]:
        target, measured, met = (cell.strip() for cell in line.strip("|").split(" | "))
        found[target] = (measured, met)
    return found


def test_the_encoders_stage_prints_every_gpu_target_for_both_servers():
    """Before, the GPU run's table was empty: it looked for the CPU's scenario and server."""
    found = rows(report.targets_table(gpu_results(ENCODERS)))
    for label in ("rawserve, no options", "rawserve, 2 torch threads"):
        for target in VERDICT_OF_EACH_SINGLE_TEXT_SERVER:
            assert f"{PREFIX}{label}, {target}" in found, (label, target)
    default = {t.removeprefix(f"{PREFIX}rawserve, no options, "): v for t, v in found.items()}
    assert default["256 clients ≥ 0.7 × the ceiling at batch 256"] == (
        "0.67 (6051 of 9008 items/s)",
        "**no**",
    )
    assert default["64 clients: p99 ≤ 3 × p50"] == ("1.9× (21.4 / 40.1 ms)", "yes")
    assert default["64 clients: no answer over 1000 ms"] == ("slowest 120.0 ms", "yes")
    assert default["1 client: p50 ≤ the ceiling's batch-1 time + 1 ms"] == (
        "9.90 ms vs 4.90 + 1 ms",
        "**no**",
    )
    assert default["overload at 3× capacity: goodput ≥ 0.9 × capacity"] == (
        "1.83 (11088 of 6051/s)",
        "yes",
    )
    assert default["overload: 503 answered with p99 ≤ 10 ms"] == (
        "26.0 ms (20000 answers)",
        "**no**",
    )
    threads = {t.removeprefix(f"{PREFIX}rawserve, 2 torch threads, "): v for t, v in found.items()}
    assert threads["256 clients ≥ 0.7 × the ceiling at batch 256"][1] == "yes"
    assert threads["64 clients: no answer over 1000 ms"] == ("slowest 1500.0 ms", "**no**")
    assert threads["1 client: p50 ≤ the ceiling's batch-1 time + 1 ms"][1] == "yes"
    assert threads["overload at 3× capacity: goodput ≥ 0.9 × capacity"][1] == "**no**"
    assert threads["overload: 503 answered with p99 ≤ 10 ms"] == ("8.0 ms (20000 answers)", "yes")


def test_what_the_stage_did_not_run_is_said_not_measured_and_why():
    found = rows(report.targets_table(gpu_results(ENCODERS)))
    seed = found[f"{PREFIX}rawserve, no options, 64 clients ≥ 3 × the seed's batching server"]
    assert seed == ("not measured: seed-batching did not run", "–")
    lists = found[
        f"{PREFIX}rawserve, lists of 32 texts: best point ≥ 0.9 × the ceiling at batch 256"
    ]
    assert lists == ("not measured: rawserve-lists did not run", "–")


def test_the_encoders_more_stage_judges_the_seed_and_the_lists():
    found = rows(report.targets_table(gpu_results(ENCODERS_MORE)))
    eager = f"{PREFIX}rawserve, no CUDA graphs, "
    assert found[f"{eager}64 clients ≥ 3 × the seed's batching server"] == (
        "18.81× (3028 vs 161/s)",
        "yes",
    )
    assert found[f"{eager}256 clients ≥ 3 × the seed's batching server"][1] == "yes"
    lists = found[
        f"{PREFIX}rawserve, lists of 32 texts: best point ≥ 0.9 × the ceiling at batch 256"
    ]
    assert lists == ("1.47 (13227 of 9008 items/s, 64 clients)", "yes")
    assert not any("seed, 1 ms batching" in target for target in found)  # not rawserve's


@pytest.mark.parametrize(
    ("change", "why"),
    [
        (lambda s: s.update({"rawserve-default": {"error": "RuntimeError('no GPU')"}}),
         "rawserve-default failed: RuntimeError('no GPU')"),
        (lambda s: s["rawserve-default"]["text_sets"]["short"]["points"].pop(),
         "rawserve-default ran no 256-client point (clients: 1, 64)"),
    ],
)  # fmt: skip
def test_a_server_without_a_figure_prints_its_rows_not_measured(change, why):
    servers = copy.deepcopy(ENCODERS)
    change(servers)
    found = rows(report.targets_table(gpu_results(servers)))
    target = f"{PREFIX}rawserve, no options, 256 clients ≥ 0.7 × the ceiling at batch 256"
    assert found[target] == (f"not measured: {why}", "–")


def test_a_run_without_overload_or_max_ms_says_so():
    servers = copy.deepcopy(ENCODERS)
    del servers["rawserve-default"]["text_sets"]["short"]["overload"]
    for each in servers["rawserve-default"]["text_sets"]["short"]["points"]:
        del each["max_ms"]  # a JSON from before the slowest answer was recorded
    results = gpu_results(servers)
    results["settings"]["overload_duration"] = 0.0
    found = rows(report.targets_table(results))
    where = f"{PREFIX}rawserve, no options, "
    assert found[f"{where}overload at 3× capacity: goodput ≥ 0.9 × capacity"] == (
        "not measured: the run was --no-overload",
        "–",
    )
    assert found[f"{where}64 clients: no answer over 1000 ms"][0].startswith("not measured: ")


def test_the_ceiling_is_read_at_the_batch_cap_the_run_gave_rawserve():
    found = rows(report.targets_table(gpu_results(ENCODERS, ("--max-batch-size", "64"))))
    target = f"{PREFIX}rawserve, no options, 256 clients ≥ 0.7 × the ceiling at batch 64"
    assert found[target] == ("1.34 (6051 of 4507 items/s)", "yes")


def test_every_server_of_a_gpu_run_has_a_column_in_the_ratio_table():
    header = report.ratio_table(gpu_results(ENCODERS)).splitlines()[0]
    assert "rawserve, no options" in header and "rawserve, 2 torch threads" in header


def test_a_cpu_run_keeps_its_2_core_rows():
    """The CPU's table is today's: its scenario and servers, no GPU rows."""
    results = gpu_results({"rawserve": server([point(64, 300.0, 100.0, 150.0, 200.0)], None)})
    results["settings"]["device"] = "cpu"
    results["scenarios"][0]["model"] = "classification"
    results["scenarios"][0]["ceiling"]["short"]["forward/arrival"]["best"] = 320.0
    found = rows(report.targets_table(results))
    assert found == {
        "saturation (classification, short, 64 clients) ≥ 0.90 × forward ceiling": (
            "0.94 (300 of 320 items/s)",
            "yes",
        )
    }
