"""Simulator reports: a markdown table per policy and PNG figures like the paper's.

Figures (:func:`plot`, matplotlib with the Agg backend, no display needed):
1. per-rank load over steps, stacked, for vanilla and for feplb (first layer);
2. token straggler per policy over steps (mean over layers);
3. expert time per policy over steps (forward + backward with copies, `plan.timeline`; mean over layers);
4. token straggler as a function of D for feplb and feplb-paper (when a D sweep was run).
"""
from __future__ import annotations

from typing import Optional

import numpy as np

__all__ = ["markdown_table", "plot"]

_COLUMNS = [
    ("token_straggler", "token straggler", "{:,.0f}"),
    ("token_max_over_mean", "max/mean", "{:.3f}"),
    ("gemm_straggler_us", "GEMM straggler (µs)", "{:,.1f}"),
    ("reduction_vs_vanilla", "token red. vs vanilla", "{:.1%}"),
    ("gemm_reduction_vs_vanilla", "GEMM red. vs vanilla", "{:.1%}"),
    ("lower_bound_gap_pct", "gap to bound (% of mean)", "{:.2f}"),
    ("expert_time_us", "expert time fwd+bwd (µs)", "{:,.0f}"),
    ("copy_exposed_us", "exposed copy (µs)", "{:,.0f}"),
    ("weight_bytes_per_step", "weight MB / step", lambda v: f"{v / 1e6:,.0f}"),
    ("ce_us", "CE time (µs)", "{:,.0f}"),
    ("static_us", "static time (µs)", "{:,.0f}"),
]


def markdown_table(metrics: dict) -> str:
    """metrics: {policy: {metric: value}} (the ``policies`` object of OUT.json) -> markdown."""
    cols = [c for c in _COLUMNS if any(c[0] in m for m in metrics.values())]
    lines = ["| policy | " + " | ".join(c[1] for c in cols) + " |",
             "|---|" + "---:|" * len(cols)]
    for name, m in metrics.items():
        cells = [(c[2] if callable(c[2]) else c[2].format)(m[c[0]]) if c[0] in m else "" for c in cols]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(path: str, runs: dict, d_sweep: Optional[dict] = None, layer: int = 0) -> None:
    """runs: {policy: PolicyRun}; d_sweep: {policy: {D: mean token straggler}} or None."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = 4 + (1 if d_sweep else 0)
    fig, axes = plt.subplots(1, panels, figsize=(5.2 * panels, 4.2))
    after_name = "feplb" if "feplb" in runs else next(iter(runs))
    top = 0
    for ax, name in zip(axes[:2], ("vanilla", after_name)):
        T = runs[name].rank_tokens[:, layer, :]  # [steps, R]
        steps = np.arange(T.shape[0])
        ax.stackplot(steps, T.T, linewidth=0.2)
        top = max(top, T.sum(axis=1).max())
        ax.set_title(f"{name}: tokens per rank (layer {layer}, stacked)")
        ax.set_xlabel("micro-batch")
        ax.set_ylabel("tokens")
    for ax in axes[:2]:
        ax.set_ylim(0, top * 1.02)
    ax = axes[2]
    for name, run in runs.items():
        ax.plot(run.token_straggler.mean(axis=1), label=name, linewidth=1)
    ax.set_title("token straggler (max - mean) per micro-batch")
    ax.set_xlabel("micro-batch")
    ax.set_ylabel("tokens")
    ax.set_yscale("symlog", linthresh=10)
    ax.legend(fontsize=8)
    ax = axes[3]
    for name, run in runs.items():
        if run.expert_us is not None:
            ax.plot(run.expert_us.mean(axis=1) / 1e3, label=name, linewidth=1)
    ax.set_title("expert time, forward + backward with copies")
    ax.set_xlabel("micro-batch")
    ax.set_ylabel("ms (slowest rank)")
    ax.legend(fontsize=8)
    if d_sweep:
        ax = axes[4]
        for name, by_d in d_sweep.items():
            ds = sorted(by_d)
            ax.plot(ds, [by_d[d] for d in ds], marker="o", label=name)
        ax.set_title("token straggler vs dynamic experts per rank D")
        ax.set_xlabel("D")
        ax.set_ylabel("tokens")
        ax.set_yscale("symlog", linthresh=10)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
