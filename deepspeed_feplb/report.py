"""`python -m deepspeed_feplb report`: PNG plots of recorded FEPLB training stats.

Input: the per-step JSON lines that the examples print (``{"step": ..., "loss": ...,
"layers": {layer: {metric: value}}}``; other lines of a log are skipped, so a whole
``deepspeed ... | tee run.log`` works), and/or a directory written by DeepSpeed's CSV monitor
(files ``FEPLB_<layer>_<metric>.csv``, as `deepspeed_feplb.integration.monitor` writes them).

Output, in ``--out``: ``stragglers.png`` (token straggler before/after balancing and measured
GEMM straggler per layer over steps), ``migration.png`` (migrated tokens and bytes, plan latency,
fallbacks) and, when the log has losses, ``loss.png``; plus ``summary.json`` with the per-layer
means that the plots show.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import re
from pathlib import Path

STRAGGLER_METRICS = ("token_straggler_before", "token_straggler_after", "gemm_straggler_ms")
MIGRATION_METRICS = ("migrated_tokens", "migrated_bytes", "plan_latency_us", "fallbacks")


def read_jsonl(path: str | os.PathLike) -> tuple[dict, dict]:
    """-> (series ``{layer: {metric: [(step, value)]}}``, loss ``{step: value}``) from JSON lines."""
    series: dict = {}
    loss: dict = {}
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line.startswith("{"):
                continue
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if not isinstance(record, dict) or "step" not in record:
                continue
            step = record["step"]
            if "loss" in record:
                loss[step] = record["loss"]
            for layer, metrics in (record.get("layers") or {}).items():
                for metric, value in metrics.items():
                    series.setdefault(layer, {}).setdefault(metric, []).append((step, float(value)))
    return series, loss


_CSV_NAME = re.compile(r"^FEPLB_(?P<layer>.+)_(?P<metric>" + "|".join(
    STRAGGLER_METRICS + MIGRATION_METRICS + ("gemm_max_ms", "warm_start_token_straggler")) + r")\.csv$")


def read_csv_dir(directory: str | os.PathLike) -> dict:
    """-> series ``{layer: {metric: [(step, value)]}}`` from a CSV-monitor directory (searched recursively)."""
    series: dict = {}
    for path in sorted(Path(directory).rglob("FEPLB_*.csv")):
        match = _CSV_NAME.match(path.name)
        if not match:
            continue
        with open(path) as f:
            rows = list(csv.reader(f))[1:]
        series.setdefault(match["layer"], {})[match["metric"]] = [(int(float(s)), float(v)) for s, v in rows]
    return series


def summary(series: dict) -> dict:
    """Per-layer means of every metric (sums for token/byte counts and fallbacks)."""
    out = {}
    for layer, metrics in series.items():
        entry = {}
        for metric, points in metrics.items():
            values = [v for _, v in points]
            if metric in ("migrated_tokens", "migrated_bytes", "fallbacks"):
                entry[f"{metric}_total"] = sum(values)
            else:
                entry[f"{metric}_mean"] = sum(values) / len(values) if values else 0.0
        if entry.get("token_straggler_before_mean"):
            entry["token_straggler_reduction"] = 1 - entry["token_straggler_after_mean"] / entry["token_straggler_before_mean"]
        out[layer] = entry
    return out


def plot(series: dict, loss: dict, out_dir: str | os.PathLike) -> list[str]:
    """Write the PNGs and summary.json into ``out_dir``; returns the written paths."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    layers = sorted(series)

    def panel_grid(metrics, title, filename, ylabels):
        fig, axes = plt.subplots(1, len(metrics), figsize=(5 * len(metrics), 3.6), squeeze=False)
        for ax, group, ylabel in zip(axes[0], metrics, ylabels):
            for layer in layers:
                for metric in group:
                    points = series[layer].get(metric)
                    if points:
                        steps, values = zip(*points)
                        style = "--" if metric.endswith("before") else "-"
                        ax.plot(steps, values, style, marker=".", label=f"{layer} {metric}")
            ax.set_xlabel("step")
            ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3)
            if ax.lines:
                ax.legend(fontsize=7)
        fig.suptitle(title)
        fig.tight_layout()
        path = out / filename
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(str(path))

    panel_grid([("token_straggler_before", "token_straggler_after", "warm_start_token_straggler"),
                ("gemm_straggler_ms", )], "FEPLB stragglers per layer (max - mean over the domain)",
               "stragglers.png", ["token straggler (tokens)", "measured GEMM straggler (ms)"])
    panel_grid([("migrated_tokens", ), ("migrated_bytes", ), ("plan_latency_us", ), ("fallbacks", )],
               "FEPLB migration per step", "migration.png", ["tokens", "bytes", "plan latency (us)", "fallbacks"])
    if loss:
        fig, ax = plt.subplots(figsize=(5, 3.6))
        steps = sorted(loss)
        ax.plot(steps, [loss[s] for s in steps], marker=".")
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.grid(alpha=0.3)
        fig.tight_layout()
        path = out / "loss.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(str(path))
    path = out / "summary.json"
    path.write_text(json.dumps(summary(series), indent=2, sort_keys=True) + "\n")
    written.append(str(path))
    return written


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``python -m deepspeed_feplb report INPUT... --out DIR``."""
    parser = subparsers.add_parser(
        "report", help="plot recorded FEPLB training stats (JSON lines or a CSV-monitor directory) as PNGs",
        description="Plot FEPLB per-step stats: token and GEMM stragglers, migration, plan latency, loss.")
    parser.add_argument("inputs", nargs="+", metavar="INPUT",
                        help="a log with the examples' per-step JSON lines, or a DeepSpeed CSV-monitor directory")
    parser.add_argument("--out", default="feplb_report", metavar="DIR", help="output directory (default: %(default)s)")
    parser.set_defaults(func=_report_command)
    return parser


def _report_command(args) -> int:
    series: dict = {}
    loss: dict = {}
    for source in args.inputs:
        if os.path.isdir(source):
            found = read_csv_dir(source)
        else:
            found, found_loss = read_jsonl(source)
            loss.update(found_loss)
        for layer, metrics in found.items():
            series.setdefault(layer, {}).update(metrics)
    if not series:
        print(f"report: no FEPLB stats found in {', '.join(args.inputs)}")
        return 1
    for path in plot(series, loss, args.out):
        print(path)
    for layer, entry in summary(series).items():
        before, after = entry.get("token_straggler_before_mean"), entry.get("token_straggler_after_mean")
        line = f"{layer}: GEMM straggler {entry.get('gemm_straggler_ms_mean', 0):.2f} ms"
        if before is not None:
            line = f"{layer}: token straggler {before:.1f} -> {after:.1f}, " + line.split(": ", 1)[1]
        print(line)
    return 0
