"""monitor.profile_steps: the threaded pipeline's steps under torch.profiler, summarised.

Real workers on CPU (a random-weight llama-micro target thread, two aot_eager drafter replicas
through the compile gate); on CPU the summary has CPU ops only, and must still be whole.
"""
from __future__ import annotations

import gzip
import json
import random

import pytest
import torch

from dflash.models.drafter import DFlashConfig
from dflash.env.facts import hardware_facts
from dflash.runtime.harness import REPO

from dflash.eval.report import render_report_md
from dflash.spec.load import load_spec, parse_spec
from dflash.spec.sweeps import load_sweep
from dflash.train.packing import StepMap, bucket_for, pack_row, plan_epoch
from dflash.train.profile import (LABEL, OFFSET_STEPS, Ev, StepProfiler, events_of, is_label,
                                  summarise, window_for)
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
    # where the window sat: steps 3..4, in epoch 1 (30 samples of ~26 tokens, 128-token rows,
    # two replicas: 3 steps an epoch); no feature cache in this run
    assert s["last_step"] == OFFSET_STEPS + 1 and s["epochs"] == [1, 1]
    assert s["feature_cache_rows_read"] is None
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


def test_cpu_totals_fit_the_window_and_no_label_counts_as_an_op_or_kernel(profiled):
    s, _, _ = profiled
    wall = s["wall_s"]
    assert 0 < wall < 60
    # self times: never negative, and one thread's ops cannot outlast the window
    cls = s["cpu"]["op_time_s_by_class"]
    assert all(t >= 0 for t in cls.values()), cls
    for name, row in s["workers"].items():
        assert 0 <= row["cpu_op_s"] <= wall, name
    assert sum(cls.values()) <= wall * len(s["workers"])
    assert sum(r["cpu_op_s"] for r in s["workers"].values()) == pytest.approx(sum(cls.values()))
    names = [r["name"] for r in s["cpu"]["top_ops"] + s["device"]["top_kernels"]]
    assert names and not any(n.startswith(LABEL) for n in names), names


def _ev(name, kind, t0, t1, corr=0, linked=0, thread=0, device=True, stream=None, os=None):
    """µs times; a device event on stream 7, a host event on OS thread ``os`` (default: a
    stand-in, 400 + torch's thread id), kineto's resource id for both."""
    res = stream if device else os
    res = (7 if device else 400 + thread) if res is None else res
    return Ev(name, kind, device, t0 * 1000, t1 * 1000, thread, corr, linked, 0, res)


def _lease_shaped_events():
    """One step as the committed H200 profile (round 6, ``lease/profile.json``) shows it, in
    µs: the drafter's captured step replayed by one cudaGraphLaunch on its thread (11), the
    compiled target's kernels launched through the driver API (no host record) on its thread
    (12), each worker's label on the host and as a device span, one aten op's kernel, and a
    kernel of no worker after every span."""
    drafter, target = LABEL + "drafter-0", LABEL + "target-0"
    return [
        _ev(target, "user_annotation", 0, 12, thread=12, device=False),
        _ev(drafter, "user_annotation", 5, 80, thread=11, device=False),
        _ev("cudaGraphLaunch", "cuda_runtime", 20, 25, corr=900, thread=11, device=False),
        _ev("aten::add", "cpu_op", 26, 30, corr=41, thread=11, device=False),
        _ev("cudaLaunchKernel", "cuda_runtime", 27, 29, corr=901, thread=11, device=False),
        _ev(target, "gpu_user_annotation", 1, 11),
        _ev("triton_poi_fused_mask_0", "kernel", 1, 11),                  # target, by its span
        _ev(drafter, "gpu_user_annotation", 20, 70),
        _ev("triton_tem_fused_flex_attention_3", "kernel", 20, 40, corr=900),  # graph replay
        _ev("nvjet_sm90_tst_192x192_TNN", "kernel", 42, 60, corr=900),         # graph replay
        _ev("vectorized_elementwise_kernel", "kernel", 62, 70, corr=901, linked=41),
        _ev("Memcpy DtoH (Device -> Pinned)", "gpu_memcpy", 90, 91),            # no worker
    ]


def test_device_spans_are_no_kernels_and_every_kernel_has_its_worker():
    s = summarise(_lease_shaped_events(), 1, 3, ["cpu", "cuda"], {}, {}, 1e-4)
    d = s["device"]
    # kernels only: 10 + 20 + 18 + 8 + 1 µs, not the spans' 10 + 50 µs on top
    assert d["kernel_time_s"] == pytest.approx(57e-6)
    assert d["label_spans_s_not_counted"] == pytest.approx(60e-6)
    assert sum(d["kernel_time_s_by_class"].values()) == pytest.approx(d["kernel_time_s"])
    assert d["kernels_per_step"] == 5
    assert not any(r["name"].startswith(LABEL) for r in d["top_kernels"])
    # idle 9 + 2 + 2 + 20 µs between kernels of a 90 µs window: the spans do not hide it
    g = d["host_gaps"]["cuda:0"]
    assert g["span_s"] == pytest.approx(90e-6) and g["busy_s"] == pytest.approx(57e-6)
    assert g["idle_s"] == pytest.approx(33e-6) and g["gaps_over_10us"] == 1
    w = s["workers"]
    assert w["drafter-0"]["kernel_s"] == pytest.approx(46e-6)
    assert w["drafter-0"]["graph_replay_kernel_s"] == pytest.approx(38e-6)
    assert w["drafter-0"]["device_span_s"] == pytest.approx(50e-6)
    assert w["target-0"]["kernel_s"] == pytest.approx(10e-6)
    assert w["other"]["kernel_s"] == pytest.approx(1e-6)
    assert sum(r["kernel_s"] for r in w.values()) == pytest.approx(d["kernel_time_s"])
    src = {r["name"]: r["source"] for r in d["top_kernels"]}
    assert src == {"triton_tem_fused_flex_attention_3": "drafter-0: graph replay",
                   "nvjet_sm90_tst_192x192_TNN": "drafter-0: graph replay",
                   "triton_poi_fused_mask_0": "target-0: device span",
                   "vectorized_elementwise_kernel": "drafter-0: aten::add",
                   "Memcpy DtoH (Device -> Pinned)": "other: unattributed"}
    assert s["launches_per_step"] == {"kernel": 1, "graph": 1}
    assert s["syncs"]["memcpy_d2h"]["count"] == 1
    # host side: the labels are ranges, not ops; the graph launch is runtime time
    assert set(s["cpu"]["op_time_s_by_class"]) == {"cuda runtime", "elementwise/fused triton"}
    assert s["cpu"]["op_time_s_by_class"]["elementwise/fused triton"] == pytest.approx(2e-6)


def _round8_shaped_events(os_ids=True):
    """One step of round 8's shared GPU (``lease/profile.json``), as torch records it
    (bench/results/h200/round8-2026-12-02/profile_threads.log), in µs: the target (torch thread
    12, OS thread 491) copies its row in (an aten op: its runtime call is on its thread) and
    replays its captured forward, the drafter (11, OS 490) replays its captured step; both
    cudaGraphLaunch calls ran inside no torch op, so torch gives both the thread that stopped
    the profiler (11, replica 0's) and only the resource id tells the target's apart.
    ``os_ids=False``: a torch that recorded no resource ids (0)."""
    drafter, target = LABEL + "drafter-0", LABEL + "target-0"
    host = (lambda t: dict(os=t)) if os_ids else (lambda t: dict(os=0))
    return [
        _ev(target, "user_annotation", 0, 40, thread=12, device=False, **host(491)),
        _ev("aten::copy_", "cpu_op", 1, 4, corr=61, thread=12, device=False, **host(491)),
        _ev("cudaMemcpyAsync", "cuda_runtime", 2, 3, corr=700, thread=12, device=False,
            **host(491)),
        _ev("cudaGraphLaunch", "cuda_runtime", 5, 9, corr=800, thread=11, device=False,
            **host(491)),
        _ev(drafter, "user_annotation", 30, 120, thread=11, device=False, **host(490)),
        _ev("cudaGraphLaunch", "cuda_runtime", 41, 45, corr=900, thread=11, device=False,
            **host(490)),
        _ev("Memcpy HtoD (Pinned -> Device)", "gpu_memcpy", 3, 4, corr=700, linked=61),
        _ev(target, "gpu_user_annotation", 3, 40),
        _ev("triton_tem_fused_flex_attention_0", "kernel", 10, 30, corr=800),  # the target's
        _ev("nvjet_sm90_tst_192x192_TNN", "kernel", 30, 40, corr=800),
        _ev(drafter, "gpu_user_annotation", 45, 110),
        _ev("triton_tem_fused_flex_attention_backward_6", "kernel", 45, 95, corr=900),
        _ev("nvjet_sm90_tst_192x192_TNN", "kernel", 95, 110, corr=900),
    ]


def test_a_graph_replay_counts_for_the_thread_that_launched_it():
    """Round 8's bug: the target's graph replay counted as drafter-0's (2 graph launches a step
    on drafter-0, 0 on target-0). By the launch call's OS thread each worker gets its own."""
    s = summarise(_round8_shaped_events(), 1, 3, ["cpu", "cuda"], {}, {}, 2e-4)
    w = s["workers"]
    assert w["target-0"]["graph_launches"] == 1 and w["drafter-0"]["graph_launches"] == 1
    assert w["target-0"]["kernel_launches"] == 0 == w["drafter-0"]["kernel_launches"]
    # the target: its 30 µs replay and its 1 µs row copy; the drafter: its 65 µs replay
    assert w["target-0"]["graph_replay_kernel_s"] == pytest.approx(30e-6)
    assert w["target-0"]["kernel_s"] == pytest.approx(31e-6)
    assert w["drafter-0"]["graph_replay_kernel_s"] == pytest.approx(65e-6)
    assert w["drafter-0"]["kernel_s"] == pytest.approx(65e-6)
    assert sum(r["kernel_s"] for r in w.values()) == pytest.approx(s["device"]["kernel_time_s"])
    # host time too: the target's launch call (4 µs) is its thread's, not the drafter's
    assert w["target-0"]["cpu_op_s"] == pytest.approx((2 + 1 + 4) * 1e-6)  # copy_ self: 3 - 1
    assert w["drafter-0"]["cpu_op_s"] == pytest.approx(4e-6)
    assert s["cpu"]["runtime_calls_rethreaded"] == 1
    src = {r["name"]: r["sources"] for r in s["device"]["top_kernels"]}
    assert src["triton_tem_fused_flex_attention_0"] == {"target-0: graph replay": 20e-6}
    assert src["nvjet_sm90_tst_192x192_TNN"] == {"drafter-0: graph replay": 15e-6,
                                                 "target-0: graph replay": 10e-6}
    assert src["Memcpy HtoD (Pinned -> Device)"] == {"target-0: aten::copy_": 1e-6}


def test_without_resource_ids_a_runtime_call_keeps_torch_s_thread():
    """No OS thread to go by (resource id 0): torch's thread stands, as before the fix (both
    replays on drafter-0, nothing moved), and the linked copy still finds its op's worker."""
    s = summarise(_round8_shaped_events(os_ids=False), 1, 3, ["cpu", "cuda"], {}, {}, 2e-4)
    w = s["workers"]
    assert w["drafter-0"]["graph_launches"] == 2 and w["target-0"]["graph_launches"] == 0
    assert w["drafter-0"]["graph_replay_kernel_s"] == pytest.approx(95e-6)
    assert w["target-0"]["kernel_s"] == pytest.approx(1e-6)
    assert s["cpu"]["runtime_calls_rethreaded"] == 0


def test_the_committed_h200_profile_still_renders():
    """The round-6 summary (written before the spans were told from kernels) renders."""
    old = json.loads((REPO / "bench" / "results" / "h200" / "round6-2026-12-01" / "lease"
                      / "profile.json").read_text())
    md = render_report_md(_report(profile=old))
    assert "20 steps from step 3" in md and "| drafter-0 |" in md


def test_report_renders_the_profile_table(profiled):
    s, _, _ = profiled
    md = render_report_md(_report(profile=s))
    assert "## Profile" in md and "2 steps from step 3 (epoch 1)" in md
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


def test_events_of_reads_an_older_torch_s_events():
    """torch 2.11's kineto events lack ``activity_type`` (the H200 image's torch: the round-7
    profile died on it); the reader then gives kind '' and zeros for the missing links."""
    class OldKinetoEvent:  # the accessors torch 2.11's _KinetoEvent has
        def __init__(self, name, device):
            self._n, self._d = name, device

        def name(self): return self._n
        def device_type(self): return self._d
        def start_ns(self): return 10
        def end_ns(self): return 30
        def start_thread_id(self): return 7
        def correlation_id(self): return 3
        def device_index(self): return 0

    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    evs = events_of([OldKinetoEvent("dflash.worker/drafter-0", cpu),
                     OldKinetoEvent("void gemm_kernel", cuda)])
    assert [(e.name, e.kind, e.device, e.linked, e.stream) for e in evs] == [
        ("dflash.worker/drafter-0", "", False, 0, 0), ("void gemm_kernel", "", True, 0, 0)]
    assert is_label(evs[0]) and not is_label(evs[1])


@pytest.mark.parametrize("name", ["smollm2-quality-profile", "smollm2-quality-profile-cached"])
def test_profile_specs_share_env_warmup_and_data_with_smollm2_quality(name):
    """The profiling specs run the DAG's own step: the same env, warm-up and data (one shared
    job each), the feature cache on as in smollm2-quality; the cached one's window sits in
    epoch 1 (epoch 0 of smollm2-quality's 30.6K prompts: steps 0..1941, round 14's metrics of
    the prompts15x arm, which trained exactly as smollm2-quality does since)."""
    quality = load_spec(REPO / "specs" / "smollm2-quality.yaml")
    spec = load_spec(REPO / "specs" / f"{name}.yaml")
    for stage in ("env", "warmup", "data"):
        assert spec.fingerprint(stage) == quality.fingerprint(stage), stage
    assert spec.features == quality.features and spec.features.cache == "host"
    assert spec.fingerprint("train") != quality.fingerprint("train")
    m, total = spec.monitor, spec.optim.max_steps
    first, end = window_for(0, total, m.profile_steps, m.profile_start)
    if name.endswith("cached"):
        path = (REPO / "bench" / "results" / "h200" / "round14-2026-12-03" / "lease" / "r"
                / "smollm2-recipe-prompts15x__train__metrics.jsonl.gz")
        metrics = gzip.decompress(path.read_bytes()).decode().splitlines()
        epoch1 = min(r["step"] for r in map(json.loads, metrics) if r["epoch"] == 1)
        assert epoch1 == 1942 and epoch1 < first and end == first + 20 < total
    else:
        assert (first, end) == (OFFSET_STEPS, OFFSET_STEPS + 20)


def test_profile_start_moves_the_window_and_the_train_fingerprint_only_when_profiling():
    """profile_start opens the window at that global step (a resumed run still 3 past its own
    start); it is no part of the train fingerprint while profile_steps is 0, nor at its default."""
    assert window_for(0, 100, 5, at=50) == (50, 55)
    assert window_for(60, 100, 5, at=50) == (63, 68)      # resumed past it: 3 past its start
    assert window_for(0, 100, 5, at=98) == (95, 100)      # too late: the run's last 5 steps
    base = parse_spec(SPEC, "prof.yaml")
    off = {**SPEC, "monitor": {"profile_steps": 0}}

    def fp(monitor):
        return parse_spec({**SPEC, "monitor": monitor}, "prof.yaml").fingerprint("train")
    assert fp({"profile_steps": 0, "profile_start": 1315}) == parse_spec(off, "x.yaml"
                                                                         ).fingerprint("train")
    assert fp({"profile_steps": 2, "profile_start": 3}) == base.fingerprint("train")
    assert fp({"profile_steps": 2, "profile_start": 7}) != base.fingerprint("train")


def test_the_uncapped_profile_shares_its_warmup_with_the_uncapped_arm_not_with_the_base():
    """The supervised-position cap changes the compiled step's shapes (the head and loss on 8
    rows a block, not 15): the recipe's default (8, since round 10) is in its warm-up's
    fingerprint; the uncapped profile and the recipe sweep's uncapped arm share one warm-up of
    their own; env and data stay smollm2-quality's."""
    quality = load_spec(REPO / "specs" / "smollm2-quality.yaml")
    uncapped = load_spec(REPO / "specs" / "smollm2-quality-profile-cached-uncapped.yaml")
    capped = load_spec(REPO / "specs" / "smollm2-quality-profile-cached.yaml")
    arm = next(a.spec for a in load_sweep(REPO / "sweeps" / "smollm2-recipe.yaml").arms
               if a.name == "smollm2-recipe-uncapped")
    assert quality.loss.max_position == capped.loss.max_position == 8
    assert uncapped.loss.max_position is arm.loss.max_position is None
    for stage in ("env", "data"):
        assert uncapped.fingerprint(stage) == quality.fingerprint(stage) == arm.fingerprint(stage)
    assert uncapped.fingerprint("warmup") == arm.fingerprint("warmup") != quality.fingerprint("warmup")
    assert capped.fingerprint("warmup") == quality.fingerprint("warmup")
    assert quality.section("warmup")["loss.max_position"] == 8
    assert "loss.max_position" not in uncapped.section("warmup")
