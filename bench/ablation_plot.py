"""The ablation's τ-vs-GPU-minutes plot (tau_vs_gpu_minutes.png) from :mod:`bench.ablation_table`'s
data: the τ monitor's curves (held-out, while training) as lines, every arm's and run's MT-Bench
τ at the end as a star."""
from __future__ import annotations

from pathlib import Path


def plot(data: dict, png: Path) -> None:
    import matplotlib  # noqa: PLC0415 - the backend is chosen before pyplot loads

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, pts in data["curve"].items():
        ax.plot([p["gpu_minutes"] for p in pts], [p["tau_heldout"] for p in pts], marker=".",
                label=f"{name} (held-out, monitor)")
    for r in data["arms"] + data["runs"]:
        if r["tau"]["mtbench"] is not None:
            ax.scatter([r["gpu_minutes"]], [r["tau"]["mtbench"]], marker="*", s=80, zorder=3,
                       color="k")
            ax.annotate(r["arm"], (r["gpu_minutes"], r["tau"]["mtbench"]), fontsize=7,
                        xytext=(3, -9), textcoords="offset points")
    ax.set(xlabel="training GPU-minutes (H200; share of the GPU when arms trained at once)",
           ylabel="τ (simulated, greedy, block 16)",
           title="τ vs GPU-minutes: lines held-out while training, stars MT-Bench at the end")
    ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
