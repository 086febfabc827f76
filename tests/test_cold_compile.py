"""bench/gpu/cold_compile.py, the cold-compile probe of the compiled target (issue 24): its CPU
--smoke path end to end (one subprocess per arm, fresh caches, the artifacts hand-off) and the
folding of torch's nested compile timers into phases."""
from __future__ import annotations

import json

import pytest

from bench.gpu import cold_compile, cold_probe


def test_phases_fold_torchs_nested_timers_into_exclusive_parts():
    cc = cold_probe
    keys = {"_compile.compile_inner": 10.0, "OutputGraph.call_user_compiler": 8.0,
            "compile_fx_inner": 6.0, "GraphLowering.run": 1.0,
            "GraphLowering.compile_to_module": 4.5, "async_compile.wait": 3.0,
            "flex_attention_template_autotuning": 0.5, "CachingAutotuner.benchmark_all_configs":
            0.25}
    ph = cc.phases(keys, call_s=12.0)
    assert ph["dynamo_trace_s"] == 2.0 and ph["aot_autograd_s"] == 2.0
    assert ph["inductor_total_s"] == 6.0 and ph["inductor_lowering_s"] == 1.0
    assert ph["triton_compile_wait_s"] == 3.0 and ph["compile_time_autotune_s"] == 0.5
    assert ph["runtime_autotune_s"] == 0.25 and ph["outside_compile_s"] == 2.0
    # a cache hit: AOTAutograd loads the compiled graph and inductor never runs
    hit = cc.phases({"_compile.compile_inner": 3.0, "OutputGraph.call_user_compiler": 2.5,
                     "AOTAutogradCache.inductor_load": 2.0}, call_s=3.0)
    assert hit["cache_load_s"] == 2.0 and hit["aot_autograd_s"] == 0.5
    assert hit["inductor_total_s"] == 0.0


def test_unknown_arm_is_one_clear_error(capsys):
    with pytest.raises(SystemExit):
        cold_compile.main(["--smoke", "--arms", "today,nope", "--out", "/tmp/x.json"])
    assert "--arms: unknown ['nope']" in capsys.readouterr().err


# the smoke run (~20 s on 2 cores) runs in the background lane with the session (tests/conftest.py)
BACKGROUND_CMD = (lambda tmp: tmp, ["-m", "bench.gpu.cold_compile", "--smoke", "--arms", "megacache",
                                    "--parallel", "2", "--out", "{folder}/cold.json"])


def test_smoke_runs_each_arm_cold_in_its_own_process(background_cmd):
    folder, rc, log = background_cmd
    assert rc == 0, log[-3000:]
    doc = json.loads((folder / "cold.json").read_text())
    assert doc["command"].startswith("python3 -m bench.gpu.cold_compile --smoke")
    # megacache loads the 'today' arm's artifacts: the producer is added and runs first
    assert doc["arms_requested"] == ["today", "megacache"]
    arms = doc["arms"]
    caches = {arms[n]["env"]["TORCHINDUCTOR_CACHE_DIR"] for n in arms}
    assert len(caches) == 2 and all(c.startswith("/tmp/cold-") for c in caches)  # not shared
    for n, r in arms.items():
        assert r["rc"] == 0, r.get("log_tail")
        first = r["layers_first"]
        # a cold first call compiles the ONE layer graph; the warm-up's settle call does not
        assert first["new_graphs"] == 1 and r["settle"]["new_graphs"] == 0
        assert first["phases"]["frame_compile_s"] > 0
        assert first["phases"]["dynamo_trace_s"] > 0
        assert first["seconds"] >= first["phases"]["frame_compile_s"]
        assert [g["co_name"] for g in r["graphs"]] == ["packed_layer"]
        assert r["steady"]["forward_ms"] > 0 and r["steady"]["layers"] == 2
        assert 0 < r["child_s"] < r["wall_s"]
        assert r["first_call_s"] == pytest.approx(r["mask_first"]["seconds"] + first["seconds"],
                                                  abs=2e-3)
    assert arms["today"]["env"]["DFLASH_FLEX_KERNEL_OPTIONS"] is None  # today: the default
    assert "artifacts_saved" in arms["today"] and "artifacts_loaded" in arms["megacache"]
    assert arms["megacache"]["start_unix"] >= arms["today"]["end_unix"]  # waited for its blob
    assert arms["today"]["ran_with"] == []  # a consumer never overlaps its producer
    summ = doc["summary"]
    assert summ["goal_s"] == 90.0 and set(summ["arms"]) == {"today", "megacache"}
    assert summ["arms"]["today"]["first_call_s"] == arms["today"]["first_call_s"]
    assert summ["arms"]["today"]["under_goal"] is True  # a tiny CPU model compiles in seconds


def test_overlaps_names_the_arms_that_shared_the_machine():
    res = {"a": {"start_unix": 0, "end_unix": 10}, "b": {"start_unix": 5, "end_unix": 20},
           "c": {"start_unix": 20, "end_unix": 30}, "d": {"skipped": "budget"}}
    cold_compile.overlaps(res)
    assert [res[n]["ran_with"] for n in "abc"] == [["b"], ["a"], []]
    assert "ran_with" not in res["d"]
