#!/usr/bin/env bash
# One short H200 call (≈4 min of work) for the two pieces of round 4 that need no SmolLM2
# weights, each alone on the GPU, each script saving its JSON after every arm so a cut keeps
# what it measured (bench/results/h200/COMMANDS.md, "Round 5"):
#   1. the decoder's compile scopes (fused = the default, regions = round 3's) on random
#      SmolLM2-135M-shaped target and 5-layer drafter: ms per one-token step and per verify +
#      draft step, which fix the 0.75 τ goal's ratio whatever the drafter's τ (issue #25);
#   2. the captured whole drafter step (graph, prodgraph) against today's compiled step at the
#      quality spec's shapes, random weights (issue #24).
# Carry .whl (jsonschema and its three dependencies: the image has the rest).
#   bash bench/gpu/short_call.sh            (on the device; DECODE_S, STEP_S bound each step)
set -uo pipefail
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 DFLASH_CACHE=/tmp/dflash-cache
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
  .whl/*.whl || exit 1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/gpu.txt"
git rev-parse HEAD >> "$OUT/gpu.txt" 2>/dev/null
timeout "${DECODE_S:-130}" python3 -W ignore -m bench.gpu.decode_speed --random \
  --drafter-layers 5 --batches 1,16 --hf-batches "" --compile-scopes fused,regions \
  --max-new 128 --no-simulated --budget-s $(( ${DECODE_S:-130} - 30 )) \
  --out "$OUT/decode_scopes_random.json" > "$OUT/decode_scopes_random.log" 2>&1
echo "decode rc=$?" >> "$OUT/gpu.txt"
timeout "${STEP_S:-85}" python3 -W ignore -m bench.gpu.loss_step --spec specs/smollm2-quality.yaml \
  --smollm2-shape --arms compiled,graph,prodgraph --caps 8 --iters 10 --steps 8 \
  --out "$OUT/loss_step3.json" > "$OUT/loss_step3.log" 2>&1
echo "loss_step rc=$?" >> "$OUT/gpu.txt"
tail -5 "$OUT"/*.log
