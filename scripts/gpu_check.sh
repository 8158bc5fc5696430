#!/usr/bin/env bash
# The GPU check: one short script for a lent CUDA machine (never part of CI).
#
# It installs attnplug and this repo's plugins from the working tree (no network
# needed: --no-deps --no-build-isolation, using the torch/triton/pytest already
# on the machine), then runs the conformance suite on the GPU for every backend
# available there, the issue-14 and issue-27 library cases (scripts/gpu_contract_cases.py), doctor, and the
# decode benchmark on CUDA. Kernel libraries
# that are not on the machine (flash-attn 3, flashinfer, aiter) are reported as
# unavailable with their reasons by `attnplug list`; carry their wheels in .whl/
# and they are installed first (the lent machine reaches no registry: e.g.
# `pip download --no-deps -d .whl flashinfer-python==0.7.4 sgl-kernel==0.3.21`).
#
# Usage (repo root):  bash scripts/gpu_check.sh [OUT_DIR]
set -uo pipefail
OUT="${1:-${OUT:-/tmp/attnplug-gpu}}"
mkdir -p "$OUT"
SITE=/tmp/attnplug-site
export PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1
PY=python3
if ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --target "$SITE" .whl/*.whl || exit 1
fi
pkgs=(. plugins/torch_native)
for p in plugins/*/; do [ "$p" = plugins/torch_native/ ] || pkgs+=("$p"); done
$PY -m pip install -q --no-deps --no-build-isolation --target "$SITE" "${pkgs[@]}" 2>&1 | tail -3
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" PATH="$SITE/bin:$PATH"

{
  nvidia-smi --query-gpu=name,compute_cap,driver_version --format=csv,noheader
  $PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
  $PY -m attnplug list
  $PY -m attnplug doctor
} 2>&1 | tee "$OUT/env.txt"

# issue-14 cases first (short): attention sinks per backend, MQA on trtllm_mha, fp8 KV and determinism
# on SM90; one PASS/FAIL/SKIP line each (SKIP names the reason: backend unavailable, layer refused, not SM90).
# issue-27 cases (issue27/...): flashinfer tensor-core decode on SM90 (fp8, determinism, GQA 8), a target-
# verify right after an extend on one flashinfer backend, a sink model on fa3 (refused and moved off SM90),
# and a real torch.cuda.graph capture of a decode with CPU-resident sinks per backend (plain control).
# Cases 3 and 4 bite with flashinfer 0.6.x only: carry that wheel for an SM90 run, e.g.
#   pip download --no-deps -d .whl flashinfer-python==0.6.3
# (the header line of contract_cases.txt prints the flashinfer version that ran).
timeout 300 $PY scripts/gpu_contract_cases.py --json "$OUT/contract_cases.json" \
  2>"$OUT/contract_cases.err" | tee "$OUT/contract_cases.txt"

# conformance on the GPU: every backend available here (cases run on CUDA when claimed)
timeout 420 $PY -m pytest --backend=all -q -p no:cacheprovider -x \
  --conformance-report="$OUT/conformance.json" 2>&1 | tail -40 | tee "$OUT/conformance.txt"

# benchmark on CUDA: decode and extend, fp16 and bf16, against the loop and the floor side by side
# (docs/performance.md, "GPU rows", is filled in from bench.txt / bench.json)
timeout 300 $PY -m attnplug bench --device cuda --backend all --mode decode,extend --dtype float16,bfloat16 \
  --batch 1,32 --context 1024,8192 --json "$OUT/bench.json" > "$OUT/bench.txt" 2>&1
tail -40 "$OUT/bench.txt"
echo "gpu_check done; results in $OUT"
