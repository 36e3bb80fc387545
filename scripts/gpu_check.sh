#!/usr/bin/env bash
# Issue 53's GPU checks in one run of under 8 minutes (limits 40+60+90+120+150 s) (each part has its own time limit, so a
# stuck part costs only its share). Writes everything under $OUT (default ./gpu-check-out):
#   tests.txt        tests/test_gpu.py (the sync-debug forward among them)
#   llama-1b.json    random-weight Llama-1B shape, bf16: TTFT full/prefix/cachecraft of 5 x
#   llama-8b.json    1,000-token chunks all hit (with host overhead), an all-miss request,
#                    the decode step at B=32 (lab/cachecraft_bench/gpu_check.py)
#   serve.json       bench serve --device cuda --shape llama-1b --peer none (synthetic workload)
#   *.err            each part's stderr; times.txt: each part's exit code and seconds
# Needs: a CUDA torch, this repository, and the bundled model (its tokenizer: `make setup`).
#   OUT=/tmp/out scripts/gpu_check.sh      (PYTHON=... to pick the interpreter)
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-check-out}
PY=${PYTHON:-python}
mkdir -p "$OUT"
export PYTHONPATH="$PWD:$PWD/lab${PYTHONPATH:+:$PYTHONPATH}"

part() {  # part NAME LIMIT_S COMMAND...: run it under its limit, note code and seconds
  local name=$1 limit=$2
  shift 2
  local t0=$SECONDS
  timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.out" 2>"$OUT/$name.err"
  echo "$name exit=$? seconds=$((SECONDS - t0))" | tee -a "$OUT/times.txt"
}

nvidia-smi >"$OUT/nvidia-smi.txt" 2>&1
"$PY" -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name())" \
  >"$OUT/torch.txt" 2>&1
# the bundled tokenizer, converted once (every shape uses it)
part tokenizer 40 "$PY" -c "from cachecraft.model.loader import resolve_model_dir as r; print(r(None))"
part tests 60 "$PY" -m pytest tests/test_gpu.py -q -x -p no:cacheprovider
part llama-1b 90 "$PY" -m cachecraft_bench.gpu_check --shape llama-1b --device cuda \
  --dtype bfloat16 --repeats 5 --out "$OUT"
part llama-8b 120 "$PY" -m cachecraft_bench.gpu_check --shape llama-8b --device cuda \
  --dtype bfloat16 --repeats 5 --out "$OUT"
part serve 150 "$PY" -m cachecraft.cli bench serve --device cuda --shape llama-1b --peer none \
  --dtype bfloat16 --workload synthetic --modes prefix,cachecraft --rates 2,4 --max-runs 6 \
  --requests 16 --bursts 1 --refine 1 --warmup 4 --json
cp "$OUT/serve.out" "$OUT/serve.json" 2>/dev/null
cat "$OUT/times.txt"
