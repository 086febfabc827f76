"""The threaded topology: exactly-once delivery, identical replicas, failure propagation.

Real workers: a frozen random-weight Llama target (llama-micro) per target thread, DFlash drafter
replicas compiled with aot_eager, all through the process-wide compile gate.
"""
from __future__ import annotations

import random
import threading
import time

import pytest
import torch

from dflash.models.drafter import DFlashConfig
from dflash.runtime.status import busy_fractions
from dflash.spec.load import parse_spec
from dflash.train.packing import bucket_for, pack_row, plan_epoch
from dflash.train.packing import StepMap
from dflash.train.scheduler import Pipeline, WorkerFailed
from dflash.train.stall import Stalled, StallWatch
from dflash.train.workers import buckets, initial_state, make_replicas, make_target_workers

SPEC = {
    "name": "sched", "seed": 0,
    "target": {"model": "llama-micro", "init": "random", "num_feature_layers": 2},
    "drafter": {"num_layers": 1, "block_size": 4, "mask_token_id": 4},
    "batching": {"token_budget": 128, "max_batch_size": 6, "max_anchors": 8, "num_buckets": 2},
    "loss": {"gamma": 4},
    "topology": {"targets": ["cpu", "cpu"], "drafters": ["cpu", "cpu", "cpu"]},
    "data": {"source": "chatterbot-corpus", "max_prompt_tokens": 32, "max_new_tokens": 32},
    "optim": {"lr": 1e-3, "epochs": 2},
    "compile": {"backend": "aot_eager"},
    "env": {"lock": "envs/cpu-py311.lock"},
}


def _dataset(n=23, seed=1):
    rnd = random.Random(seed)
    samples = []
    for sid in range(n):
        length = rnd.randint(12, 60)
        ids = [rnd.randint(5, 40000) for _ in range(length)]
        lm = [0] * (length // 3) + [1] * (length - length // 3)
        samples.append((1000 + sid, ids, lm))
    return samples


def _pipeline(spec, samples, total_epochs=2, fail_at=None, on_step=None, **kw):
    cfg = DFlashConfig.of_spec(spec)
    b = spec.batching
    bks = buckets(spec)
    lengths = [len(s[1]) for s in samples]
    step_map = StepMap(lambda e: plan_epoch(lengths, b.token_budget, b.max_batch_size,
                                            spec.seed, e), len(spec.topology.drafters))
    total = step_map.total_for_epochs(total_epochs)
    replicas = make_replicas(spec, cfg, initial_state(cfg, 0), total)

    def make_row(batch):
        return pack_row([samples[i] for i in batch],
                        bucket_for(sum(lengths[i] for i in batch), bks), 0)

    return Pipeline(target_workers=make_target_workers(spec), replicas=replicas,
                    step_map=step_map, make_row=make_row, start_step=0, total_steps=total,
                    seed=0, queue_depth=2, on_step=on_step,
                    fail_at=fail_at, stall_s=spec.monitor.stall_s, **kw), replicas, step_map


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread):
    """Three replicas and two targets share 2 cores: one intra-op thread each."""


def test_every_sample_exactly_once_per_epoch_and_replicas_identical():
    spec = parse_spec(SPEC, "sched.yaml")
    samples = _dataset()
    seen: dict[int, list[int]] = {}
    pipe, replicas, step_map = _pipeline(
        spec, samples, on_step=lambda r: seen.setdefault(r.epoch, []).extend(r.sample_ids))
    pipe.run()
    ids = sorted(s[0] for s in samples)
    assert sorted(seen) == [0, 1]
    for epoch, got in seen.items():
        assert sorted(got) == ids, f"epoch {epoch}: each sample exactly once"
    # three replicas, identical updates -> identical weights, and they did train
    ref = replicas[0].model.state_dict()
    init = initial_state(replicas[0].cfg, 0)
    assert any(not torch.equal(ref[k], init[k]) for k in ref)
    for rep in replicas[1:]:
        for k, v in rep.model.state_dict().items():
            assert torch.equal(v, ref[k]), k
    assert pipe.steps_done == pipe.total_steps


def test_distilling_pipeline_carries_soft_labels_to_the_replicas():
    """loss.kind ce+kd through the threaded pipeline: the target worker's TargetOutput (features
    + soft labels of the same forward) reaches each replica, every sample once, replicas equal."""
    spec = parse_spec({**SPEC, "loss": {"gamma": 4, "kind": "ce+kd", "kd_top_k": 4},
                       "topology": {"targets": ["cpu"], "drafters": ["cpu", "cpu"]},
                       "compile": {"backend": "eager"}},
                      "sched.yaml")
    samples = _dataset(n=9)
    recs = []
    pipe, replicas, _ = _pipeline(spec, samples, total_epochs=1, on_step=recs.append)
    pipe.run()
    assert sorted(i for r in recs for i in r.sample_ids) == sorted(s[0] for s in samples)
    assert all(r.loss == r.loss and r.loss > 0 for r in recs)   # finite, positive
    ref = replicas[0].model.state_dict()
    assert all(torch.equal(v, ref[k]) for k, v in replicas[1].model.state_dict().items())


def test_lagged_readout_books_the_same_steps_and_syncs_where_the_books_read_the_weights(
        monkeypatch):
    """dflash.train.readout: the books run one step late (the next step is already queued when
    a step is booked) except at the first, the last and the ``sync_at`` steps, where the weights
    the books see are that step's (the optimizer's step count says which); every figure equals
    the run that reads each step at once (DFLASH_STEP_READOUT=sync)."""
    spec = parse_spec({**SPEC, "topology": {"targets": ["cpu"], "drafters": ["cpu"]},
                       "compile": {"backend": "eager"}}, "sched.yaml")
    runs = {}
    for mode in ("sync", "lagged"):
        monkeypatch.setenv("DFLASH_STEP_READOUT", mode)
        recs, opt_steps = [], {}
        pipe, replicas, _ = _pipeline(spec, _dataset(), total_epochs=3, sync_at=lambda s: s == 2)

        def book(rec, rep=replicas[0]):
            recs.append(rec)
            st = rep.opt.state[rep.params[0]]
            opt_steps[rec.step] = int(st["step"])  # AdamW's count: steps the weights have taken

        pipe.on_step = book
        pipe.run()
        runs[mode] = (recs, opt_steps)
    (sync, sync_steps), (lagged, lag_steps) = runs["sync"], runs["lagged"]
    n = len(sync)
    assert n >= 5 and [r.step for r in lagged] == list(range(n))
    for a, b in zip(sync, lagged):
        assert (a.loss, a.grad_norm, a.sample_ids, a.draft_acc) == (b.loss, b.grad_norm,
                                                                  b.sample_ids, b.draft_acc)
    assert sync_steps == {s: s + 1 for s in range(n)}
    at_once = {0, 2, n - 1}  # the first, sync_at's, the last
    assert lag_steps == {s: s + 1 if s in at_once else s + 2 for s in range(n)}


def test_epochs_with_uneven_batch_counts_lose_nothing():
    """The packing is re-planned each epoch, so epochs can hold different numbers of batches."""
    spec = parse_spec(SPEC, "sched.yaml")
    lengths = [len(s[1]) for s in _dataset()]
    b = spec.batching
    sm = StepMap(lambda e: plan_epoch(lengths, b.token_budget, b.max_batch_size, 0, e), 3)
    for step in range(sm.total_for_epochs(4)):
        epoch, local = sm.locate(step)
        assert 0 <= local < sm.steps_in(epoch)
    covered = {e: set() for e in range(4)}
    for step in range(sm.total_for_epochs(4)):
        e, local = sm.locate(step)
        covered[e] |= {local * 3 + r for r in range(3)}
    for e in range(4):
        assert set(range(len(sm.batches(e)))) <= covered[e]


@pytest.mark.parametrize("where", ["drafter-1", "target-0"])
def test_worker_failure_stops_everything_and_names_the_worker(where):
    spec = parse_spec(SPEC, "sched.yaml")
    if where.startswith("target"):  # one target worker, so it is the one that sees step 2
        spec = spec.replace(topology={"targets": ["cpu"]})
    pipe, _, _ = _pipeline(spec, _dataset(), fail_at={where: 2})
    t0 = time.perf_counter()
    with pytest.raises(WorkerFailed) as e:
        pipe.run()
    assert time.perf_counter() - t0 < 10 + 30  # compile of the first steps + bounded shutdown
    assert f"worker {where} on cpu failed" in str(e.value)
    assert "injected failure" in str(e.value)
    assert pipe.stop.is_set()


def test_failure_ends_within_10s_once_running():
    """Measured from the failure, not from start (the first steps compile)."""
    spec = parse_spec(SPEC, "sched.yaml")
    marks = {}
    # 3 epochs: the 23 samples fill 6 rows per epoch = 2 steps of 3 replicas, so step 4 exists
    pipe, _, _ = _pipeline(spec, _dataset(), total_epochs=3, fail_at={"drafter-2": 4},
                           on_step=lambda r: marks.setdefault(r.step, time.perf_counter()))
    with pytest.raises(WorkerFailed):
        pipe.run()
    assert 3 in marks
    assert time.perf_counter() - marks[3] < 10


def test_busy_fractions_show_an_idling_worker():
    assert busy_fractions({"target-0": 3.0, "drafter-0": 1.0},
                          {"target-0": 0.0, "drafter-0": 3.0}) == {"drafter-0": 0.25,
                                                                    "target-0": 1.0}
    assert busy_fractions({"x": 0.0}, {}) == {"x": None}


def test_a_hung_worker_fails_the_run_with_every_threads_stack():
    """monitor.stall_s: a drafter thread that blocks forever after step 2 (here on an event, in
    the step's bookkeeping, where a hung checkpoint write or device sync would block) fails the
    run once no step completes for stall_s, naming the step and showing the blocked call."""
    spec = parse_spec({**SPEC, "topology": {"targets": ["cpu"], "drafters": ["cpu"]},
                       "compile": {"backend": "eager"}, "monitor": {"stall_s": 2}}, "sched.yaml")
    assert spec.monitor.stall_s == 2
    release = threading.Event()

    def hangs_after_step_2(rec):
        if rec.step == 2:
            release.wait()

    pipe, _, _ = _pipeline(spec, _dataset(), on_step=hangs_after_step_2)
    # once the watchdog stops the run, let the blocked thread go (a real hang stays blocked)
    threading.Thread(target=lambda: (pipe.stop.wait(), release.set()), daemon=True).start()
    t0 = time.perf_counter()
    with pytest.raises(WorkerFailed) as e:
        pipe.run()
    msg = str(e.value)
    assert time.perf_counter() - t0 < 2 + 15
    assert "worker watchdog" in msg and "Stalled" in msg
    assert "no train step completed in 2 s" in msg and "stuck after step 3 of" in msg
    assert "[drafter-0]" in msg and "hangs_after_step_2" in msg and "release.wait()" in msg
    assert "[target-0]" in msg and "[feeder]" in msg
    assert "still running" not in msg
    # step 2's books hung once step 3 was queued (they run one step late: dflash.train.readout);
    # step 3 completed, and the stopping run still booked it
    assert pipe.steps_done == 4


def test_stall_watch_restarts_its_clock_at_every_step():
    now = [0.0]
    w = StallWatch(10, clock=lambda: now[0])
    assert w.check(0, 5, [], {}) is None
    now[0] = 9.9
    assert w.check(0, 5, [], {}) is None
    now[0] = 15.0
    assert w.check(1, 5, [], {}) is None  # a step completed: the clock restarts here
    now[0] = 24.9
    assert w.check(1, 5, [], {}) is None
    now[0] = 25.0
    err = w.check(1, 5, [threading.Thread(name="drafter-0")], {})
    assert isinstance(err, Stalled) and "stuck after step 1 of 5" in str(err)
    assert "never finished a first step: drafter-0" in str(err)
    assert StallWatch(None, clock=lambda: now[0]).check(0, 5, [], {}) is None
    now[0] = 1e9
    assert StallWatch(None, clock=lambda: now[0]).check(0, 5, [], {}) is None
