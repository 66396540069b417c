"""`python -m deepspeed_feplb report`: figures and a summary of recorded FEPLB training stats.

Input: the per-step JSON lines that the examples print (``{"step": ..., "loss": ...,
"layers": {layer: {metric: value}}}``; other lines of a log are skipped, so a whole
``deepspeed ... | tee run.log`` works), and/or a directory written by DeepSpeed's CSV monitor
(files ``FEPLB_<layer>_<metric>.csv``, as `deepspeed_feplb.integration.monitor` writes them).
Steps are shown as logged (no renumbering). Several inputs are separate runs (e.g. FEPLB on and
off), shown side by side: their layers become ``<run>: <layer>`` (run = ``--label`` or the file
name) and summary.md gets a table of the runs (steps, median step time, loss). An input the
report cannot use (a record that is cut or holds a value of the wrong type or beyond any real
one, a CSV line that is not ``step,value``, a file without stats) ends the command in one line
naming the file, the line and the key, exit status 2.

Output, in ``--out``: ``stragglers.png`` (token straggler before/after balancing and measured
GEMM straggler per layer over steps), ``migration.png`` (migrated tokens and bytes, plan latency,
fallbacks), ``loss.png`` when the log has losses; ``summary.json`` with the per-layer means over
steps that the figures show (key: the layer, ``<run>: <layer>`` with several inputs) and ``runs``,
the run table (per input: steps, median step time, tokens/s, first and last loss); and
``summary.md``, one page with the same means, what each metric
means and the figures. Each step's value is what the monitor logged for it: the mean over the
step's micro-batches (stragglers, plan latency) or their sum (tokens, bytes, copies, fallbacks).
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import os
import re
import reprlib
import sys
from pathlib import Path

from deepspeed_feplb.exits import InputFileError
from deepspeed_feplb.trace.format import MAX_COUNT

STRAGGLER_METRICS = ("token_straggler_before", "token_straggler_after", "gemm_straggler_ms")
MIGRATION_METRICS = ("migrated_tokens", "migrated_bytes", "plan_latency_us", "fallbacks")
# What the monitor logs besides those (integration/monitor.py, METRICS and the pipeline's warm start).
OTHER_METRICS = ("gemm_max_ms", "warm_start_token_straggler", "weight_bytes", "weight_copies", "resident_hits",
                 "flushed_copies", "grad_bytes", "placement_refreshes", "placement_moved_experts", "placement_bytes",
                 "placement_replicas")
# Metrics whose per-step value is a sum over the step's micro-batches: summary.json also gives their total.
SUMMED = ("migrated_tokens", "migrated_bytes", "fallbacks", "weight_bytes", "weight_copies", "resident_hits",
          "flushed_copies", "grad_bytes", "placement_refreshes", "placement_moved_experts", "placement_bytes")

# metric -> (readable name, unit, what it is). Used for legends, table headers and summary.md.
METRIC_INFO = {
    "token_straggler_before": (
        "token straggler before balancing", "tokens",
        "max_r T_r − mean_r T_r over the ranks r of an NVLink domain, T_r the token-expert rows whose expert "
        "rank r hosts: what DeepSpeed's MoE leaves, the slowest rank's extra rows"),
    "token_straggler_after": (
        "token straggler after balancing", "tokens",
        "the same after FEPLB's plan, the rows moved to helper ranks counted on the helper"),
    "warm_start_token_straggler": (
        "warm-start plan's token straggler", "tokens",
        "pipeline engine only: the token straggler that a plan made ahead of time from the previous "
        "micro-batch's routing would have left (FEPLB plans from the current routing; this shows what planning "
        "one micro-batch early would lose)"),
    "gemm_straggler_ms": (
        "measured GEMM straggler", "ms",
        "max − mean over a domain's ranks of the measured expert-compute wall time (communication and waiting "
        "excluded)"),
    "gemm_max_ms": ("slowest rank's expert compute", "ms", "max over a domain's ranks of the measured "
                    "expert-compute wall time"),
    "migrated_tokens": ("migrated tokens", "tokens", "token-expert rows computed by a helper rank instead of the "
                        "expert's home, summed over the step's micro-batches"),
    "migrated_bytes": ("data moved", "bytes", "what the migration transport moved: rows there and results "
                       "back (forward and backward), expert weight copies and the weight-gradients sent home"),
    "weight_bytes": ("expert weights copied", "bytes", "expert weights copied to helpers (none for a helper "
                     "that kept a copy from earlier in the optimizer step)"),
    "grad_bytes": ("weight-gradients sent home", "bytes", "weight-gradients of copies, sent to the expert's home"),
    "weight_copies": ("weight copies", "copies", "expert weight copies sent to helpers"),
    "placement_refreshes": ("placement refreshes", "refreshes", "cross-node re-placements of the layer's experts "
                            "(feplb.placement) at the step's end"),
    "placement_moved_experts": ("experts moved by placement", "experts", "experts that changed rank at a "
                                "re-placement, with their parameters and optimizer state"),
    "placement_bytes": ("placement bytes", "bytes", "bytes the moved experts carried: parameters, fp32 master "
                        "copies and optimizer state"),
    "placement_replicas": ("replicas held", "replicas", "replicas of hot experts on other nodes that the layer's "
                           "EP group holds after the step (feplb.placement.redundant_experts_per_rank)"),
    "resident_hits": ("chunks from kept copies", "chunks", "chunks a helper computed with a copy kept from "
                      "earlier in the optimizer step (no copy needed)"),
    "flushed_copies": ("kept copies flushed", "copies", "kept copies whose accumulated gradients went home at "
                       "the end of the optimizer step"),
    "plan_latency_us": ("plan latency", "µs", "time to compute one micro-batch's plan; the first plan of a "
                        "process also loads the compiled planning pass, which is why the figure uses a log axis"),
    "fallbacks": ("fallbacks", "micro-batches", "micro-batches planned in-process because the scheduler "
                  "process was late or dead (summed)"),
}

AVERAGING = ("Every number is a mean over the logged steps of the per-step value; a step's value is the mean "
             "over its micro-batches and the layer's NVLink domains (stragglers, plan latency) or their sum "
             "(tokens, bytes, copies, fallbacks).")

# The package is installed from its checkout (it is not on PyPI), so the extra is named there.
PLOT_INSTALL = "pip install -e '.[plot]' in the repository checkout (or pip install matplotlib)"


def _records(path: str | os.PathLike):
    """The per-step records (JSON objects with a ``step``) of a log, each checked (`_check_record`);
    other lines are skipped, as a launcher's log holds many. A record line that does not parse is
    a corrupt file (`InputFileError`), unless it is the last line: a run still writing its log."""
    try:
        with open(path, errors="replace") as f:  # a launcher's log may hold bytes that are not UTF-8
            lines = [line.strip() for line in f]
    except OSError as e:
        raise InputFileError(f"{path}: cannot read it ({e.strerror or e})") from None
    last = max((number for number, line in enumerate(lines, 1) if line), default=0)
    for number, line in enumerate(lines, 1):
        if not line.startswith("{"):
            continue
        try:
            record = json.loads(line)
        except (ValueError, RecursionError) as e:
            if line.startswith('{"step"') and number != last:
                raise InputFileError(f"{path}: line {number}: a cut or corrupt stats record ({e})") from None
            continue  # a dict that a launcher printed, or the cut last line
        if isinstance(record, dict) and "step" in record:
            _check_record(record, f"{path}: line {number}")
            yield record


# Metrics that count rows: a value beyond MAX_COUNT (2**40) is a corrupt number, not a batch.
ROW_METRICS = ("token_straggler_before", "token_straggler_after", "warm_start_token_straggler", "migrated_tokens")


def _number(value) -> float | None:
    """``value`` as a float if it is a JSON number that fits one, else None (a bool is no number)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        return float(value)
    except OverflowError:  # an integer beyond 1e308
        return None


def _metric_problem(metric: str, value) -> str | None:
    """What is wrong with one logged value of ``metric``, or None: every metric is a finite
    number (the tables and figures compute with it), the row counts at most MAX_COUNT."""
    number = _number(value)
    if number is None or not math.isfinite(number):
        return f"is {reprlib.repr(value)}, expected a finite number"
    if metric in ROW_METRICS and not 0 <= number <= MAX_COUNT:
        return f"is {reprlib.repr(value)}, expected rows from 0 to 2**40 = {MAX_COUNT}"
    return None


def _check_record(record: dict, where: str) -> None:
    """Refuse (`InputFileError`, ``where`` names the file and line) a record whose values the report
    cannot use: a table or figure would fail on it far from the cause, or show nonsense. Keys
    other than these are not read; a null value counts as absent."""
    step = record["step"]
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise InputFileError(f"{where}: step is {reprlib.repr(step)}, expected a whole number >= 0")
    loss = record.get("loss")
    if loss is not None and _number(loss) is None:  # NaN and inf are losses (a diverged run)
        raise InputFileError(f"{where}: loss is {reprlib.repr(loss)}, expected a number")
    for key in ("step_ms", "tokens"):
        value = record.get(key)
        number = _number(value)
        if value is not None and (number is None or not 0 <= number < math.inf):
            raise InputFileError(f"{where}: {key} is {reprlib.repr(value)}, expected a finite number >= 0")
    layers = record.get("layers")
    if layers is None:
        return
    if not isinstance(layers, dict):
        raise InputFileError(f"{where}: layers is {reprlib.repr(layers)}, expected {{layer: {{metric: value}}}}")
    for layer, metrics in layers.items():
        if not isinstance(metrics, dict):
            raise InputFileError(f"{where}: layers[{reprlib.repr(layer)}] is {reprlib.repr(metrics)}, expected "
                                 "{metric: value}")
        for metric, value in metrics.items():
            problem = _metric_problem(metric, value)
            if problem:
                raise InputFileError(f"{where}: layers[{reprlib.repr(layer)}][{reprlib.repr(metric)}] {problem}")


def read_jsonl(path: str | os.PathLike) -> tuple[dict, dict]:
    """-> (series ``{layer: {metric: [(step, value)]}}``, loss ``{step: value}``) from JSON lines."""
    series: dict = {}
    loss: dict = {}
    for record in _records(path):
        step = record["step"]
        if record.get("loss") is not None:
            loss[step] = float(record["loss"])
        for layer, metrics in (record.get("layers") or {}).items():
            for metric, value in metrics.items():
                series.setdefault(layer, {}).setdefault(metric, []).append((step, float(value)))
    return series, loss


def read_step_ms(path: str | os.PathLike) -> dict:
    """-> ``{step: (wall milliseconds, tokens over all ranks or None)}`` of the records that carry
    ``step_ms`` (the examples' lines; ``tokens`` where they give it)."""
    return {r["step"]: (float(r["step_ms"]), r.get("tokens")) for r in _records(path)
            if r.get("step_ms") is not None}


def labels_for(inputs: list, given: list | None) -> list[str]:
    """One label per input: ``given`` (``--label``, one per input), else the file or folder name
    (with its position where two inputs share a name)."""
    if given:
        if len(given) != len(inputs):
            raise ValueError(f"{len(given)} --label value(s) for {len(inputs)} inputs; give one per input, "
                             "in the inputs' order")
        return list(given)
    names = [Path(source).name or str(source) for source in inputs]
    return [f"{name} ({i + 1})" if names.count(name) > 1 else name for i, name in enumerate(names)]


_CSV_NAME = re.compile(r"^FEPLB_(?P<layer>.+)_(?P<metric>" + "|".join(
    STRAGGLER_METRICS + MIGRATION_METRICS + OTHER_METRICS) + r")\.csv$")


def read_csv_dir(directory: str | os.PathLike) -> dict:
    """-> series ``{layer: {metric: [(step, value)]}}`` from a CSV-monitor directory (searched recursively)."""
    series: dict = {}
    for path in sorted(Path(directory).rglob("FEPLB_*.csv")):
        match = _CSV_NAME.match(path.name)
        if match:
            series.setdefault(match["layer"], {})[match["metric"]] = _csv_points(path, match["metric"])
    return series


def _csv_points(path: Path, metric: str) -> list:
    """``[(step, value)]`` of one CSV-monitor file (a header, then ``step,value`` lines), each value
    checked as a JSON line's is (`_metric_problem`); a line that is not one is an `InputFileError`."""
    try:
        with open(path, newline="") as f:
            rows = list(csv.reader(f))[1:]
    except (OSError, UnicodeDecodeError, csv.Error) as e:
        raise InputFileError(f"{path}: cannot read it as CSV text ({e})") from None
    points = []
    for number, row in enumerate(rows, 2):
        if not row:
            continue  # a blank line
        try:
            step, value = map(float, row)  # ValueError: not a number, or not two fields
        except ValueError:
            step = value = math.nan
        if not (step.is_integer() and step >= 0):
            raise InputFileError(f"{path}: line {number} is {reprlib.repr(row)}, expected step,value with a whole "
                                 "step >= 0")
        problem = _metric_problem(metric, value)
        if problem:
            raise InputFileError(f"{path}: line {number}: {metric} {problem}")
        points.append((int(step), value))
    return points


def summary(series: dict) -> dict:
    """Per-layer means over steps of every metric (``<metric>_mean``), the totals over steps of
    the summed ones (``<metric>_total``), and ``token_straggler_reduction`` = 1 - after / before."""
    out = {}
    for layer, metrics in series.items():
        entry = {}
        for metric, points in metrics.items():
            values = [v for _, v in points]
            if metric in SUMMED:
                entry[f"{metric}_total"] = sum(values)
            entry[f"{metric}_mean"] = sum(values) / len(values) if values else 0.0
        if entry.get("token_straggler_before_mean") and "token_straggler_after_mean" in entry:
            after, before = entry["token_straggler_after_mean"], entry["token_straggler_before_mean"]
            entry["token_straggler_reduction"] = 1 - after / before
        out[layer] = entry
    return out


def _label(metric: str) -> str:
    return METRIC_INFO.get(metric, (metric.replace("_", " "), "", ""))[0]


def _unit(metric: str) -> str:
    return METRIC_INFO.get(metric, ("", "", ""))[1]


def _bytes_unit(largest: float) -> tuple[float, str]:
    """(divisor, unit) that shows ``largest`` bytes readably (decimal units, as the examples print)."""
    for scale, unit in ((1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
        if largest >= scale:
            return scale, unit
    return 1.0, "bytes"


def pyplot():
    """matplotlib.pyplot on the Agg backend; an ImportError that names the install command if
    matplotlib is missing."""
    try:
        import matplotlib
    except ImportError:
        raise ImportError(f"the figures need matplotlib, which is not installed: {PLOT_INSTALL}") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


# Line style per metric in a panel that shows several; the colour is the layer's.
_STYLES = {"token_straggler_before": "--", "warm_start_token_straggler": ":", "weight_bytes": "--", "grad_bytes": ":"}
_SHORT = {"token_straggler_before": "before balancing", "token_straggler_after": "after balancing",
          "warm_start_token_straggler": "warm-start plan (see summary.md)", "migrated_bytes": "all data moved",
          "weight_bytes": "of which expert weights", "grad_bytes": "of which weight-gradients"}
MANY_LAYERS = 6  # above this, a panel shows the mean over layers and their min-max band, not one line per layer


def _layer_lines(series: dict, metric: str):
    """-> [(label, steps, values, band)] of one metric: one line per layer, or with more than
    MANY_LAYERS layers one line of the mean over layers and ``band`` = (min, max) per step."""
    layers = list(series)  # the order given: a run's layers sorted, runs in the inputs' order
    if len(layers) <= MANY_LAYERS:
        out = []
        for layer in layers:
            points = sorted(series[layer].get(metric, []))
            if points:
                steps, values = zip(*points)
                out.append((f"layer {layer}", list(steps), list(values), None))
        return out
    by_step: dict = {}
    for layer in layers:
        for step, value in series[layer].get(metric, []):
            by_step.setdefault(step, []).append(value)
    if not by_step:
        return []
    steps = sorted(by_step)
    return [(f"mean over {len(layers)} layers (band: min to max)", steps,
             [sum(by_step[s]) / len(by_step[s]) for s in steps],
             ([min(by_step[s]) for s in steps], [max(by_step[s]) for s in steps]))]


def figures(series: dict, loss: dict) -> dict:
    """-> ``{file name: matplotlib Figure}`` for the panels that have data (module docstring)."""
    plt = pyplot()
    from matplotlib.ticker import MaxNLocator

    layers = list(series)  # the order given: a run's layers sorted, runs in the inputs' order
    out = {}

    def has(metrics):
        return any(series[layer].get(m) for layer in layers for m in metrics)

    def draw(ax, metrics, title, ylabel, scale=1.0):
        for i, metric in enumerate(metrics):
            for j, (who, steps, values, band) in enumerate(_layer_lines(series, metric)):
                name = _SHORT.get(metric, _label(metric)) if len(metrics) > 1 else _label(metric)
                # colour per layer; with one line per metric (many layers), per metric
                color = plt.get_cmap("tab10")((i if band is not None else j) % 10)
                ax.plot(steps, [v / scale for v in values], _STYLES.get(metric, "-"), marker=".", color=color,
                        label=f"{who}: {name}")
                if band is not None:
                    ax.fill_between(steps, [v / scale for v in band[0]], [v / scale for v in band[1]],
                                    color=color, alpha=0.15 if i == 0 else 0.08, linewidth=0)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        if ax.lines:  # below the panel, where it covers no data; one column per metric
            ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), frameon=False,
                      ncol=len(metrics) if len(metrics) > 1 else min(2, len(ax.lines)))

    def grid(panels, suptitle):
        panels = [p for p in panels if has(p[0])]
        if not panels:
            return None
        cols = min(2, len(panels))
        rows = -(-len(panels) // cols)
        fig, axes = plt.subplots(rows, cols, figsize=(6.4 * cols, 5.0 * rows), squeeze=False, layout="constrained")
        for ax in axes.ravel()[len(panels):]:
            ax.set_axis_off()
        for ax, (metrics, title, ylabel, *rest) in zip(axes.ravel(), panels):
            scale = 1.0
            if ylabel == "bytes":
                scale, ylabel = _bytes_unit(max(v for layer in layers for m in metrics
                                                for _, v in series[layer].get(m, [])))
            draw(ax, metrics, title, ylabel, scale)
            for tweak in rest:
                tweak(ax)
        fig.suptitle(suptitle, fontsize=11)
        return fig

    def log_axis(ax):  # linear below 1 µs: a step that planned nothing (latency 0) stays on the axis
        ax.set_yscale("symlog", linthresh=1.0)

    def integer_axis(ax):
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylim(-0.1, max(1.0, ax.get_ylim()[1]))  # all zeros would otherwise show ticks at ±0.04

    stragglers = grid([
        (("token_straggler_before", "token_straggler_after", "warm_start_token_straggler"),
         "token straggler (max − mean over a domain's ranks)", "tokens"),
        (("gemm_straggler_ms",), "measured GEMM straggler\n(expert-compute wall time, max − mean)", "ms"),
    ], "Stragglers per step (each step: mean over its micro-batches)")
    if stragglers is not None:
        out["stragglers.png"] = stragglers
    migration = grid([
        (("migrated_tokens",), "migrated tokens (rows computed by a helper)", "tokens"),
        (("migrated_bytes", "weight_bytes", "grad_bytes"), "data moved by the migration", "bytes"),
        (("plan_latency_us",), "plan latency (log axis above 1 µs)", "µs", log_axis),
        (("fallbacks",), "fallbacks (micro-batches planned in-process)", "micro-batches", integer_axis),
    ], "FEPLB migration per step (each step: sum over its micro-batches; plan latency: mean)")
    if migration is not None:
        out["migration.png"] = migration
    if loss:
        fig, ax = plt.subplots(figsize=(6.4, 4.4), layout="constrained")
        for label, curve in per_run(loss).items():
            steps = sorted(curve)
            ax.plot(steps, [curve[s] for s in steps], marker=".", label=label or None)
        if len(per_run(loss)) > 1:
            ax.legend(fontsize=8)
        ax.set_title("training loss", fontsize=10)
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        out["loss.png"] = fig
    return out


def _format(value: float) -> str:
    if value == 0 or abs(value) >= 100:
        return f"{value:,.0f}"
    return f"{value:.{max(0, 2 - int(math.floor(math.log10(abs(value)))))}f}"


def summary_markdown(series: dict, loss: dict, figure_names=(), sources=(), runs: dict | None = None) -> str:
    """The one-page ``summary.md``: with several inputs a table of the runs (steps, median step
    time, loss); per-layer means over steps (one row per metric, one column per layer, named
    ``<run>: <layer>`` with several inputs), what each metric is, and the figures."""
    means = summary(series)
    layers = list(series)  # the order given: a run's layers sorted, runs in the inputs' order
    present = {m for metrics in series.values() for m in metrics}
    metrics = [m for m in METRIC_INFO if m in present] + sorted(present - set(METRIC_INFO))
    scale, byte_unit = _bytes_unit(max([e[f"{m}_mean"] for e in means.values() for m in metrics
                                        if _unit(m) == "bytes" and f"{m}_mean" in e] or [0]))
    lines = ["# FEPLB training report", ""]
    if sources:
        lines += ["Inputs: " + ", ".join(f"`{s}`" for s in sources) + ".", ""]
    if runs and len(runs) > 1:
        lines += ["## Runs side by side", "", "Each input is one run; its layers' columns below are named "
                  "`<run>: <layer>`. Step time: median wall time per optimizer step from the second logged step.",
                  "", "| run | input | steps | step time, median | tokens/s | loss first → last |",
                  "|---|---|---:|---:|---:|---|"]
        for row in runs.values():
            ms = "" if row["step_ms_median"] is None else f"{_format(row['step_ms_median'])} ms"
            rate = "" if row["tokens_per_s"] is None else f"{row['tokens_per_s']:,.0f}"
            first_last = "" if row["loss"] is None else f"{row['loss'][0]:.4g} → {row['loss'][1]:.4g}"
            lines.append(f"| {row['label']} | `{row['source']}` | {row['steps']} | {ms} | {rate} | {first_last} |")
        lines.append("")
    lines += ["## Per-layer means over steps", "", AVERAGING, "",
              "| metric | unit | " + " | ".join(f"layer {layer}" for layer in layers) + " |",
              "|---|---|" + "---:|" * len(layers)]
    spans = []
    for layer in layers:
        steps = sorted({s for points in series[layer].values() for s, _ in points})
        spans.append(f"{len(steps)} ({steps[0]}–{steps[-1]})" if steps else "0")
    lines.append("| steps logged (first–last) | | " + " | ".join(spans) + " |")
    for m in metrics:
        unit = byte_unit if _unit(m) == "bytes" else _unit(m)
        if m in SUMMED:
            unit += " / step"
        cells = []
        for layer in layers:
            value = means[layer].get(f"{m}_mean")
            cells.append("" if value is None else _format(value / scale if _unit(m) == "bytes" else value))
        lines.append(f"| {_label(m)} | {unit} | " + " | ".join(cells) + " |")
        if m == "token_straggler_after":
            cells = [f"{means[layer]['token_straggler_reduction']:.1%}" if "token_straggler_reduction" in means[layer]
                     else "" for layer in layers]
            lines.append("| token straggler reduction | | " + " | ".join(cells) + " |")
    if "plan_latency_us" in present:
        medians = []
        for layer in layers:
            values = sorted(v for _, v in series[layer].get("plan_latency_us", []))
            if values:
                medians.append(f"layer {layer} {_format(values[len(values) // 2])} µs")
        lines += ["", "Plan latency, median over steps (the mean includes the first plan, which also loads the "
                      "compiled planning pass): " + ", ".join(medians) + "."]
    for label, curve in per_run(loss).items():
        steps = sorted(curve)
        lines += ["", f"Loss{f' ({label})' if label else ''}: {curve[steps[0]]:.4g} at step {steps[0]}, "
                      f"{curve[steps[-1]]:.4g} at step {steps[-1]}."]
    lines += ["", "## What the numbers mean", ""]
    for m in metrics:
        name, unit, text = METRIC_INFO.get(m, (m, "", "as logged"))
        lines.append(f"* **{name}** (`{m}`{', ' + unit if unit else ''}): {text}.")
    if "token_straggler_after" in present:
        lines.append("* **token straggler reduction**: 1 − (mean after) / (mean before).")
    if figure_names:
        lines += ["", "## Figures", ""]
        for name in figure_names:
            lines += [f"[{name}]({name})", "", f"![{name}]({name})", ""]
    return "\n".join(lines).rstrip() + "\n"


def plot(series: dict, loss: dict, out_dir: str | os.PathLike, sources=(), draw: bool = True,
         runs: dict | None = None) -> list[str]:
    """Write the PNGs (with ``draw``: needs matplotlib), summary.json and summary.md into
    ``out_dir``; returns the written paths. ``runs``: `run_table` rows for summary.md."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    drawn = figures(series, loss) if draw else {}
    for name, fig in drawn.items():
        path = out / name
        fig.savefig(path, dpi=110)
        pyplot().close(fig)
        written.append(str(path))
    path = out / "summary.json"
    path.write_text(json.dumps({**summary(series), **({"runs": list(runs.values())} if runs else {})}, indent=2,
                               sort_keys=True) + "\n")
    written.append(str(path))
    path = out / "summary.md"
    path.write_text(summary_markdown(series, loss, list(drawn), sources, runs))
    written.append(str(path))
    return written


def per_run(loss: dict) -> dict:
    """``{run label: {step: loss}}`` from one run's ``{step: loss}`` (label "") or several runs'."""
    if loss and all(isinstance(v, dict) for v in loss.values()):
        return loss
    return {"": loss} if loss else {}


def run_table(label: str, source: str, loss: dict, step_ms: dict) -> dict:
    """One input's row of summary.md's run table: steps, median step time (from the second logged
    step: the first holds start-up), tokens per second at that median (where the lines give their
    tokens), first and last loss. ``step_ms``: `read_step_ms`."""
    steps = sorted(set(loss) | set(step_ms))
    timed = [step_ms[s] for s in sorted(step_ms)[1:]] or list(step_ms.values())
    times = sorted(ms for ms, _ in timed)
    median = times[len(times) // 2] if times else None
    tokens = sorted(t for _, t in timed if isinstance(t, (int, float)))
    return {"label": label, "source": str(source), "steps": len(steps), "step_ms_median": median,
            "tokens_per_s": tokens[len(tokens) // 2] / median * 1e3 if tokens and median else None,
            "loss": (loss[min(loss)], loss[max(loss)]) if loss else None}


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``python -m deepspeed_feplb report INPUT... --out DIR``."""
    parser = subparsers.add_parser(
        "report", help="plot recorded FEPLB training stats (JSON lines or a CSV-monitor directory) as PNGs",
        description="Plot FEPLB per-step stats (token and GEMM stragglers, migration, plan latency, loss) and "
                    "write summary.json and summary.md with the per-layer means over steps. The figures need "
                    "matplotlib (pip install -e '.[plot]'); without it only summary.json and summary.md are written.")
    parser.add_argument("inputs", nargs="+", metavar="INPUT",
                        help="a log with the examples' per-step JSON lines, or a DeepSpeed CSV-monitor directory; "
                             "several inputs are separate runs, compared side by side (e.g. FEPLB on and off): "
                             "one column per run and layer, one line per run and layer in the figures")
    parser.add_argument("--label", action="append", metavar="NAME",
                        help="a run's name in tables and figures, once per input in their order "
                             "(default: the input's file or folder name)")
    parser.add_argument("--out", default="feplb_report", metavar="DIR", help="output directory (default: %(default)s)")
    parser.set_defaults(func=_report_command, fail=parser.error)
    return parser


def _report_command(args) -> int:
    # a bad input ends as a bad option does: the command's usage, one error line, exit status 2
    missing = [source for source in args.inputs if not os.path.exists(source)]
    if missing:
        args.fail(f"{', '.join(missing)} not found; give a log with the examples' JSON lines or a CSV-monitor "
                  "directory")
    try:
        labels = labels_for(args.inputs, args.label)
    except ValueError as e:
        args.fail(str(e))
    several = len(args.inputs) > 1
    series: dict = {}
    losses: dict = {}
    runs: dict = {}
    for label, source in zip(labels, args.inputs):  # a file the readers refuse ends the command (InputFileError)
        found_loss, step_ms = {}, {}
        if os.path.isdir(source):
            found = read_csv_dir(source)
            if not found:
                raise InputFileError(f"{source}: no FEPLB_<layer>_<metric>.csv file of DeepSpeed's CSV monitor in it")
        else:
            (found, found_loss), step_ms = read_jsonl(source), read_step_ms(source)
            if not (found or found_loss or step_ms):
                raise InputFileError(f"{source}: no per-step stats in it (JSON lines with a \"step\" and its "
                                     "\"layers\", \"loss\" or \"step_ms\", as the examples print)")
        prefix = f"{label}: " if several else ""  # runs side by side, never merged into one column
        for layer in sorted(found):
            series.setdefault(prefix + layer, {}).update(found[layer])
        if found_loss:
            losses[label] = found_loss
        runs[label] = run_table(label, source, found_loss, step_ms)
    if not series:
        raise InputFileError(f"{', '.join(args.inputs)}: no FEPLB layer stats (the \"layers\" of the JSON lines) "
                             "to plot")
    draw = True
    try:
        pyplot()
    except ImportError as e:
        draw = False
        print(f"report: {e}; writing summary.json and summary.md only", file=sys.stderr)
    loss = losses if several else next(iter(losses.values()), {})
    for path in plot(series, loss, args.out, args.inputs, draw, runs):
        print(path)
    if several:
        print("runs (step time: median from the second logged step):")
        for row in runs.values():
            ms = "no step times" if row["step_ms_median"] is None else f"step time {row['step_ms_median']:.1f} ms"
            print(f"{row['label']}: {row['steps']} steps, {ms}")
    print("per-layer means over steps (each step: mean over its micro-batches):")
    for layer, entry in summary(series).items():
        parts = []
        before, after = entry.get("token_straggler_before_mean"), entry.get("token_straggler_after_mean")
        if before is not None and after is not None:
            parts.append(f"token straggler {before:.1f} -> {after:.1f} tokens")
        if "warm_start_token_straggler_mean" in entry:
            parts.append(f"warm-start plan {entry['warm_start_token_straggler_mean']:.1f} tokens")
        if "gemm_straggler_ms_mean" in entry:
            parts.append(f"measured GEMM straggler {entry['gemm_straggler_ms_mean']:.2f} ms")
        print(f"{layer}: " + (", ".join(parts) or "no straggler stats"))
    return 0
