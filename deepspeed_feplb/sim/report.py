"""Simulator reports: a markdown table per policy and PNG figures like the paper's.

Figures (:func:`figure` builds them, :func:`plot` writes the PNG; matplotlib with the Agg backend,
no display needed), one panel each:
1. tokens per rank over micro-batches, stacked, for vanilla and for feplb (first layer);
2. token straggler per policy over micro-batches (mean over layers);
3. GEMM straggler per policy (the cost model, mean over layers);
4. expert time per policy (forward + backward with copies, `plan.timeline`; mean over layers);
5. expert time over the ideal per policy, and where the excess goes (extra pieces, imbalance left,
   exposed copies, the rest: `simulate.PolicyRun.over_ideal`);
6. token straggler as a function of D for feplb and feplb-paper (when a D sweep was run).
"""
from __future__ import annotations

import math
from typing import Optional

import numpy as np

from deepspeed_feplb.report import PLOT_INSTALL, pyplot

__all__ = ["PLOT_INSTALL", "markdown_table", "figure", "plot", "pyplot"]

# The package is installed from its checkout (it is not on PyPI), so the extra is named there.


def _number(value: float) -> str:
    """Three significant figures for small values, thousands separators for large ones; below
    0.001 (float noise in µs or MB) it prints 0."""
    if abs(value) < 0.001 or abs(value) >= 100:
        return f"{value:,.0f}" if abs(value) >= 0.001 else "0"
    return f"{value:.{max(0, 2 - int(math.floor(math.log10(abs(value)))))}f}"


_COLUMNS = [
    ("token_straggler", "token straggler", _number),
    ("token_max_over_mean", "max/mean", "{:.3f}"),
    ("gemm_straggler_us", "GEMM straggler (µs)", _number),
    ("reduction_vs_vanilla", "token red. vs vanilla", "{:.1%}"),
    ("gemm_reduction_vs_vanilla", "GEMM red. vs vanilla", "{:.1%}"),
    ("lower_bound_gap_pct", "gap to bound (% of mean)", "{:.2f}"),
    ("expert_time_us", "expert time fwd+bwd (µs)", _number),
    ("copy_exposed_us", "exposed copy (µs)", _number),
    ("time_over_ideal", "expert time / ideal", "{:.3f}"),
    ("weight_bytes_per_step", "weight MB / step", lambda v: _number(v / 1e6)),
    ("ce_us", "CE time (µs)", _number),
    ("static_us", "static time (µs)", _number),
    ("placement_us", "re-placement (µs per mb, in expert time)", _number),
    ("placement_refreshes", "re-placements", "{:,.0f}"),
    ("placement_migrated_experts", "experts moved", "{:,.0f}"),
]


def markdown_table(metrics: dict, setup: Optional[dict] = None) -> str:
    """metrics: {policy: {metric: value}} (the ``policies`` object of OUT.json); setup: the
    ``setup`` object of OUT.json (names the cost profile and expert shape in the notes) -> markdown.

    A note follows the table when a policy's GEMM reduction is negative although its token
    reduction is positive: it balanced the tokens, yet under the cost model its expert GEMMs are
    slower than vanilla's, which usually means the profile does not fit the trace."""
    cols = [c for c in _COLUMNS if any(c[0] in m for m in metrics.values())]
    lines = ["| policy | " + " | ".join(c[1] for c in cols) + " |",
             "|---|" + "---:|" * len(cols)]
    for name, m in metrics.items():
        cells = [(c[2] if callable(c[2]) else c[2].format)(m[c[0]]) if c[0] in m else "" for c in cols]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    # better token balance but slower GEMMs: the cost model, not the policy, is the likely suspect
    slower = [name for name, m in metrics.items()
              if m.get("gemm_reduction_vs_vanilla", 0) < 0 and m.get("reduction_vs_vanilla", 0) > 0]
    if slower:
        profile, shape = "", ""
        if setup:
            profile = f" `{(setup.get('profile') or {}).get('name', '?')}`"
            s = setup.get("shape") or {}
            shape = f" (experts of hidden {s.get('hidden', '?')}, FFN {s.get('ffn_hidden', '?')})"
        lines += ["", f"Note: a negative GEMM reduction next to a positive token reduction ({', '.join(slower)}) "
                      "means the policy balanced the tokens but its slowest expert GEMMs take longer than "
                      f"vanilla's under the cost profile{profile}{shape}: splitting an "
                      "expert's rows into more, smaller pieces costs tile padding and a fixed overhead per piece, "
                      "which outweighs the better balance when the GEMMs are small. The cost profile may not match "
                      "the trace's shapes or hardware: give --hidden/--ffn-hidden of the real model, or --profile cpu "
                      "for a trace recorded on CPU."]
    return "\n".join(lines)


# Legend labels: the policy's CLI name and what it does.
POLICY_LABELS = {
    "vanilla": "vanilla (no balancing)",
    "fastermoe": "fastermoe (shadow hot experts)",
    "eplb": "eplb (replicate and re-place)",
    "feplb-paper": "feplb-paper (paper's planner)",
    "feplb": "feplb",
    "milp": "milp (exact optimum)",
}


def _label(name: str) -> str:
    return POLICY_LABELS.get(name, name)


# One colour per policy in every panel.
POLICY_COLORS = {"vanilla": "black", "fastermoe": "tab:blue", "eplb": "tab:orange", "feplb-paper": "tab:green",
                 "feplb": "tab:red", "milp": "tab:purple"}


def _line(name: str) -> dict:
    """Line style of a policy: vanilla dashed and on top, so a policy that does nothing (equal to
    vanilla) stays visible under it."""
    style = {"color": POLICY_COLORS.get(name), "linewidth": 1}
    if name == "vanilla":
        style.update(linestyle=(0, (4, 3)), zorder=3, linewidth=1.2)
    return style


def figure(runs: dict, d_sweep: Optional[dict] = None, layer: int = 0, title: str = ""):
    """runs: {policy: PolicyRun}; d_sweep: {policy: {D: mean token straggler}} or None -> a
    matplotlib Figure (module docstring for the panels)."""
    plt = pyplot()
    from matplotlib.ticker import MaxNLocator

    panels = 6 + (1 if d_sweep else 0)
    cols = 3
    rows = -(-panels // cols)
    fig, grid = plt.subplots(rows, cols, figsize=(6.0 * cols, 4.6 * rows), squeeze=False)
    axes = list(grid.ravel())
    for ax in axes[panels:]:
        ax.set_axis_off()
    for ax in axes[:panels]:  # micro-batches and D are whole numbers
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)

    after_name = "feplb" if "feplb" in runs else next((n for n in runs if n != "vanilla"), next(iter(runs)))
    top = 0
    stacks = list(zip(axes[:2], ("vanilla", after_name)))
    for ax, name in stacks:
        T = runs[name].rank_rows[:, layer, :]  # [steps, R]
        R = T.shape[1]
        ax.stackplot(np.arange(T.shape[0]), T.T, linewidth=0.2, labels=[f"rank {r}" for r in range(R)],
                     colors=plt.get_cmap("tab20" if R > 10 else "tab10")(np.arange(R) % 20))
        top = max(top, T.sum(axis=1).max())
        ax.set_title(f"{_label(name)}:\ntokens per rank, layer {layer}, stacked", fontsize=10)
        ax.set_xlabel("micro-batch of the trace")
        ax.set_ylabel("tokens (token-expert rows)")
    for ax, _ in stacks:
        labels = ax.get_legend_handles_labels()[1]
        rows = 1 if len(labels) <= 10 else 2
        ax.set_ylim(0, max(top, 1) * (1.12 + 0.08 * rows))  # head room for the legend of ranks
        if len(labels) <= 20:
            ax.legend([h for h in ax.get_legend_handles_labels()[0]], [lab.split()[1] for lab in labels],
                      title="rank (rank 0 at the bottom of the stack)", title_fontsize=7, fontsize=7,
                      ncol=-(-len(labels) // rows), loc="upper center", frameon=False, columnspacing=0.9,
                      handlelength=1.2)

    _policy_panel(axes[2], {name: run.token_straggler.mean(axis=1) for name, run in runs.items()},
                  "token straggler (max − mean over ranks),\nmean over layers", "tokens (log scale above 10)")
    axes[2].set_yscale("symlog", linthresh=10)
    _policy_panel(axes[3], {name: run.gemm_straggler.mean(axis=1) for name, run in runs.items()},
                  "GEMM straggler (cost model, max − mean over ranks),\nmean over layers", "µs")
    expert = {name: run.expert_us.mean(axis=1) for name, run in runs.items() if run.expert_us is not None}
    scale, unit = (1e3, "ms") if expert and max(v.max() for v in expert.values()) >= 1e3 else (1.0, "µs")
    _policy_panel(axes[4], {name: values / scale for name, values in expert.items()},
                  "expert time with copies\n(slowest forward + slowest backward), mean over layers", unit)

    _over_ideal_panel(axes[5], runs)
    if d_sweep:
        ax = axes[6]
        for name, by_d in d_sweep.items():
            ds = sorted(by_d)
            ax.plot(ds, [by_d[d] for d in ds], marker="o", label=_label(name), color=POLICY_COLORS.get(name))
        ax.set_title("token straggler vs dynamic experts per rank D,\nmean over micro-batches and layers",
                     fontsize=10)
        ax.set_xlabel("D (dynamic experts per rank)")
        ax.set_ylabel("tokens (log scale above 10)")
        ax.set_yscale("symlog", linthresh=10)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    return fig


# the excess over the ideal, in the order it is drawn: (key of `PolicyRun.over_ideal` / `metrics`, label, colour)
_EXCESS = (("excess_pieces_us", "extra pieces", "tab:olive"), ("excess_imbalance_us", "imbalance left", "tab:red"),
           ("copy_exposed_us", "exposed copies", "tab:blue"),
           ("excess_other_us", "other (messages, gradients, re-placements)", "tab:grey"))


def _over_ideal_panel(ax, runs: dict) -> None:
    """One bar per policy with an expert time: the ideal (1) and each part of the excess, as
    multiples of the ideal; the ratio written at the bar's end. A part below 0 (a policy computing
    less than vanilla's pieces) is not drawn; the ratio is exact."""
    names = [name for name, run in runs.items() if run.over_ideal()]
    for i, name in enumerate(names):
        run = runs[name]
        parts = {**run.over_ideal(), "copy_exposed_us": float(run.copy_exposed_us.mean())}
        ideal = parts["ideal_time_us"]
        ax.barh(i, 1.0, color="lightgrey", label="ideal (perfect balance, no transfers)" if i == 0 else None)
        left = 1.0
        for key, label, colour in _EXCESS:
            width = max(parts[key], 0.0) / ideal
            ax.barh(i, width, left=left, color=colour, label=label if i == 0 else None)
            left += width
        ax.text(left, i, f" {parts['time_over_ideal']:.3f}", va="center", fontsize=8)
    ax.set_yticks(range(len(names)), [_label(name) for name in names], fontsize=8)
    ax.set_title("expert time over the ideal, and where the excess goes,\nmean over micro-batches and layers",
                 fontsize=10)
    ax.set_xlabel("× ideal expert time")
    ax.grid(alpha=0.3, axis="x")
    if names:
        ax.set_xlim(0, max(runs[n].over_ideal()["time_over_ideal"] for n in names) * 1.15)
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2, frameon=False)


def _policy_panel(ax, series: dict, title: str, ylabel: str) -> None:
    """One line per policy over the trace's micro-batches: ``series`` {policy: float [steps]}."""
    for name, values in series.items():
        ax.plot(values, label=_label(name), **_line(name))
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("micro-batch of the trace")
    ax.set_ylabel(ylabel)
    if series:
        ax.legend(fontsize=8)


def plot(path: str, runs: dict, d_sweep: Optional[dict] = None, layer: int = 0, title: str = "") -> None:
    """Write :func:`figure` to ``path`` (PNG)."""
    plt = pyplot()
    fig = figure(runs, d_sweep, layer, title)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_measured(path: str, rows: np.ndarray, title: str = "") -> None:
    """Predicted against measured expert-stage makespan per micro-batch (`measured.predicted_and_measured`
    rows ``[K, 5]``), with the line of a perfect model."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5.5, 5))
    predicted, measured = rows[:, 3] / 1e3, rows[:, 4] / 1e3
    ax.scatter(measured, predicted, s=12)
    top = max(float(measured.max(initial=0)), float(predicted.max(initial=0)), 1e-3) * 1.05
    ax.plot([0, top], [0, top], color="grey", lw=1, label="model = measured")
    ax.set_xlim(0, top)
    ax.set_ylim(0, top)
    ax.set_xlabel("measured makespan (ms): slowest rank, stage fwd + bwd")
    ax.set_ylabel("time model's makespan of the same plan (ms)")
    ax.set_title(title, fontsize=9)
    ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
