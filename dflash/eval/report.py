"""The bench report: the ONE plot list, the plots, report.json and report.md (rendered from
``dflash/templates/report.md.j2``), and the training curves the report quotes.

Owns: ``PLOTS`` (the bench rule's report outputs, rules/bench.smk, and the default target's
outputs, rules/common.smk, are read from or held to it), :func:`write_plots`,
:func:`write_report`, :func:`render_report_md`, :func:`training_curves`, :func:`fmt`,
:func:`ci`.
Imports only the top-level modules (matplotlib and jinja2 lazily: Snakemake imports ``PLOTS``
at parse time, before any environment exists).
"""
from __future__ import annotations

from pathlib import Path

from jinja2 import Environment, FileSystemLoader, StrictUndefined

from ..artifacts.manifest import atomic_path, atomic_write_json, atomic_write_text

# The bench rule declares these as report outputs (rules/bench.smk; tests/test_report.py holds
# them to this list) and the default target asks for them (rules/common.smk), so every run
# writes all of them: a plot without data says why instead.
PLOTS = ("loss.png", "throughput.png", "draft_accuracy.png", "tau_training.png", "acceptance.png",
         "tau_by_category.png", "decode_speed.png")


def write_plots(out: Path, metrics: list[dict], tau: dict) -> list[str]:
    """Every plot of :data:`PLOTS` into ``out``: the training curves, then the evaluation's."""
    plot = _plotter(out)
    _training_plots(plot, metrics)
    _eval_plots(plot, tau)
    return list(PLOTS)


def _plotter(out: Path):
    """``plot(name, draw, missing, **labels)``: one figure into ``out / name`` (atomically),
    drawn by ``draw(ax)``, or saying ``missing`` when there is nothing to draw."""
    # matplotlib here only (the Snakefile reads PLOTS at parse time): ~0.3 s, and its backend
    # is chosen before pyplot loads
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def plot(name: str, draw, missing: str | None, **labels) -> None:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        if missing is None:
            draw(ax)
            ax.set(**labels)
        else:
            ax.set(title=labels.get("title"), xticks=[], yticks=[])
            ax.text(0.5, 0.5, missing, ha="center", va="center", wrap=True,
                    transform=ax.transAxes)
        fig.tight_layout()
        with atomic_path(out / name) as tmp:
            fig.savefig(tmp, format="png", dpi=100)
        plt.close(fig)

    return plot


def _training_plots(plot, metrics: list[dict]) -> None:
    no_steps = None if metrics else "no training steps recorded"
    steps = [m["step"] for m in metrics]

    def draw_loss(ax):  # log scale: step 0's loss would squash the rest of the curve
        ax.plot(steps, [m["loss"] for m in metrics])
        ax.set_yscale("log")

    plot("loss.png", draw_loss, no_steps, xlabel="step", ylabel="loss (log scale)",
         title="Training loss")
    windows = throughput_windows(metrics)
    plot("throughput.png", lambda ax: ax.plot(*zip(*windows), marker="."),
         None if windows else "fewer than two training steps recorded",
         xlabel="seconds", ylabel="target tokens / s",
         title=f"Throughput (full windows of {window_steps(len(metrics))} steps)")
    acc = [(m["step"], m["draft_acc"]) for m in metrics if m.get("draft_acc")]

    def draw_acc(ax):
        n = len(acc[0][1])
        for k in sorted({1, 2, 4, 8, n} & set(range(1, n + 1))):
            ax.plot([s for s, _ in acc],
                    [a[k - 1] if a[k - 1] is not None else float("nan") for _, a in acc],
                    label=f"k = {k}")
        ax.set_ylim(0, 1)
        ax.legend()

    plot("draft_accuracy.png", draw_acc, None if acc else "no draft accuracy in the metrics",
         xlabel="step", ylabel="top-1 accuracy",
         title="Draft accuracy by block position (training batches)")
    taus = [(m["step"], m["tau_heldout"]) for m in metrics if "tau_heldout" in m]
    est = [(m["step"], tau_from_accuracy(m["draft_acc"])) for m in metrics
           if m.get("draft_acc")]

    def draw_tau(ax):
        if est:
            ax.plot(*zip(*est), label="1 + Σₖ Πⱼ≤ₖ accⱼ (training batches, estimate)")
        if taus:
            ax.plot(*zip(*taus), marker="o", label="simulated τ, held-out prompts")
        ax.legend()

    plot("tau_training.png", draw_tau, None if taus or est else "no draft accuracy or τ logged",
         xlabel="step", ylabel="τ", title="τ while training")


def _eval_plots(plot, tau: dict) -> None:
    sets = {k: v for k, v in (tau.get("sets") or {}).items() if v.get("tau") is not None}
    no_tau = None if sets else f"τ not evaluated: {tau.get('skipped', 'no eval set gave a τ')}"

    def by_position(ax):
        for name, v in sets.items():
            r = v["accept_rate_by_position"]
            ax.plot(range(1, len(r) + 1), [x if x is not None else float("nan") for x in r],
                    marker="o", label=f"{name} (τ = {v['tau']:.2f})")
        ax.set_ylim(0, 1)
        ax.legend()

    plot("acceptance.png", by_position, no_tau, xlabel="block position k",
         ylabel="P(drafts 1..k accepted)", title="Acceptance by position (simulated)")
    cats = (sets.get("mtbench") or {}).get("tau_by_category")
    plot("tau_by_category.png", lambda ax: ax.bar(list(cats), list(cats.values())),
         None if cats else (no_tau or "no MT-Bench set evaluated (bench.eval_sets)"),
         xlabel="MT-Bench category", ylabel="τ", title="τ per MT-Bench category")
    speed = (tau.get("decode_speed") or {}).get("batches") or []

    def by_batch(ax):
        xs = [r["batch"] for r in speed]
        for key, label in (("target_only_tokens_per_s", "target-only (our decoder)"),
                           ("speculative_tokens_per_s", "speculative (our decoder)")):
            ax.plot(xs, [r[key] for r in speed], marker="o", label=label)
        for w, pts in width_series(speed).items():
            ax.plot(*zip(*pts), marker=".", linestyle=":", label=f"speculative, verify {w}")
        served = [(r["batch"], r["served"]["tokens_per_s"]) for r in speed
                  if (r.get("served") or {}).get("tokens_per_s")]
        if served:
            ax.plot(*zip(*served), marker="*", linestyle="none", markersize=10,
                    label="served (the adaptive choice)")
        hf = [(r["batch"], r["hf_static"]["tokens_per_s"]) for r in speed if r.get("hf_static")]
        if hf:
            ax.plot(*zip(*hf), marker="s", linestyle="--", label="HF generate, static cache")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.legend()

    ds = tau.get("decode_speed") or {}
    plot("decode_speed.png", by_batch, None if speed else
         f"decoding speed not measured: {ds.get('skipped') or ds.get('failed') or no_tau}",
         xlabel="batch size", ylabel="new tokens / s",
         title="Decoding speed by batch size (MT-Bench first turns)")



def width_series(speed: list[dict]) -> dict[int, list[tuple[int, float]]]:
    """(batch, tokens/s) per verify width narrower than a row's full block, from the sweep
    rows' ``widths`` (the full block is the row's own speculative line; rows of older reports
    have no ``widths`` and add nothing)."""
    out: dict[int, list[tuple[int, float]]] = {}
    for r in speed:
        full = max((w["width"] for w in r.get("widths") or []), default=None)
        for w in r.get("widths") or []:
            if w["width"] != full and w.get("tokens_per_s"):
                out.setdefault(w["width"], []).append((r["batch"], w["tokens_per_s"]))
    return dict(sorted(out.items()))


def window_steps(n: int) -> int:
    return max(1, n // 20)


def throughput_windows(metrics: list[dict]) -> list[tuple[float, float]]:
    """(end time, tokens/s) over consecutive full windows of steps: a per-step rate is noisy,
    and a partial last window (fewer steps, the final flush) spiked the end of the curve."""
    w = window_steps(len(metrics))
    out = []
    for i in range(w, len(metrics), w):  # windows end at i, i + w, ...; a partial tail is dropped
        dt = metrics[i]["t"] - metrics[i - w]["t"]
        if dt > 0:
            out.append((metrics[i]["t"], sum(m["tokens"] for m in metrics[i - w + 1:i + 1]) / dt))
    return out


def tau_from_accuracy(acc: list) -> float:
    """τ a drafter with these per-position top-1 accuracies would reach if positions were
    independent: 1 + Σₖ Πⱼ≤ₖ accⱼ (a missing position ends the chain)."""
    tau, p = 1.0, 1.0
    for a in acc:
        if a is None:
            break
        p *= a
        tau += p
    return tau


def write_report(out: Path, report: dict, metrics: list[dict], tau: dict) -> dict:
    """report.json, the plots, report.md (rendered from the package's template)."""
    report["plots"] = write_plots(out, metrics, tau)
    atomic_write_json(out / "report.json", report)
    md = render_report_md(report)
    atomic_write_text(out / "report.md", md)
    print(f"[bench] report: {out / 'report.md'} (+ report.json and {len(report['plots'])} plots "
          f"beside it)\n[bench] {headline(report)}", flush=True)
    return report


def headline(report: dict) -> str:
    """The run's figures in one line (the console's; report.md has the rest)."""
    return (f"target tokens/s {fmt(report.get('tokens_per_s'))} · τ {fmt(report.get('tau'))} · "
            f"final loss {fmt(report.get('final_loss'))} · recompiles after warmup "
            f"{report.get('recompiles_after_warmup')} · race errors {report.get('race_errors')}")


def render_report_md(report: dict) -> str:
    env = Environment(loader=FileSystemLoader(Path(__file__).parents[1] / "templates"),
                      undefined=StrictUndefined, trim_blocks=True, lstrip_blocks=True)
    return env.get_template("report.md.j2").render(r=report, fmt=fmt, ci=ci)


def training_curves(metrics: list[dict]) -> dict:
    """What the drafter learnt while training: draft accuracy at the end, τ on held-out prompts
    along the way (when monitored)."""
    return {
        # per block position k = 1..B-1, mean over the last 10 logged steps
        "final_draft_acc": _last_draft_acc(metrics),
        "tau_while_training": [{"step": m["step"], "tau": m["tau_heldout"]} for m in metrics
                               if "tau_heldout" in m],
    }


def _last_draft_acc(metrics: list[dict], last: int = 10) -> list[float | None] | None:
    rows = [m["draft_acc"] for m in metrics[-last:] if m.get("draft_acc")]
    if not rows:
        return None
    out = []
    for k in range(len(rows[0])):
        vals = [r[k] for r in rows if r[k] is not None]
        out.append(round(sum(vals) / len(vals), 4) if vals else None)
    return out


def fmt(x, digits: int = 3) -> str:
    """A value for a report table: floats rounded, dicts as ``k v, ...`` without the unset
    entries (``torch: {'cuda': None, ...}`` was unreadable), lists comma-separated."""
    if x is None:
        return "n/a"
    if isinstance(x, bool):
        return str(x).lower()
    if isinstance(x, float):
        return f"{x:.{digits}g}" if abs(x) < 10 ** digits else f"{x:,.0f}"
    if isinstance(x, dict):
        items = [f"{k} {fmt(v, digits)}" for k, v in x.items() if v not in (None, {}, [], "")]
        return ", ".join(items) or "n/a"
    if isinstance(x, (list, tuple)):
        return ", ".join(fmt(v, digits) for v in x) or "n/a"
    return str(x)


def ci(d, digits: int = 3) -> str:
    """`` [lo, hi]``: a τ's 95 % interval over prompts from ``d["tau_ci95"]``
    (:mod:`dflash.eval.spread`), or "" where there is none (one prompt; an older report.json)."""
    v = d.get("tau_ci95") if isinstance(d, dict) else None
    return f" [{fmt(v[0], digits)}, {fmt(v[1], digits)}]" if v else ""
