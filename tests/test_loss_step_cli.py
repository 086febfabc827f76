"""bench/gpu/loss_step.py --head-chunks on the CPU (--smoke): the captured-step arm runs once per
compile.head_chunk, each record says its chunk, and every chunk's static loss, hits and gradient
equal today's step (the check the H200 run reports)."""
import json
import sys

from bench.gpu import loss_step


def test_head_chunks_run_the_step_arm_once_per_chunk(tmp_path, monkeypatch):
    out = tmp_path / "ls.json"
    monkeypatch.setattr(sys, "argv", ["loss_step", "--smoke", "--arms", "graph", "--caps", "8",
                                      "--head-chunks", "2048,16", "--out", str(out)])
    loss_step.main()
    r = json.loads(out.read_text())
    assert [s["head_chunk"] for s in r["step"]] == [2048, 16]
    for s in r["step"]:
        assert "error" not in s and s["check"]["ok"], s
        assert s["check"]["supervised"] > 16  # the 16-row chunk really splits the head
