"""monitor.profile_steps: the threaded pipeline's steps under torch.profiler, summarised.

Real workers on CPU (a random-weight llama-micro target thread, two aot_eager drafter replicas
through the compile gate); on CPU the summary has CPU ops only, and must still be whole.
"""
from __future__ import annotations

import json
import random

import pytest

from dflash.models.drafter import DFlashConfig
from dflash.env.facts import hardware_facts
from dflash.runtime.harness import REPO

from dflash.eval.report import render_report_md
from dflash.spec.load import parse_spec
from dflash.train.packing import StepMap, bucket_for, pack_row, plan_epoch
from dflash.train.profile import OFFSET_STEPS, StepProfiler, window_for
from dflash.train.scheduler import Pipeline
from dflash.train.workers import buckets, initial_state, make_replicas, make_target_workers

SPEC = {
    "name": "prof", "seed": 0,
    "target": {"model": "llama-micro", "init": "random", "num_feature_layers": 2},
    "drafter": {"num_layers": 1, "block_size": 4, "mask_token_id": 4},
    "batching": {"token_budget": 128, "max_batch_size": 6, "max_anchors": 8, "num_buckets": 1},
    "loss": {"gamma": 4},
    "topology": {"targets": ["cpu"], "drafters": ["cpu", "cpu"]},
    "data": {"source": "chatterbot-corpus", "max_prompt_tokens": 32, "max_new_tokens": 32},
    "optim": {"lr": 1e-3, "max_steps": 10},
    "monitor": {"profile_steps": 2},
    "compile": {"backend": "aot_eager"},
    "env": {"lock": "envs/cpu-py311.lock"},
}


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread):
    """Three worker threads share 2 cores: one intra-op thread each."""


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    """One profiled pipeline run of 10 steps (the target, ahead by the queues, still works in
    the window): (summary, profile.json path, spec)."""
    spec = parse_spec(SPEC, "prof.yaml")
    rnd = random.Random(1)
    samples = []
    for sid in range(30):
        n = rnd.randint(12, 40)
        samples.append((sid, [rnd.randint(5, 40000) for _ in range(n)], [0] * 4 + [1] * (n - 4)))
    lengths = [len(s[1]) for s in samples]
    b, bks, cfg = spec.batching, buckets(spec), DFlashConfig.of_spec(spec)
    step_map = StepMap(lambda e: plan_epoch(lengths, b.token_budget, b.max_batch_size, 0, e), 2)
    total = spec.optim.max_steps
    prof = StepProfiler(spec.monitor.profile_steps, 0, total, spec.devices())
    pipe = Pipeline(target_workers=make_target_workers(spec),
                    replicas=make_replicas(spec, DFlashConfig.of_spec(spec), initial_state(cfg, 0),
                                           total),
                    step_map=step_map, start_step=0, total_steps=total, seed=0, queue_depth=1,
                    make_row=lambda batch: pack_row([samples[i] for i in batch], bucket_for(
                        sum(lengths[i] for i in batch), bks), 0), profiler=prof)
    pipe.run()
    path = tmp_path_factory.mktemp("prof") / "profile.json"
    return prof.write(path), path, spec


def test_window_is_past_the_first_steps_or_the_last_steps_of_a_short_run():
    assert window_for(0, 100, 5) == (OFFSET_STEPS, OFFSET_STEPS + 5)
    assert window_for(40, 100, 5) == (40 + OFFSET_STEPS, 45 + OFFSET_STEPS)
    assert window_for(0, 4, 2) == (2, 4)       # too short for the offset: the last 2 steps
    assert window_for(0, 1, 2) == (0, 1)       # shorter than the window: what there is


def test_cpu_profile_is_whole_and_attributes_work_to_every_worker(profiled):
    s, path, _ = profiled
    assert json.loads(path.read_text()) == json.loads(json.dumps(s))
    assert s["steps"] == 2 and s["first_step"] == OFFSET_STEPS and s["activities"] == ["cpu"]
    # no device: the kernel fields are there, and zero / empty
    d = s["device"]
    assert d["kernel_time_s"] == 0 and d["kernels_per_step"] == 0 and d["top_kernels"] == []
    assert set(d["kernel_time_s_by_class"]) >= {"gemm", "attention/flex", "reduction/softmax",
                                                "elementwise/fused triton", "memcpy/memset",
                                                "optimizer", "nccl", "other"}
    assert not any(d["kernel_time_s_by_class"].values()) and d["host_gaps"] == {}
    assert s["launches_per_step"] == {"kernel": 0, "graph": 0}
    assert s["syncs"]["cudaStreamSynchronize"]["count"] == 0
    assert s["allocator"]["calls"]["cudaMalloc"] == 0
    # CPU ops by class: the matmuls are there, and the classes add up to the top ops' scale
    cls = s["cpu"]["op_time_s_by_class"]
    assert cls["gemm"] > 0 and cls["optimizer"] > 0
    assert s["cpu"]["top_ops"] and all(r["time_s"] > 0 for r in s["cpu"]["top_ops"])
    w = s["workers"]
    for name in ("target-0", "drafter-0", "drafter-1"):
        assert w[name]["cpu_op_s"] > 0, name
        assert w[name]["busy_s_per_step"] > 0 and 0 < w[name]["busy_fraction"] <= 1
    # the drafters train (forward, backward, step): more op time than the frozen target's
    assert w["drafter-0"]["cpu_op_s"] > w["target-0"]["cpu_op_s"]


def test_report_renders_the_profile_table(profiled):
    s, _, _ = profiled
    md = render_report_md(_report(profile=s))
    assert "## Profile" in md and "2 steps from step 3" in md
    assert "| drafter-0 |" in md and "| target-0 |" in md
    assert "No profile" in render_report_md(_report(profile=None))


def _report(profile):
    """The committed H200 report, with this run's profile (or none) in it."""
    report = json.loads((REPO / "bench" / "results" / "h200" / "qwen3-8b-2gpu"
                         / "qwen3-8b-2gpu__bench__report.json").read_text())
    report.update(drafter_mfu_while_busy=None, final_draft_acc=None, balance={"skipped": "x"},
                  mfu_datasheet=None, env_drift_overridden=[],
                  hardware=hardware_facts(["cpu"], {}), profile=profile)
    return report
