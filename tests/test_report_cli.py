"""The first hour of a new user: help texts of `simulate`, `trace` and `report`, one-line errors
(exit status 2, no traceback) for missing optional packages and for traces that do not fit, the
`report` summary (summary.md, means over steps, steps as logged) and readable figures (legends,
integer step ticks, log plan latency, scaled bytes)."""
import argparse
import json
import sys
from argparse import Namespace

import numpy as np
import pytest

from deepspeed_feplb import report
from deepspeed_feplb.__main__ import main
from deepspeed_feplb.sim import cli as sim_cli
from deepspeed_feplb.sim.policies import SimSetup
from deepspeed_feplb.sim.report import markdown_table
from deepspeed_feplb.trace import cli as trace_cli
from deepspeed_feplb.trace.format import Trace, fold_sources, save_trace
from deepspeed_feplb.trace.generators import GENERATORS, no_aux_trace


def _subparser(module, name):
    parser = argparse.ArgumentParser(prog="x")
    module.add_parser(parser.add_subparsers())
    return parser._subparsers._group_actions[0].choices[name]


def _help_problems(parser) -> list:
    """Options of ``parser`` without a help text, with a default their help does not state, or
    pointing at a document that is not in the repository."""
    problems = []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        name = action.option_strings[0] if action.option_strings else action.dest
        text = action.help or ""
        if not text.strip():
            problems.append(f"{name}: no help")
        if "DESIGN" in text or "shared/" in text:
            problems.append(f"{name}: points at a document outside the repository")
        stated = "%(default)s" in text or "default" in text
        if action.default not in (None, False) and not stated:
            problems.append(f"{name}: default {action.default!r} not stated")
    return problems


def test_every_option_has_help_with_its_default():
    bad = argparse.ArgumentParser()
    bad.add_argument("--steps", type=int, default=3)
    bad.add_argument("--trace", help="see DESIGN §4")
    assert len(_help_problems(bad)) == 3  # the checker sees missing help, an unstated default, DESIGN
    for module, name in ((sim_cli, "simulate"), (trace_cli, "trace"), (report, "report")):
        parser = _subparser(module, name)
        assert _help_problems(parser) == [], name
        assert "DESIGN" not in parser.format_help()
    trace_help = _subparser(sim_cli, "simulate")._option_string_actions["--trace"].help
    assert "counts int64 [micro_batches, layers, src_ranks, experts]" in trace_help and "top_k" in trace_help
    assert set(trace_cli.KINDS) == set(GENERATORS)


@pytest.fixture
def small_trace(tmp_path):
    path = tmp_path / "t.npz"
    save_trace(path, no_aux_trace(3, 1, ranks=4, experts=8, tokens_per_rank=64, seed=3))
    return str(path)


def _usage_error(capsys) -> str:
    """The error line of a failure that prints its command's usage first, as a bad option does."""
    err = capsys.readouterr().err
    assert "Traceback" not in err and "usage: " in err and "--out DIR" in err, err
    return [line for line in err.splitlines() if "error: " in line][0]


def _error_line(capsys) -> str:
    """The one line that a clean failure leaves on stderr."""
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    return lines[0]


def _simulate(*argv):
    return main(["simulate", *argv, "--no-progress"])


def test_simulate_prints_its_table_and_writes_only_the_files_asked_for(small_trace, tmp_path, capsys):
    md = tmp_path / "o.md"
    assert _simulate("--trace", small_trace, "--ranks-per-node", "4", "--markdown", str(md)) == 0
    assert md.read_text().startswith("| policy |") and not list(tmp_path.glob("*.json"))
    capsys.readouterr()
    assert _simulate("--trace", small_trace, "--ranks-per-node", "4") == 0  # no file: the table alone
    assert "| policy |" in capsys.readouterr().out


@pytest.mark.parametrize("argv, words", [
    (["--trace", "missing.npz", "--ranks-per-node", "4"], ["missing.npz", "not found", "stdlib_moe_ep8_4k.npz"]),
    (["--ranks-per-node", "3"], ["8 experts", "3 ranks", "--ranks-per-node 4"]),
    (["--ranks-per-node", "4", "--nodes", "2"], ["4 source ranks", "8 ranks", "--ranks-per-node 4"]),
    (["--ranks-per-node", "4", "--policies", "vanilla,fepbl"], ["'fepbl'", "feplb-paper"]),
])
def test_simulate_fails_in_one_line(small_trace, tmp_path, capsys, argv, words):
    if "--trace" not in argv:
        argv = ["--trace", small_trace, *argv]
    out = tmp_path / "o.json"
    with pytest.raises(SystemExit) as exit_:
        _simulate(*argv, "--json", str(out))
    assert exit_.value.code == 2
    line = _error_line(capsys)
    for word in words:
        assert word in line, line
    assert not out.exists()


def test_trace_fit_check_agrees_with_what_the_simulator_accepts(tmp_path):
    """The CLI's check rejects exactly the (source ranks, experts, ranks) that folding and
    placement reject."""
    checked = 0
    for S in (1, 2, 3, 4, 6, 8):
        for E in (4, 6, 8, 12):
            path = tmp_path / f"s{S}e{E}.npz"
            save_trace(path, Trace(np.ones((1, 1, S, E), np.int64)))
            for R in range(1, 9):
                try:
                    fold_sources(np.ones((1, 1, S, E), np.int64), R)
                    SimSetup(R, 1, E).check()
                    simulator_accepts = True
                except ValueError:
                    simulator_accepts = False
                try:
                    sim_cli._load_fitting_trace(Namespace(trace=str(path), micro_batches=None, ranks_per_node=R,
                                                          nodes=1))
                    cli_accepts = True
                except SystemExit:
                    cli_accepts = False
                assert cli_accepts == simulator_accepts, (S, E, R)
                checked += not simulator_accepts
    assert checked > 10  # the grid holds many misfits


def test_shipped_traces_fit_their_documented_ranks(capsys):
    for name, ranks in (("stdlib_moe_trace.npz", 2), ("stdlib_moe_ep8_4k.npz", 8), ("stdlib_moe_ep8_32k.npz", 8)):
        path = str(sim_cli.SHIPPED_TRACES / name)
        trace = sim_cli._load_fitting_trace(Namespace(trace=path, micro_batches=2, ranks_per_node=ranks, nodes=1))
        assert trace.steps == 2
        with pytest.raises(SystemExit):
            sim_cli._load_fitting_trace(Namespace(trace=path, micro_batches=2, ranks_per_node=2 * ranks, nodes=1))
        assert f"--ranks-per-node {ranks} " in _error_line(capsys)


def test_missing_optional_packages_name_the_install(small_trace, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now raises ImportError
    out = tmp_path / "o.json"
    with pytest.raises(SystemExit) as exit_:
        _simulate("--trace", small_trace, "--ranks-per-node", "4", "--json", str(out),
                  "--plot", str(tmp_path / "o.png"))
    assert exit_.value.code == 2 and "pip install -e '.[plot]'" in _error_line(capsys)
    assert not out.exists()  # checked before the simulation, not after it

    log = tmp_path / "run.log"
    log.write_text(json.dumps({"step": 1, "layers": {"moe": {"gemm_straggler_ms": 1.0}}}) + "\n")
    assert main(["report", str(log), "--out", str(tmp_path / "plots")]) == 0  # the summaries without figures
    assert "pip install -e '.[plot]'" in _error_line(capsys)
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == ["summary.json", "summary.md"]

    monkeypatch.setitem(sys.modules, "highspy", None)
    with pytest.raises(SystemExit) as exit_:
        _simulate("--trace", small_trace, "--ranks-per-node", "4", "--json", str(out), "--policies", "milp")
    line = _error_line(capsys)
    assert exit_.value.code == 2 and "pip install highspy" in line and "'.[test]'" in line
    from deepspeed_feplb.plan.policy import PlanConstraints
    from deepspeed_feplb.sim.oracle import optimal_max_load
    with pytest.raises(ImportError, match="pip install highspy"):
        optimal_max_load(np.array([[9, 1], [1, 1]]), PlanConstraints(dynamic_experts=1, max_helpers=1))

    monkeypatch.setitem(sys.modules, "tqdm", None)  # no progress bar, the run goes on
    assert main(["simulate", "--trace", small_trace, "--ranks-per-node", "4", "--json", str(out)]) == 0
    assert "vanilla" in json.loads(out.read_text())["policies"]


def test_report_fails_in_one_line_on_a_missing_input(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["report", str(tmp_path / "nope.log"), "--out", str(tmp_path / "plots")])
    line = _usage_error(capsys)
    assert exit_.value.code == 2 and "report: error: " in line and "nope.log not found" in line


def test_markdown_notes_negative_gemm_reduction():
    setup = {"profile": {"name": "h100"}, "shape": {"hidden": 64, "ffn_hidden": 256}}
    fine = {"vanilla": {"reduction_vs_vanilla": 0.0, "gemm_reduction_vs_vanilla": 0.0},
            "feplb": {"reduction_vs_vanilla": 0.5, "gemm_reduction_vs_vanilla": 0.4},
            "fastermoe": {"reduction_vs_vanilla": -0.003, "gemm_reduction_vs_vanilla": -0.004}}  # worse in both
    assert "Note" not in markdown_table(fine, setup)
    worse = {**fine, "feplb-paper": {"reduction_vs_vanilla": 0.96, "gemm_reduction_vs_vanilla": -3.05}}
    table = markdown_table(worse, setup)
    note = table.split("\n\n", 1)[1]
    assert note.startswith("Note:") and "(feplb-paper)" in note
    assert "`h100`" in note and "hidden 64" in note and "--profile cpu" in note
    assert "-305.0%" in table


def _log(path, first_step, layers=("1.moe", "2.moe"), steps=4):
    lines = ["[launcher] not a record"]
    for i in range(steps):
        step = first_step + i
        lines.append(json.dumps({"step": step, "loss": 5.0 - i, "layers": {layer: {
            "token_straggler_before": 40.0 + i, "token_straggler_after": 4.0, "warm_start_token_straggler": 9.0,
            "gemm_straggler_ms": 1.0 + i, "migrated_tokens": 100, "migrated_bytes": 3_000_000 * (i + 1),
            "weight_bytes": 1_000_000, "plan_latency_us": 200_000.0 if i == 0 else 60.0, "fallbacks": 0}
            for layer in layers}}))
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("first_step", [0, 1])
def test_report_summary_md_states_means_over_steps_as_logged(tmp_path, capsys, first_step):
    log = _log(tmp_path / "run.log", first_step)
    out = tmp_path / "plots"
    assert main(["report", str(log), "--out", str(out)]) == 0
    stdout = capsys.readouterr().out
    assert "means over steps" in stdout and "1.moe: token straggler 41.5 -> 4.0 tokens" in stdout
    md = (out / "summary.md").read_text()
    assert "## Per-layer means over steps" in md and "mean over the logged steps" in md
    last = first_step + 3
    assert f"| steps logged (first–last) | | 4 ({first_step}–{last}) | 4 ({first_step}–{last}) |" in md
    assert f"at step {first_step}," in md  # loss steps as logged too
    assert "| token straggler before balancing | tokens | 41.5 | 41.5 |" in md
    assert "| data moved | MB / step | 7.50 | 7.50 |" in md  # bytes shown in MB
    assert "warm-start" in md and "previous micro-batch's routing" in md  # explained, not a raw key
    assert "median over steps" in md and "60.0 µs" in md
    for name in ("stragglers.png", "migration.png", "loss.png"):
        assert f"]({name})" in md and (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["1.moe"]["gemm_straggler_ms_mean"] == pytest.approx(2.5)
    assert summary["1.moe"]["migrated_tokens_total"] == 400 and summary["1.moe"]["migrated_tokens_mean"] == 100


def test_report_puts_several_runs_side_by_side(tmp_path, capsys):
    """FEPLB on and off as two inputs: one column per run, never one merged column (which showed the
    off run's GEMM straggler as the on run's)."""
    def log(name, gemm, step_ms):
        lines = [json.dumps({"step": s, "loss": 5.0 - s, "step_ms": step_ms + s, "tokens": 4300, "layers": {"moe": {
            "gemm_straggler_ms": gemm, "token_straggler_before": 40.0, "token_straggler_after": 4.0}}})
            for s in range(1, 5)]
        (tmp_path / name).write_text("\n".join(lines) + "\n")
        return str(tmp_path / name)
    on, off = log("on.log", 1.31, 40.0), log("off.log", 8.79, 50.0)
    out = tmp_path / "plots"
    assert main(["report", on, off, "--out", str(out), "--label", "FEPLB", "--label", "DeepSpeed"]) == 0
    assert "FEPLB: 4 steps, step time 43.0 ms" in capsys.readouterr().out
    md = (out / "summary.md").read_text()
    assert "| metric | unit | layer FEPLB: moe | layer DeepSpeed: moe |" in md
    assert "| measured GEMM straggler | ms | 1.31 | 8.79 |" in md
    assert "| FEPLB | `" + on + "` | 4 | 43.0 ms | 100,000 | 4 → 1 |" in md and "| DeepSpeed |" in md
    summary = json.loads((out / "summary.json").read_text())
    assert summary["FEPLB: moe"]["gemm_straggler_ms_mean"] == 1.31
    assert summary["DeepSpeed: moe"]["gemm_straggler_ms_mean"] == 8.79
    assert main(["report", on, off, "--out", str(out)]) == 0  # labels: the file names
    assert "layer on.log: moe | layer off.log: moe" in (out / "summary.md").read_text()
    with pytest.raises(SystemExit) as exit_:
        main(["report", on, off, "--out", str(out), "--label", "FEPLB"])
    assert exit_.value.code == 2 and "1 --label value(s) for 2 inputs" in _usage_error(capsys)
    assert json.loads((out / "summary.json").read_text())["runs"][0]["step_ms_median"] == 43.0  # the run table


def _integral(values) -> bool:
    return all(float(v).is_integer() for v in values)


def test_report_figures_are_readable(tmp_path):
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()  # the tick check sees fractional ticks on a default axis
    ax.plot([0, 1, 2, 3], [1, 2, 3, 4])
    assert not _integral(ax.get_xticks())
    plt.close(fig)

    series, loss = report.read_jsonl(_log(tmp_path / "run.log", 1, layers=("moe",)))
    figs = report.figures(series, loss)
    assert set(figs) == {"stragglers.png", "migration.png", "loss.png"}
    axes = {ax.get_title(): ax for fig in figs.values() for ax in fig.axes if ax.get_title()}
    for title, ax in axes.items():
        assert _integral(ax.get_xticks()), title
        legend = ax.get_legend()
        texts = [t.get_text() for t in legend.get_texts()] if legend else []
        raw_keys = [key for key in report.METRIC_INFO if "_" in key]  # "fallbacks" is a word too
        assert not any(key in text for text in texts for key in raw_keys), (title, texts)
    tokens = next(ax for title, ax in axes.items() if title.startswith("token straggler"))
    assert {t.get_text() for t in tokens.get_legend().get_texts()} == {
        "layer moe: before balancing", "layer moe: after balancing", "layer moe: warm-start plan (see summary.md)"}
    latency = next(ax for t, ax in axes.items() if t.startswith("plan latency"))
    assert latency.get_yscale() == "symlog"  # a latency of 0 stays on the axis
    assert next(ax for t, ax in axes.items() if t.startswith("data moved")).get_ylabel() == "MB"
    assert _integral(next(ax for t, ax in axes.items() if t.startswith("fallbacks")).get_yticks())
    for fig in figs.values():
        plt.close(fig)


def test_simulator_figure_has_rank_legends_and_integer_ticks(small_trace):
    import matplotlib.pyplot as plt

    from deepspeed_feplb.sim.report import figure
    from deepspeed_feplb.sim.simulate import simulate
    from deepspeed_feplb.trace.format import load_trace

    trace = load_trace(small_trace)
    result = simulate(trace, SimSetup(4, 1, 8, dynamic_experts=1), ["feplb"])
    fig = figure(result.runs, {"feplb": {0: 5.0, 1: 2.0, 2: 1.0}})
    axes = [ax for ax in fig.axes if ax.get_title()]
    assert len(axes) == 7  # with the expert time over the ideal
    for ax in axes:
        assert _integral(ax.get_xticks()), ax.get_title()
    for ax in axes[:2]:  # stacked panels: one legend entry per rank
        legend = ax.get_legend()
        assert legend is not None and [t.get_text() for t in legend.get_texts()] == ["0", "1", "2", "3"]
        assert "rank" in legend.get_title().get_text()
    labels = [t.get_text() for t in axes[2].get_legend().get_texts()]
    assert labels == ["vanilla (no balancing)", "feplb"]
    plt.close(fig)


def test_a_wrong_option_is_named_with_the_commands_usage(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["report", str(tmp_path / "run.log"), "--outdir", str(tmp_path)])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "report: error: unrecognized arguments: --outdir" in err, err
    assert "--out DIR" in err  # report's usage, not the top-level one


def test_a_shipped_trace_is_found_by_its_name_from_any_folder(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert _simulate("--trace", "stdlib_moe_ep8_4k.npz", "--ranks-per-node", "8", "--steps", "1",
                     "--policies", "vanilla") == 0
    assert "| vanilla |" in capsys.readouterr().out


def test_simulate_compares_the_model_with_a_recorded_run(tmp_path, capsys):
    from test_sim import _recorded_trace

    from deepspeed_feplb.trace.format import Trace, save_trace
    recorded, plain = tmp_path / "recorded.npz", tmp_path / "plain.npz"
    save_trace(recorded, _recorded_trace(1.0))
    save_trace(plain, Trace(_recorded_trace(1.0).counts))
    out = tmp_path / "sim.json"
    assert main(["simulate", "--trace", str(recorded), "--ranks-per-node", "2", "--dynamic-experts", "1",
                 "--policies", "feplb", "--compare-measured", "--json", str(out), "--no-progress"]) == 0
    measured = json.loads(out.read_text())["measured_vs_model"]
    assert measured["profile"] == "h100" and measured["profile_costs"]["micro_batches"] == 2
    assert measured["recorded_costs"]["micro_batches"] == 2  # the run's own piece and row costs
    assert measured["recorded_costs"] != measured["profile_costs"]
    printed = capsys.readouterr().out
    assert "time model vs measured, profile h100's compute costs (2 micro-batches x domains): median |error|" in printed
    assert "time model vs measured, the run's own fitted costs, as its planner had them" in printed
    assert measured["over_ideal"]["time_over_ideal"] == pytest.approx(90.0 / 75.0)  # (see test_sim's)
    assert "measured expert stage over the ideal" in printed
    with pytest.raises(SystemExit) as exit_:
        main(["simulate", "--trace", str(plain), "--ranks-per-node", "2", "--policies", "feplb",
              "--compare-measured", "--no-progress"])
    assert exit_.value.code == 2 and "no runtime record" in _error_line(capsys)
