"""Infinity (`infinity-emb`, the embedding server people pick in Python), for the comparison.

Infinity pins transformers 4, so it lives in a virtual environment of its own, made here
on first use (`bench/.infinity-venv`, about 3 minutes; never by `make test`):

    python -m bench.infinity --setup      # make the environment and the ONNX folder

Two engines are compared, both on the packaged all-MiniLM-L6-v2, offline:
- `torch` (its default): sentence-transformers on PyTorch;
- `optimum` (ONNX Runtime): Infinity reads an ONNX file from the model folder; the packaged
  model ships none, so it is exported once with optimum's exporter (`optimum-cli export
  onnx`, in Infinity's environment) into a folder beside the sentence-transformers files.

Infinity 0.0.78's optimum engine does not start as pip installs it: with optimum 2 its
optimizer call fails (`OptimizationConfig` lost `optimize_with_onnxruntime_only`) and its
forward reads a `last_hidden_state` key optimum 2's outputs lack. Its environment is
therefore pinned to what it was written against: optimum 1.27 (the last 1.x), which
imports `optimum.bettertransformer` (transformers < 4.49) and a private function of
torch.onnx that torch 2.9 removed (torch 2.8), with numpy < 2, datasets < 4 and
pyarrow < 19 to match. A third snag: for a local folder it passes the ONNX file's
absolute path as a file name, which optimum compares with bare names and never finds,
so the server is started inside the folder with `--model-id .`. So set up, it starts and
answers, but its vectors are not the model's: cosine 0.24-0.51 against
sentence-transformers' own (its torch engine: 1.0), with or without its graph
optimizer, while the exported graph itself, run directly, gives the right vectors; its
throughput is reported, not taken as a like-for-like figure.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from bench import servers
from bench.models import minilm_path

BENCH_DIR = Path(__file__).resolve().parent
VENV = BENCH_DIR / ".infinity-venv"
ONNX_FOLDER = BENCH_DIR / ".infinity-minilm-onnx"
HF_HOME = BENCH_DIR / ".infinity-hf"  # its optimized-graph cache, away from the user's
# see the module docstring for each pin
PACKAGES = (
    "infinity-emb[server,torch]==0.0.78",
    "optimum[onnxruntime]==1.27.0",
    "transformers==4.48.3",
    "numpy<2",
    "datasets<4",
    "pyarrow<19",
)
TORCH = "torch==2.8.0"
ENGINES = ("torch", "optimum")
BATCH_SIZE = 64  # Infinity's largest batch (its default is 32): as rawserve's bench
SENTENCE_FILES = (
    "modules.json",
    "1_Pooling",
    "sentence_bert_config.json",
    "config_sentence_transformers.json",
)


def python() -> Path:
    return VENV / "bin" / "python"


def setup(log=print) -> None:
    """The environment (once), then the ONNX export of the packaged model (once)."""
    if not (VENV / ".installed").is_file():
        log(f"making Infinity's environment in {VENV} (a few minutes)")
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
        pip = [str(python()), "-m", "pip", "install", "--quiet"]
        subprocess.run([*pip, TORCH], check=True)
        subprocess.run([*pip, *PACKAGES], check=True)
        (VENV / ".installed").touch()
    if not (ONNX_FOLDER / "model.onnx").is_file():
        log(f"exporting the packaged MiniLM with optimum into {ONNX_FOLDER}")
        shutil.rmtree(ONNX_FOLDER, ignore_errors=True)
        subprocess.run(
            [
                str(VENV / "bin" / "optimum-cli"),
                "export",
                "onnx",
                "--model",
                minilm_path(),
                "--task",
                "feature-extraction",
                str(ONNX_FOLDER),
            ],
            check=True,
            env={**servers.base_env(), "HF_HOME": str(HF_HOME)},
            stdout=subprocess.DEVNULL,
        )
        source = Path(minilm_path())
        for name in SENTENCE_FILES:  # mean pooling and normalization, as the model says
            if (source / name).is_dir():
                shutil.copytree(source / name, ONNX_FOLDER / name, dirs_exist_ok=True)
            elif (source / name).is_file():
                shutil.copy(source / name, ONNX_FOLDER / name)


def server(engine: str, log_path: Path) -> servers.ServerProcess:
    """Infinity on the packaged MiniLM with `engine`, offline, on a free loopback port."""
    model, cwd = (minilm_path(), servers.REPO_ROOT)
    if engine == "optimum":
        model, cwd = ".", ONNX_FOLDER
    command = [
        str(VENV / "bin" / "infinity_emb"),
        "v2",
        "--model-id",
        model,
        "--served-model-name",
        "all-MiniLM-L6-v2",
        "--engine",
        engine,
        "--device",
        "cpu",
        "--batch-size",
        str(BATCH_SIZE),
        "--host",
        "127.0.0.1",
        "--no-vector-disk-cache",
        "--log-level",
        "warning",
    ]
    env = {
        **servers.base_env(),
        "HF_HOME": str(HF_HOME),
        "DO_NOT_TRACK": "1",
        "INFINITY_ANONYMOUS_USAGE_STATS": "0",
    }
    return servers.ServerProcess(f"infinity-{engine}", command, env, log_path, cwd=cwd)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.infinity", description=__doc__)
    parser.add_argument("--setup", action="store_true", help="make the environment and exports")
    args = parser.parse_args(argv)
    if not args.setup:  # (it did nothing and exited 0: read as a setup done)
        parser.error("nothing to do without --setup (bench.compare starts Infinity's servers)")
    setup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
