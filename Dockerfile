# rawserve in a container: CPU by default, a CUDA build of torch with a build argument.
#
#   docker build -t rawserve .                                # CPU
#   docker build -t rawserve:cu128 --build-arg TORCH_VARIANT=cu128 .   # CUDA 12.8 torch
#   docker run -p 8000:8000 -v hf-cache:/cache rawserve --model BAAI/bge-small-en-v1.5
#   docker run --gpus all ... rawserve:cu128 --model ... --device cuda
#
# The install is the Makefile's own (`make .venv/.installed`): the same pinned torch and
# the same package as `make serve`, here without the test and dev extras (EXTRAS). A
# CUDA build of torch carries its CUDA libraries, so the slim base serves both; the host
# needs the NVIDIA driver and container toolkit. Models downloaded from the Hub are kept
# in the /cache volume (HF_HOME), so a restarted container does not download them again;
# so are the first start's trial verdicts and ONNX exports (RAWSERVE_CACHE_DIR), so it does
# not measure and export again either. With a read-only root (`--read-only`), /tmp must be
# writable too (`--tmpfs /tmp`): torch makes its compiler's cache folder there on import.
# Options are flags after the image name or RAWSERVE_* variables (`-e RAWSERVE_MODEL=...`).
# `docker stop` kills after 10 s, before a drain of --grace (30 s) ends: run with
# `--stop-timeout 40`.
# No Docker daemon was available where this file was written: it is checked statically
# (tests/test_dockerfile.py), not built there.

ARG PYTHON_VERSION=3.11
FROM python:${PYTHON_VERSION}-slim

# cpu, or a CUDA variant of the PyTorch wheel index (cu126, cu128, ...)
ARG TORCH_VARIANT=cpu
ARG TORCH_SPEC=torch==2.13.0
# The Makefile's extras less test and dev: onnx (ONNX Runtime, for --engine onnx and
# auto's choice on a CPU); image (Pillow, for image-classification models, which the
# Makefile gets through test)
ARG EXTRAS=onnx,image

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    PATH=/app/.venv/bin:$PATH \
    HF_HOME=/cache/huggingface \
    RAWSERVE_CACHE_DIR=/cache/rawserve \
    RAWSERVE_HOST=0.0.0.0

# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends make \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --uid 10001 --create-home --shell /usr/sbin/nologin rawserve \
    && mkdir -p /cache/huggingface \
    && chown -R 10001:10001 /cache

WORKDIR /app
# The dependencies first (torch is the big layer): a change to the code alone reuses it.
COPY Makefile pyproject.toml README.md constraints.txt ./
COPY rawserve/__init__.py rawserve/__init__.py
RUN make .venv/.installed \
        TORCH_SPEC="${TORCH_SPEC}" \
        PIP_TORCH_ARGS="--index-url=https://download.pytorch.org/whl/${TORCH_VARIANT}" \
        EXTRAS="${EXTRAS}"
COPY rawserve rawserve
RUN /app/.venv/bin/python -m compileall -q rawserve

USER 10001
VOLUME ["/cache"]
# --port's default; `serve` (SageMaker's command) listens on 8080 instead (no
# RAWSERVE_PORT is set here: it would win over SageMaker's port)
EXPOSE 8000
# /health is liveness: 200 while the server can serve or recover (also while the model
# loads); a first start may download the model before it listens, hence the long start.
# It reads the port and TLS as the server did (rawserve.ops.health_probe: the arguments
# after the image's name, then the RAWSERVE_* variables): a TLS port closes plain HTTP at
# once, so over TLS it asks in TLS. It
# ignores HTTP_PROXY and the like (set where the Hub is reached through a proxy): the
# proxy cannot reach the container's own loopback, and the check failed through it.
HEALTHCHECK --interval=15s --timeout=5s --start-period=600s --retries=3 \
    CMD ["/app/.venv/bin/python", "-m", "rawserve.ops.health_probe"]
ENTRYPOINT ["/app/.venv/bin/python", "-m", "rawserve"]
