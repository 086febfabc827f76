"""kill -9 and resume with ``features.cache: disk``, for real, on CPU (the train stage as a process).

A micro-derived spec (12 steps over 6 epochs, a checkpoint every 3, bf16 disk cache): env ->
warmup -> data once through Snakemake; then the train stage uninterrupted (reference), and the
same stage SIGKILLed right after its checkpoint at step 6 and started again. Written to
``bench/results/cpu/feature_cache_resume.json``: the resumed run's exactly-once record, its cache
counters (rows read from the cache the killed run left), whether the cache folder was deleted at
the end, and whether the final weights and optimizer state equal the reference's bit for bit.

    PYTHONPATH=$PWD python -m bench.feature_cache_resume_cpu [--base /tmp/fc-resume]
"""
from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from dflash.runtime import faults as fi

REPO = Path(__file__).resolve().parents[1]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", default="/tmp/fc-resume")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "cpu"))
    a = ap.parse_args(argv)
    shutil.rmtree(a.base, ignore_errors=True)
    spec = fi.derived_spec("cacheresume", 12, 3, keep=2, gen_batch_size=4)
    spec["features"] = {"cache": "disk", "dtype": "bfloat16"}
    w = fi.prepare(Path(a.base), spec)
    logs = Path(a.base) / "logs"
    logs.mkdir(exist_ok=True)
    ref_root = w.fresh_root("results_ref")
    assert w.start("train", ref_root, logs / "ref.log").wait() == 0
    root = w.fresh_root("results_kill")
    td = w.train_dir(root)
    run = w.start("train", root, logs / "killed.log")
    assert fi.wait_until(lambda: fi.newest_checkpoint(td) >= 6, run), run.text()[-3000:]
    run.kill()
    left = (td / "feature_cache").exists()
    run = w.start("train", root, logs / "resumed.log")
    assert run.wait() == 0, run.text()[-3000:]
    m = json.loads((td / "manifest.json").read_text())
    ref_w, ref_o = fi.final_tensors(w.train_dir(ref_root))
    got_w, got_o = fi.final_tensors(td)
    res = {"spec": spec, "killed_after_checkpoint": 6, "cache_left_by_the_kill": left,
           "resumed_from": m["steps"]["resumed_from"], "exactly_once": m["exactly_once"],
           "feature_cache": m["feature_cache"],
           "cache_deleted_at_the_end": not (td / "feature_cache").exists(),
           "weights_bit_identical": fi.tensors_equal(ref_w, got_w)[0],
           "optimizer_bit_identical": fi.tensors_equal(ref_o, got_o)[0]}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "feature_cache_resume.json").write_text(json.dumps(res, indent=1))
    print(json.dumps({k: v for k, v in res.items() if k != "spec"}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
