"""bench/scale_out_projection.py: the figures docs/scale-out.md quotes, checked against the
Qwen3-32B shape by hand and against the ring all-reduce formula."""
from __future__ import annotations

import json

from bench import scale_out_projection
from dflash.runtime.harness import REPO


def _module():
    return scale_out_projection


def test_expanded_projection(tmp_path):
    out = tmp_path / "p.json"
    assert _module().main(["--spec", "specs/expanded.yaml", "--nodes", "1", "8",
                           "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    # Qwen3-32B shape: hidden 5120, 64 heads / 8 kv heads of 128, MLP 25600; 5 drafter layers,
    # fc from 5 feature layers; norms: 4 per layer (input, post-attn, q, k) + norm + hidden_norm
    H, hd, I = 5120, 128, 25600
    layer = H * hd * (64 + 8 + 8) + 64 * hd * H + 3 * H * I + 2 * H + 2 * hd
    params = 5 * layer + 5 * H * H + 2 * H
    assert r["drafter"]["trainable_params"] == params
    assert r["gradient_bytes_per_step"]["fp32"] == 4 * params
    one, eight = r["projection"]["fp32"]
    assert one["efficiency"] == 1.0 and one["allreduce_s"] == 0.0
    ring = 2 * 7 / 8 * 4 * params / (400e9 / 8) + 2 * 7 * 10e-6
    assert abs(eight["allreduce_s"] - ring) < 1e-3
    # the all-reduce is hidden while the drafters' side (drafter + in-node sum + all-reduce) stays
    # under the targets' time, exposed once it does not
    node = r["node_step"]
    hidden = node["drafter_s"] + node["local_reduce_s"] + eight["allreduce_s"] <= node["target_s"]
    assert eight["gpus"] == 64 and (eight["efficiency"] == 1.0) == hidden
    slow = r["projection"]["fp32_drafter_at_upper_bound"][1]
    assert 0 < slow["efficiency"] < 1  # a drafter-bound node pays its all-reduce
    # tokens/s = 8 nodes x 3 drafters x tokens per batch / step time
    tokens = 8 * 3 * r["batch"]["tokens"] / eight["step_s"]
    assert abs(eight["tokens_per_s"] - tokens) / tokens < 1e-3
    # halving the bytes (bf16) halves the bandwidth term and never lowers efficiency
    assert r["projection"]["bf16"][1]["efficiency"] >= eight["efficiency"]
    # the drafter MFU shares the FLOP count's rule (lm_head 2x): the committed recount of the
    # report it comes from, not the report's own lm_head-3x figure; the assumptions ride along
    rc = json.loads((REPO / "bench/results/h200/mfu_denominators.json").read_text())
    busy = rc["runs"]["qwen3-8b-2gpu-balanced"]["drafter_mfu_while_busy"]
    assert r["drafter_step"]["mfu"] == busy["over_measured_peak"] < busy[
        "committed_over_measured_peak"]
    assert "by construction" in r["assumptions"]["efficiency"]
