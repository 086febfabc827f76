"""Project a spec's training throughput onto N nodes: gradient bytes, ring all-reduce time, step
time, tokens/s and scaling efficiency, from measured per-GPU rates. Writes JSON; docs/scale-out.md
quotes its output. CPU only, no weights (the drafter is built on the meta device).

    python -m bench.scale_out_projection --spec specs/expanded.yaml --nodes 1 2 4 8 16 32 64 \
        --out bench/results/scale_out_projection.json

The step model follows dflash/train/scheduler.py with topology.nodes > 1: per node, T target workers
produce one packed batch per drafter replica per step (D replicas); the replicas train, their
gradients are summed in-process on the node, then one all-reduce of the flat fp32 gradient goes
across nodes, and every replica steps its optimizer. Target workers do not wait for the
all-reduce (they run ahead by topology.queue_depth batches), so

    step(n) = max(target_s, drafter_s + allreduce_s(n))

target_s  = D x tokens_per_batch / (T x target tokens/s per GPU)
drafter_s = drafter fwd+bwd FLOPs per batch (dflash.train.flops, the bench stage's count) / (MFU x peak)
allreduce_s(n) = 2 (n-1)/n x bytes / link + 2 (n-1) x latency          (ring, one rank per node)

Inputs, each recorded in the JSON with where it came from:
- the target forward rate per GPU: bench/results/h200/target_anchor_32b.json (our packed-row flex
  path, full 64 layers), scaled to the layers the pipeline runs (up to the last feature layer);
- the drafter MFU while busy: a bench report (default: the 2-H200 qwen3-8b-2gpu-balanced run,
  drafter busy 98 % of its steps); --report takes the one
  from a run of the projected shapes instead, e.g. the 2-H200 expanded-shape measurement (and
  --train-manifest its train manifest: the measured all-reduce seconds and bytes per step are
  recorded beside the projection);
- tokens and labelled tokens per batch: a train metrics.jsonl of the same batching (default: the
  expanded-2gpu H200 run), else token_budget;
- a check on the drafter time: the steady state of the 1 target + 1 drafter H200 run of the
  same shapes (expanded-2gpu): its tokens/s is the slower worker's, so tokens per batch / it is
  an upper bound on the drafter's seconds per batch; the projection is repeated at that bound.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from dflash.models.drafter import DFlashConfig, DFlashDrafter
from dflash.models.target import hf_config, layer_ids
from dflash.spec.load import load_spec
from dflash.train.flops import drafter_flops_per_step

REPO = Path(__file__).resolve().parents[1]  # dflash itself: the installed package

H200 = REPO / "bench" / "results" / "h200"


def drafter_config(spec):
    tcfg = hf_config(spec.target)
    ids = layer_ids(spec.target, tcfg)
    dcfg = DFlashConfig.from_target_config(tcfg, spec.drafter.num_layers, spec.drafter.block_size,
                                           spec.drafter.mask_token_id, ids)
    return tcfg, dcfg


def trainable_params(dcfg) -> int:
    """Parameters the replicas all-reduce: the drafter's own (embedding and lm_head are the
    target's, frozen, not part of it)."""
    with torch.device("meta"):
        model = DFlashDrafter(dcfg)
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def batch_tokens(metrics: Path | None, token_budget: int) -> dict:
    if metrics and metrics.is_file():
        rows = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
        if rows:
            return {"tokens": sum(r["tokens"] for r in rows) / len(rows),
                    "labelled": sum(r["labelled"] for r in rows) / len(rows),
                    "source": str(metrics.relative_to(REPO)), "steps": len(rows)}
    return {"tokens": float(token_budget), "labelled": float(token_budget) * 2 / 3,
            "source": "token_budget (labelled: 2/3 of it, assumed)", "steps": 0}


def target_rate(anchor: Path, layers_run: int) -> dict:
    d = json.loads(anchor.read_text())
    run = d["runs"][0]
    measured = run["ours_flex"]
    rate = measured["tokens_per_s"] * measured["layers_run"] / layers_run
    return {"tokens_per_s_per_gpu": rate, "measured_tokens_per_s": measured["tokens_per_s"],
            "measured_layers": measured["layers_run"], "layers_run": layers_run,
            "model": run["model"], "peak_flops_per_s": d["peak"]["flops_per_s"],
            "source": str(anchor.relative_to(REPO))}


def allreduce_s(nbytes: float, nodes: int, link_bytes_per_s: float, latency_s: float) -> float:
    if nodes <= 1:
        return 0.0
    return 2 * (nodes - 1) / nodes * nbytes / link_bytes_per_s + 2 * (nodes - 1) * latency_s


def drafter_mfu(args) -> tuple[Path, dict, float, str]:
    """The report the drafter's MFU comes from, the report, the MFU and how it was counted."""
    report_path = Path(args.report) if args.report else args.mfu_report
    report = json.loads(report_path.read_text())
    # the drafter's MFU while it computes: a run whose drafter idled reports a lower wall MFU
    key = "drafter_mfu_while_busy" if report.get("drafter_mfu_while_busy") else "drafter_mfu"
    mfu, counted = report[key], "as reported"
    # a report made before the lm_head was counted 2x (forward + input gradient) has a higher
    # MFU for the same busy time: use its recount, so the MFU and the FLOPs below share a rule
    recounts = json.loads(args.mfu_recount.read_text())["runs"] if args.mfu_recount else {}
    rel = str(report_path.resolve().relative_to(REPO)) if report_path.resolve(
    ).is_relative_to(REPO) else str(report_path)
    for name, r in recounts.items():
        if r["report"] == rel and key in r:
            mfu = r[key]["over_measured_peak"]
            counted = (f"{key} {r[key]['committed_over_measured_peak']:.3f} as reported, "
                       f"{mfu:.3f} recounted with the lm_head at 2x ({args.mfu_recount.name})")
    return report_path, report, mfu, counted


def rows(m: dict, args, grad_bytes_per_param: int, overlap: bool = False, links: int = 1,
         drafter_s: float | None = None) -> list[dict]:
    """Per node count: the all-reduce of the gradient, the step and the tokens/s; ``m`` is the
    node's step model (see :func:`project`)."""
    drafter_s = m["drafter_s"] if drafter_s is None else drafter_s
    nbytes = m["params"] * grad_bytes_per_param
    base = max(m["target_s"], drafter_s + m["local_s"])
    out = []
    for n in args.nodes:
        ar = allreduce_s(nbytes, n, links * m["link"], m["lat"])
        # overlap: the all-reduce runs in buckets under the drafters' backward (as DDP does),
        # so only what exceeds the backward (2/3 of drafter_s) stays exposed
        exposed = max(0.0, ar - 2 / 3 * drafter_s) if overlap else ar
        step = max(m["target_s"], drafter_s + m["local_s"] + exposed)
        tokens = n * m["D"] * m["tokens"]
        out.append({"nodes": n, "gpus": n * (m["T"] + m["D"]), "allreduce_s": round(ar, 4),
                    "exposed_allreduce_s": round(exposed, 4), "step_s": round(step, 4),
                    "tokens_per_s": round(tokens / step), "efficiency": round(base / step, 4)})
    return out


def split(m: dict, args, t: int, d: int) -> dict:
    """One node of ``t`` target and ``d`` drafter GPUs: which side bounds it."""
    ts, dstep = d * m["tokens"] / (t * m["rate"]), m["drafter_s"] + 2 * (d - 1) * m["params"] * 4 / (
        args.peer_gbytes * 1e9)
    return {"targets": t, "drafters": d, "target_s": round(ts, 4), "drafter_s": round(dstep, 4),
            "bound": "target" if ts >= dstep else "drafter",
            "tokens_per_s": round(d * m["tokens"] / max(ts, dstep))}


def add_measured(result: dict, args, m: dict) -> None:
    """The measured runs beside the projection: a 1+1 steady state, a multi-node all-reduce."""
    if args.steady_state and Path(args.steady_state).is_file():
        # a measured run of the same shapes with 1 target + 1 drafter GPU: each step is one
        # batch through the slower of the two workers, so its step time bounds the drafter's
        # time per batch from above
        ss_path = Path(args.steady_state).resolve()
        ss = json.loads(ss_path.read_text())
        upper = ss["step_time_s"]
        result["measured_1_plus_1"] = {
            "tokens_per_s": ss["tokens_per_s"], "step_time_s": ss["step_time_s"],
            "steady_steps": ss.get("steady_steps"),
            "drafter_s_upper_bound": round(upper, 4),
            "estimate_within_bound": m["drafter_s"] <= upper,
            "source": str(ss_path.relative_to(REPO)) if ss_path.is_relative_to(REPO)
            else str(ss_path)}
        result["projection"]["fp32_drafter_at_upper_bound"] = rows(m, args, 4, drafter_s=upper)
    if args.train_manifest:
        # a multi-node run's measured all-reduce (dflash/stages/train.py: manifest "distributed")
        d = json.loads(Path(args.train_manifest).read_text()).get("distributed", {})
        if d.get("nodes", 1) > 1 and d.get("allreduce_s_per_step_mean"):
            n, b, t = d["nodes"], d["allreduce_bytes_per_step"], d["allreduce_s_per_step_mean"]
            result["measured_allreduce"] = {
                "nodes": n, "backend": d.get("backend"), "bytes_per_step": b,
                "seconds_per_step": t,
                # ring: each rank sends and receives 2(n-1)/n of the buffer
                "bus_gbytes_per_s": round(2 * (n - 1) / n * b / t / 1e9, 2),
                "source": args.train_manifest}


ASSUMPTIONS = {
    "efficiency": "1.0 wherever the node is target-bound, by construction of the step "
                  "model: the targets run ahead by topology.queue_depth batches, so "
                  "step = max(target_s, drafter_s + in-node sum + all-reduce) hides any "
                  "all-reduce shorter than the gap (assumed overlap; no multi-node run "
                  "has measured it)",
    "rates": "per-GPU rates measured on one or two H200s (target_anchor_32b.json, the "
             "drafter MFU of a Qwen3-8B-shaped run), assumed to hold on every node"}


def project(args) -> dict:
    spec = load_spec(REPO / args.spec)
    tcfg, dcfg = drafter_config(spec)
    params = trainable_params(dcfg)
    T, D = len(spec.topology.targets), len(spec.topology.drafters)
    layers_run = max(dcfg.target_layer_ids) + 1
    report_path, report, mfu, counted = drafter_mfu(args)
    tgt = target_rate(args.anchor, layers_run)
    peak = report.get("peak", {}).get("flops_per_s") or tgt["peak_flops_per_s"]
    batch = batch_tokens(args.metrics, spec.batching.token_budget)

    flops = drafter_flops_per_step(dcfg, int(batch["tokens"]), int(batch["labelled"]),
                                   int(batch["labelled"]))
    drafter_s = flops / (mfu * peak)
    rate = tgt["tokens_per_s_per_gpu"]
    target_s = D * batch["tokens"] / (T * rate)
    # the in-process sum on the node: D-1 replicas' flat grads to the lead device and the mean
    # back (peer copies, one after another), fp32
    local_s = 2 * (D - 1) * params * 4 / (args.peer_gbytes * 1e9)
    m = {"params": params, "T": T, "D": D, "tokens": batch["tokens"], "rate": rate,
         "target_s": target_s, "drafter_s": drafter_s, "local_s": local_s,
         "link": args.link_gbps * 1e9 / 8, "lat": args.latency_us * 1e-6}
    result = {
        "spec": args.spec,
        "per_node": {"targets": T, "drafters": D},
        "drafter": {"hidden_size": dcfg.hidden_size, "layers": dcfg.num_hidden_layers,
                    "intermediate_size": dcfg.intermediate_size,
                    "heads": dcfg.num_attention_heads, "kv_heads": dcfg.num_key_value_heads,
                    "feature_layers": dcfg.target_layer_ids, "trainable_params": params},
        "gradient_bytes_per_step": {"fp32": params * 4, "bf16": params * 2,
                                    "note": "the replicas keep fp32 master weights and fp32 "
                                            "grads (dflash/train/replica.py); the all-reduce sends the "
                                            "flat fp32 gradient"},
        "batch": batch,
        "target": tgt,
        "assumptions": {**ASSUMPTIONS,
                        "network": f"{args.link_gbps:g} Gb/s per node, {args.latency_us:g} us per "
                                   "ring hop, ideal ring all-reduce: assumed, not measured"},
        "drafter_step": {"flops": flops, "mfu": mfu, "mfu_counting": counted,
                         "peak_flops_per_s": peak,
                         "mfu_source": str(report_path.relative_to(REPO))
                         if report_path.is_relative_to(REPO) else str(report_path),
                         "seconds": round(drafter_s, 4)},
        "node_step": {"target_s": round(target_s, 4), "drafter_s": round(drafter_s, 4),
                      "local_reduce_s": round(local_s, 4),
                      "bound": "target" if target_s >= drafter_s + local_s else "drafter",
                      "tokens_per_s": round(D * batch["tokens"] / max(target_s,
                                                                      drafter_s + local_s))},
        "per_node_splits": [split(m, args, t, 8 - t) for t in range(3, 8)],
        "link": {"gbit_per_s_per_node": args.link_gbps, "latency_us_per_hop": args.latency_us,
                 "peer_copy_gbytes_per_s": args.peer_gbytes},
        "projection": {"fp32": rows(m, args, 4), "bf16": rows(m, args, 2),
                       "fp32_overlapped_with_backward": rows(m, args, 4, overlap=True),
                       "fp32_8_links": rows(m, args, 4, links=8)},
    }
    add_measured(result, args, m)
    return result


def markdown(r: dict) -> str:
    """The tables docs/scale-out.md quotes."""
    n, g = r["node_step"], r["gradient_bytes_per_step"]
    lines = ["Projected, not measured. Assumed: " + "; ".join(
        f"{k}: {v}" for k, v in r["assumptions"].items()) + ".", "",
             f"drafter: {r['drafter']['trainable_params']:,} trainable parameters; gradient per "
             f"step {g['fp32'] / 1e9:.2f} GB fp32 ({g['bf16'] / 1e9:.2f} GB as bf16)", "",
             f"one node ({r['per_node']['targets']} targets + {r['per_node']['drafters']} "
             f"drafters): target {n['target_s']} s, drafter {n['drafter_s']} s + in-node sum "
             f"{n['local_reduce_s']} s per step ({n['bound']}-bound), {n['tokens_per_s']:,} "
             f"tokens/s (projected; drafter MFU {r['drafter_step']['mfu_counting']})", ""]
    names = {"fp32": "fp32 all-reduce (as built)", "bf16": "bf16 all-reduce",
             "fp32_overlapped_with_backward": "fp32, overlapped with the backward",
             "fp32_8_links": "fp32, 8 x 400 Gb/s per node",
             "fp32_drafter_at_upper_bound": "fp32, drafter time at its measured upper bound"}
    for key, rows in r["projection"].items():
        lines += [f"**{names.get(key, key)}**", "",
                  "| nodes | GPUs | all-reduce s | exposed s | step s | tokens/s | efficiency |",
                  "|---:|---:|---:|---:|---:|---:|---:|"]
        lines += [f"| {x['nodes']} | {x['gpus']} | {x['allreduce_s']:.3f} | "
                  f"{x['exposed_allreduce_s']:.3f} | {x['step_s']:.3f} | {x['tokens_per_s']:,} | "
                  f"{x['efficiency']:.3f} |" for x in rows]
        lines.append("")
    lines += ["**per-node split of 8 GPUs** (one node)", "",
              "| targets | drafters | target s | drafter s | bound | tokens/s |",
              "|---:|---:|---:|---:|---|---:|"]
    lines += [f"| {x['targets']} | {x['drafters']} | {x['target_s']:.3f} | {x['drafter_s']:.3f} "
              f"| {x['bound']} | {x['tokens_per_s']:,} |" for x in r["per_node_splits"]]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--spec", default="specs/expanded.yaml")
    p.add_argument("--nodes", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    p.add_argument("--link-gbps", type=float, default=400.0, help="network per node, Gbit/s")
    p.add_argument("--latency-us", type=float, default=10.0, help="per ring hop, microseconds")
    p.add_argument("--peer-gbytes", type=float, default=300.0,
                   help="GPU-to-GPU copy on a node (NVLink), GB/s, for the in-process grad sum")
    p.add_argument("--anchor", type=Path, default=H200 / "target_anchor_32b.json")
    p.add_argument("--mfu-report", type=Path,
                   default=H200 / "qwen3-8b-2gpu-balanced" / "replayed_bench" / "report.json")
    p.add_argument("--mfu-recount", type=Path, default=H200 / "mfu_denominators.json",
                   help="recounted MFUs of committed reports (bench/mfu_denominators.py): used "
                        "for a report made before the lm_head was counted 2x")
    p.add_argument("--report", default=None,
                   help="a bench report.json of the projected shapes (its drafter_mfu, and its "
                        "measured all-reduce if present, replace the defaults)")
    p.add_argument("--steady-state", default=str(H200 / "expanded-2gpu" / "steady_state.json"),
                   help="steady state of a 1 target + 1 drafter run of the same shapes "
                        "(bench/steady_state_from_metrics.py): bounds the drafter time")
    p.add_argument("--train-manifest", default=None,
                   help="the train manifest.json of a multi-node run: its measured all-reduce "
                        "seconds per step and bytes are recorded beside the projection")
    p.add_argument("--metrics", type=Path,
                   default=H200 / "expanded-2gpu" / "expanded-2gpu__train__metrics.jsonl")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--markdown", action="store_true", help="print the tables as markdown")
    args = p.parse_args(argv)
    result = project(args)
    text = json.dumps(result, indent=1)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    if args.markdown:
        print(markdown(result), end="")
        return 0
    n = result["node_step"]
    print(f"drafter: {result['drafter']['trainable_params']:,} params, "
          f"{result['gradient_bytes_per_step']['fp32'] / 1e9:.2f} GB fp32 grads per step")
    print(f"one node: target {n['target_s']} s, drafter {n['drafter_s']} s + local reduce "
          f"{n['local_reduce_s']} s per step "
          f"({n['bound']}-bound), {n['tokens_per_s']:,} tokens/s")
    for key, rows in result["projection"].items():
        print(key)
        for r in rows:
            print(f"  {r['nodes']:3d} nodes  all-reduce {r['allreduce_s']:.3f} s  step "
                  f"{r['step_s']:.3f} s  {r['tokens_per_s']:>9,} tokens/s  "
                  f"efficiency {r['efficiency']:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
