"""The decoders stage's batch sizes compiled in processes of their own (dflash/stages/decoders.py):
how many at once, and a real run of two spawned workers on the micro spec (CPU: the decoders
run eagerly there, so this checks the processes, not the kernels): every batch size's decoders
come back, in the sweep's order, whichever worker finished first; a worker that fails is
recorded, not raised."""
import json
import sys
from pathlib import Path

from dflash.runtime.resources import SHARE_AT_MOST
from dflash.spec.load import load_spec
from dflash.stages import StageContext
from dflash.stages.decoders import MAX_WORKERS, compile_in_parallel, worker_count

GB = 10**9
BATCHES = (1, 2, 3)


def test_as_many_processes_as_batch_sizes_that_fit_the_stages_share_of_the_device():
    h100, h200 = 85.5 * GB, 150 * GB  # nvidia-smi's memory.total, in bytes
    one = 7.62 * GB  # smollm2-quality's estimate for one process (dflash validate)
    assert worker_count((1, 4, 16, 64), one, h100) == int(SHARE_AT_MOST * h100 // one) == 3
    assert worker_count((1, 4, 16, 64), one, h200) == 4  # five fit: one per batch size
    assert worker_count(tuple(range(1, 9)), 1 * GB, h200) == MAX_WORKERS
    assert worker_count((1, 4), one, h200) == 2
    # one process larger than the share (the scheduler gave the stage the GPU whole), or no
    # estimate / no device memory known: one process, as before
    assert worker_count((1, 4, 16, 64), 40 * GB, h100) == 1
    assert worker_count((1, 4, 16, 64), None, h100) == worker_count((1, 4), one, None) == 1


def _two_workers(folder: str) -> None:
    """The background command: the micro spec's sweep of three batch sizes by two spawned
    workers (~30 s on 2 cores: each imports torch and loads the target); records to
    ``<folder>/parallel.json``."""
    spec = load_spec(Path(__file__).parent / "specs" / "micro.yaml").replace(
        bench={"eval_prompts": 3, "decode_batches": list(BATCHES), "eval_max_new_tokens": 4})
    ctx = StageContext(spec=spec, results=Path(folder) / "micro", env_fingerprint="0" * 16)
    rows, failed, peak = compile_in_parallel(ctx, 2)
    # and a sweep whose workers fail (no prompts to decode: micro's eval_prompts 0), one worker
    broken = StageContext(spec=spec.replace(bench={"eval_prompts": 0}),
                          results=Path(folder) / "broken", env_fingerprint="0" * 16)
    got = compile_in_parallel(broken, 1)
    Path(folder, "parallel.json").write_text(json.dumps(
        {"rows": rows, "failed": failed, "peak": peak, "broken": got}))


BACKGROUND_CMD = (lambda tmp: tmp, ["-m", "tests.test_decoders_parallel", "{folder}"])


def test_two_workers_compile_every_batch_size_and_the_records_keep_the_sweeps_order(
        background_cmd):
    folder, rc, out = background_cmd
    assert rc == 0, out[-3000:]
    got = json.loads((folder / "parallel.json").read_text())
    assert got["failed"] is None and got["peak"] == 0  # no CUDA device: no peak
    # whichever worker finishes first, the records are the sweep's: batch by batch, each
    # with target-only and the full block, HF static at batch 1
    assert [(r["batch"], r["decoder"]) for r in got["rows"]] == [
        (1, "target_only"), (1, "verify_4"), (1, "hf_static"),
        (2, "target_only"), (2, "verify_4"), (3, "target_only"), (3, "verify_4")]
    assert all(r["seconds"] > 0 for r in got["rows"])
    assert out.count("[decoders] batch ") == len(BATCHES)  # each worker's own log line


def test_a_worker_that_fails_is_recorded_with_its_traceback_not_raised(background_cmd):
    """Every batch size failed in its worker: no records, the first failure in one line naming
    the traceback file the stage writes (the bench then compiles those decoders itself)."""
    folder, rc, out = background_cmd
    assert rc == 0, out[-3000:]
    rows, failed, peak = json.loads((folder / "parallel.json").read_text())["broken"]
    assert rows == [] and peak == 0
    trace = folder / "broken" / "decoders" / "error.txt"
    assert failed == f"ValueError: max() arg is an empty sequence (traceback in {trace})"
    assert "Traceback" in trace.read_text() and "compile_batch" in trace.read_text()


if __name__ == "__main__":
    _two_workers(sys.argv[1])
