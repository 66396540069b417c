"""``python -m deepspeed_feplb simulate ...``::

    python -m deepspeed_feplb simulate --trace T.npz --ranks-per-node G --nodes N \\
        --dynamic-experts D --policies vanilla,fastermoe,eplb,feplb \\
        [--json OUT.json] [--markdown OUT.md] [--plot OUT.png] [--dump-plans PLANS.npz]

The markdown table is printed; the files are optional. Bad input (a missing, corrupt or malformed
trace, one that does not fit G x N ranks, options that contradict each other, a missing optional
package) ends in one line on stderr and exit status 2.

OUT.json: ``{"policies": {name: {"token_straggler", "token_max_over_mean", "gemm_straggler_us",
"reduction_vs_vanilla", ...}}, "setup": {...}, "trace": {...}, "d_sweep": {...}}``.
PLANS.npz (feplb): ``moves`` int64 [M, 6] = (micro_batch, layer, expert, home_rank, helper_rank, tokens)
and ``rank_tokens`` int64 [micro_batches, layers, ranks].
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
from pathlib import Path

import numpy as np

from deepspeed_feplb.config import SERVE_PARTS_MAX, FEPLBConfig
from deepspeed_feplb.exits import InputFileError, fail
from deepspeed_feplb.plan.cost import GemmProfile
from deepspeed_feplb.plan.policy import GPU_TILE_ROWS, HOST_CHUNK_ROWS, chunk_align_rows, serves_on_arrival
from deepspeed_feplb.plan.residency import AUTO_FREE_SHARE
from deepspeed_feplb.trace.cli import whole_number

__all__ = ["add_parser", "run_simulate"]

POLICY_NAMES = ("vanilla", "fastermoe", "eplb", "feplb-paper", "feplb", "milp")
SHIPPED_TRACES = Path(__file__).resolve().parents[1] / "trace" / "data"

_EXAMPLE = """example (a trace recorded from real training, 8 ranks and 64 experts, shipped with the package;
priced as GLM-5-like 6144 x 2048 experts on H100s, since the recording model's own experts are tiny):
  python -m deepspeed_feplb simulate --trace stdlib_moe_ep8_4k.npz \\
      --ranks-per-node 8 --hidden 6144 --ffn-hidden 2048 --micro-batches-per-step 8 \\
      --json out.json --markdown out.md --plot out.png

The trace's experts must split evenly over the G x N ranks, and G x N must divide its source ranks
(unless it has one): stdlib_moe_trace.npz (2 source ranks, 16 experts) fits 1 or 2 ranks,
stdlib_moe_ep8_4k.npz and stdlib_moe_ep8_32k.npz (8 source ranks, 64 experts) 1, 2, 4 or 8."""



_RUNTIME = FEPLBConfig()  # the runtime's defaults are the simulator's
_ON_OFF = {True: "on", False: "off", "auto": "auto"}
_SETTING = {v: k for k, v in _ON_OFF.items()}
_PLACEMENT_DEFAULT = _ON_OFF[_RUNTIME.placement.enabled]

def _budget(text: str):
    """argparse type of --ce-budget: "auto", "inf" or a number of bytes >= 0."""
    if text in ("auto", "inf"):
        return text
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not auto, inf or a number of bytes") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text} is negative")
    return "inf" if math.isinf(value) else value


def _amount(text: str, unit: str, auto: bool = False):
    """A finite number of ``unit`` >= 0 (or "auto" where ``auto``), for argparse."""
    if auto and text == "auto":
        return text
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {'auto or ' if auto else ''}a number of {unit}") from None
    if not 0 <= value < math.inf:
        raise argparse.ArgumentTypeError(f"{text} is not a finite number of {unit} >= 0")
    return value


def _rows(text: str):
    """argparse type of --chunk-align: "auto" or a whole number of rows >= 1."""
    return text if text == "auto" else whole_number(1)(text)


def _slots(text: str):
    """argparse type of --redundant-per-rank: "auto" or a whole number of slots >= 0."""
    return text if text == "auto" else whole_number(0)(text)


def replica_slots(setting, nodes: int, on_gpu: bool) -> int:
    """Replica slots per rank of ``--redundant-per-rank`` over ``nodes`` nodes: "auto" is the
    runtime's where memory allows, 1 where the EP group spans nodes and (``on_gpu``: the profile is
    a GPU's) the experts compute on GPUs."""
    return int(nodes > 1 and on_gpu) if setting == "auto" else setting


def _microseconds(text: str) -> float:
    """argparse type of --replica-host-us: a finite number of µs >= 0."""
    return _amount(text, "µs")


def _mib(text: str):
    """argparse type of --resident-budget-mb: "auto" or a finite number of MiB >= 0."""
    return _amount(text, "MiB", auto=True)


def _ratio(text: str) -> float:
    """argparse type of --max-rows-over-mean: a finite number >= 1."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value >= 1 or math.isinf(value):
        raise argparse.ArgumentTypeError(f"{text} is not a finite number >= 1 (1.0: balance rows as far as possible)")
    return value


def _d_list(text: str) -> list:
    """argparse type of --sweep-d: comma list of whole numbers >= 0."""
    try:
        values = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma list of whole numbers, e.g. 0,1,2,4") from None
    if not values or values[0] < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give whole numbers >= 0, e.g. 0,1,2,4")
    return values


def add_parser(subparsers) -> None:
    """Register ``simulate`` on an argparse sub-parsers object."""
    p = subparsers.add_parser(
        "simulate", help="replay a routing trace through balancing policies",
        description="Replay a routing trace through load-balancing policies (vanilla, FasterMoE, EPLB,\n"
                    "FEPLB) and measure token and GEMM stragglers, expert time and copies. Prints the\n"
                    "markdown table; --json, --markdown, --plot and --dump-plans also write files.",
        epilog=_EXAMPLE, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", required=True, metavar="T.npz",
                   help="routing trace: an .npz with counts int64 [micro_batches, layers, src_ranks, experts] (tokens "
                        "that "
                        "each source rank's router sent to each expert, per micro-batch) and optional scalars "
                        "top_k, hidden, ffn_hidden; real traces ship in deepspeed_feplb/trace/data/ (give "
                        "a shipped one by its file name from any folder), "
                        "`python -m deepspeed_feplb trace` writes synthetic ones")
    p.add_argument("--ranks-per-node", type=whole_number(1), required=True, metavar="G",
                   help="ranks per node (one NVLink / copy-engine domain; migration stays inside it)")
    p.add_argument("--nodes", type=whole_number(1), default=1, metavar="N",
                   help="nodes in the expert-parallel group: G x N ranks in all (default: %(default)s)")
    p.add_argument("--dynamic-experts", type=whole_number(0), default=_RUNTIME.dynamic_experts_per_rank, metavar="D",
                   help="dynamic experts per rank: each rank's D hottest experts of a micro-batch may be split "
                        "over helpers (default: %(default)s)")
    p.add_argument("--policies", default="vanilla,fastermoe,eplb,feplb-paper,feplb", metavar="LIST",
                   help="comma list of " + ", ".join(POLICY_NAMES) + " (milp: the exact optimum, small "
                        "cases only, needs highspy); vanilla always runs (default: %(default)s)")
    p.add_argument("--json", metavar="OUT.json", help="write the metrics of every policy, the setup and the trace here")
    p.add_argument("--markdown", metavar="OUT.md", help="write the markdown table (and its notes) here")
    p.add_argument("--plot", metavar="OUT.png",
                   help="write the figures here (needs matplotlib: pip install -e '.[plot]'); also runs the D "
                        "sweep of --sweep-d")
    p.add_argument("--dump-plans", metavar="PLANS.npz",
                   help="write feplb's moves int64 [M, 6] = (micro_batch, layer, expert, home_rank, helper_rank, "
                        "tokens) and rank_tokens int64 [micro_batches, layers, ranks] here")
    p.add_argument("--max-helpers", type=whole_number(1),
                   default=FEPLBConfig.model_fields["max_helpers_per_expert"].default, metavar="H",
                   help="most helper ranks that one dynamic expert's tokens are split over (default: %(default)s)")
    p.add_argument("--chunk-align", type=_rows, default=_RUNTIME.chunk_align_tokens, metavar="TOKENS",
                   help="token chunks moved to helpers are multiples of this many tokens (feplb.chunk_align_tokens; "
                        f"auto: {GPU_TILE_ROWS}, the GPU's GEMM row tile, with a GPU profile, {HOST_CHUNK_ROWS} with "
                        "--profile cpu or --max-rows-over-mean) (default: %(default)s, the runtime's)")
    p.add_argument("--serve-parts", type=whole_number(1, SERVE_PARTS_MAX), default=_RUNTIME.serve_parts,
                   metavar="PARTS",
                   help="a helper computes one home's chunks in up to PARTS parts and returns each part's results "
                        "as it is done (feplb.serve_parts; 1: one part) (default: %(default)s)")
    p.add_argument("--serve-part-rows", type=whole_number(1), default=_RUNTIME.serve_part_rows, metavar="ROWS",
                   help="fewest rows of one such part (feplb.serve_part_rows) (default: %(default)s)")
    p.add_argument("--serve-on-arrival", default=_ON_OFF[_RUNTIME.serve_on_arrival], choices=("auto", "on", "off"),
                   help="a helper computes each chunk it serves as soon as it is in, ahead of its own rows "
                        "(feplb.serve_on_arrival; auto: on with a GPU profile, off with --profile cpu) "
                        "(default: %(default)s, the runtime's)")
    p.add_argument("--ce-budget", type=_budget, default="auto", metavar="BYTES",
                   help="hard cap on the expert-weight bytes a rank copies per micro-batch: auto or inf (no cap: "
                        "the time model keeps only copies that pay off) or bytes (default: %(default)s)")
    p.add_argument("--micro-batches-per-step", type=whole_number(1), default=1, metavar="M",
                   help="consecutive micro-batches of the trace that form one optimizer step (gradient "
                        "accumulation); weight copies kept with --residency step last that long (default: %(default)s)")
    p.add_argument("--residency", default="step", choices=("step", "micro_batch"),
                   help="feplb's weight residency: keep copies on helpers for the optimizer step, or copy every "
                        "micro-batch (default: %(default)s)")
    p.add_argument("--keep-copies-across-steps", default=_ON_OFF[_RUNTIME.keep_copies_across_steps],
                   choices=("on", "off"),
                   help="with --residency step, the copies a step's last micro-batch used stay for the next step, "
                        "their weights sent after the optimizer step outside the expert time "
                        "(feplb.keep_copies_across_steps) (default: %(default)s, the runtime's)")
    p.add_argument("--max-resident", type=whole_number(0), default=_RUNTIME.max_resident_experts, metavar="COPIES",
                   help="weight copies a rank keeps per layer with --residency step (default: %(default)s)")
    p.add_argument("--resident-budget-mb", type=_mib, default="auto", metavar="MIB",
                   help="feplb.resident_budget_mb: MiB of weight copies (weights and an fp32 gradient each) a "
                        f"rank keeps over all layers with --residency step; auto: {AUTO_FREE_SHARE * 100:g}%% of the "
                        f"device memory left free at the start, taken as {GemmProfile.FREE_SHARE * 100:g}%% of the "
                        "profile's (the runtime measures it), none for the cpu profile (default: %(default)s)")
    p.add_argument("--max-rows-over-mean", type=_ratio, default=None, metavar="RATIO",
                   help="feplb's bound on rows before time (feplb.max_rows_over_mean): no rank computes more than "
                        "RATIO x the mean rows per rank of all G x N ranks where the dynamic experts can reach "
                        "it; the time model picks the fastest plan among those within it (default: none, time "
                        "alone)")
    p.add_argument("--profile", default="h100", choices=("h100", "h200", "cpu", "gpu"),
                   help="GEMM and copy cost profile: h100, h200, cpu (measured now on this machine's CPU, "
                        "for a trace recorded on CPU) or gpu (expert GEMMs measured now on this machine's "
                        "CUDA device in bf16, copy rates of h200) (default: %(default)s)")
    p.add_argument("--message-us", type=float, default=None, metavar="US",
                   help="fixed latency of one phase-2 message in the time model, in µs (default: the profile's, 0; "
                        "cuda_ce measured about 230 on an H200 machine; with --compare-measured it also replaces the "
                        "latency a recorded trace holds)")
    p.add_argument("--hidden", type=whole_number(1),
                   help="expert hidden size for the cost model (default: the trace's hidden, else 6144)")
    p.add_argument("--ffn-hidden", type=whole_number(1),
                   help="expert FFN size for the cost model (default: the trace's ffn_hidden, else 2048)")
    p.add_argument("--expert-mats", type=int, default=3, choices=(2, 3),
                   help="weight matrices per expert: 3 for gated (SwiGLU) experts, 2 for a plain MLP "
                        "(default: %(default)s)")
    p.add_argument("--eplb-redundant", type=whole_number(0), metavar="SLOTS",
                   help="redundant expert slots of EPLB in the whole group (default: one per rank)")
    p.add_argument("--eplb-interval", type=whole_number(1), default=20, metavar="MICRO_BATCHES",
                   help="micro-batches between EPLB re-placements (default: %(default)s)")
    p.add_argument("--placement", default=_PLACEMENT_DEFAULT, choices=("auto", "on", "off"),
                   help="feplb's cross-node expert placement layer, which moves experts' homes between nodes "
                        "(feplb.placement.enabled; auto: on when nodes > 1) (default: %(default)s, the runtime's)")
    p.add_argument("--placement-interval", type=whole_number(1), metavar="MICRO_BATCHES",
                   help="micro-batches between re-placements of experts across nodes by feplb's placement layer "
                        "(default: the runtime's feplb.placement.interval_steps "
                        f"({_RUNTIME.placement.interval_steps}) x --micro-batches-per-step)")
    p.add_argument("--placement-horizon", type=whole_number(1), metavar="MICRO_BATCHES",
                   help="micro-batches over which the placement layer counts a re-placement's gain against the "
                        "time its expert transfers take (default: measured: --placement-interval / (1 - the share of "
                        "predicted gains that later micro-batches showed))")
    p.add_argument("--placement-warmup", type=whole_number(1), metavar="MICRO_BATCHES",
                   help="micro-batches before the first re-placement decision of EPLB and of feplb's placement "
                        "layer, taken at the end of the optimizer step that reaches it (default: one step, "
                        "--micro-batches-per-step); replicas alone (--placement off) are first chosen after the "
                        "second micro-batch, mid-step, as the runtime does")
    p.add_argument("--redundant-per-rank", type=_slots, default=_RUNTIME.placement.redundant_experts_per_rank,
                   metavar="SLOTS",
                   help="replica slots per rank of feplb's cross-node layer (feplb.placement."
                        "redundant_experts_per_rank; with --placement off every expert keeps its home and only "
                        "replicas are chosen): hot experts get replicas on other nodes "
                        "where the gain pays for sending their gradients home and the stepped weights back at every "
                        "optimizer step (over the profile's inter-node bandwidth, counted in the expert time) and "
                        "their creation; each micro-batch splits a replicated expert's rows between the nodes; "
                        "auto: 1 when nodes > 1, with a GPU profile (default: %(default)s, the runtime's)")
    p.add_argument("--replica-host-us", type=_microseconds, default=0.0, metavar="US",
                   help="host time per micro-batch and layer that holding any replica costs beyond its exchange (what "
                        "a runtime with feplb.fixed_costs \"measured\" measures: each forward's split, the refreshes "
                        "and relays); the replica choice prices it and the expert time of each micro-batch with "
                        "replicas held includes it (default: %(default)s: none)")
    p.add_argument("--sweep-d", type=_d_list, metavar="LIST",
                   help="comma list of D for the token-straggler-vs-D figure and the d_sweep of OUT.json "
                        "(default with --plot: 0, 1, 2, 4, ... up to the experts per rank)")
    p.add_argument("--merge-sources", action="store_true",
                   help="sum the trace's source ranks into one before replaying, so that it fits any number of "
                        "ranks that divides its experts (e.g. an 8-rank recording on 16 ranks: rows per rank halve); "
                        "drops which rank sent which row, which only fastermoe uses")
    p.add_argument("--micro-batches", "--steps", type=whole_number(1), metavar="N", dest="micro_batches",
                   help="replay only the first N micro-batches of the trace (default: all; --steps: its old name)")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bar on stderr (there is none either when tqdm is not installed)")
    p.add_argument("--compare-measured", action="store_true",
                   help="for a trace recorded by a FEPLB run (feplb.stats.record_trace): replay its own plans "
                        "through the time model and compare each micro-batch's predicted expert-stage makespan "
                        "with the measured one (the slowest rank's forward plus the slowest rank's backward "
                        "stage time), with the profile's compute costs and with the run's own fitted ones; prints "
                        "the errors, writes them to OUT.json as measured_vs_model, and with --plot draws predicted "
                        "against measured into OUT_measured_*.png")
    p.set_defaults(func=run_simulate)


def _fail(message: str):
    """One line on stderr and exit status 2, as argparse does for a bad option; no traceback."""
    fail("simulate", message)


def _shipped_traces() -> str:
    """The shipped traces' paths, relative to the working directory when they are below it."""
    paths = [os.path.relpath(p) if not os.path.relpath(p).startswith("..") else str(p)
             for p in sorted(SHIPPED_TRACES.glob("*.npz"))]
    return ", ".join(paths) or "none found"


def _load_fitting_trace(args):
    """The trace of ``--trace`` (cut to ``--micro-batches``); fails in one line when it is missing,
    unreadable or malformed (`trace.format.load_trace` says what is wrong), or does not fit G x N
    ranks (what `trace.format.fold_sources` and contiguous placement accept: experts divisible by
    the ranks, source ranks equal to 1 or a multiple of them)."""
    from deepspeed_feplb.trace.format import load_trace

    path = args.trace
    if not os.path.isfile(path) and (SHIPPED_TRACES / os.path.basename(path)).is_file():
        path = str(SHIPPED_TRACES / os.path.basename(path))  # a shipped trace by its name, from any folder
    if not os.path.isfile(path):
        _fail(f"trace file {path} not found; shipped traces: {_shipped_traces()}; or write one with "
              "`python -m deepspeed_feplb trace --out T.npz`")
    try:
        trace = load_trace(path)
    except InputFileError as e:
        _fail(str(e))
    if args.micro_batches:
        trace = trace.with_counts(trace.counts[: args.micro_batches])
    if getattr(args, "merge_sources", False):
        trace = trace.with_counts(trace.counts.sum(axis=2, keepdims=True))
    G, N = args.ranks_per_node, args.nodes
    ranks, S, E = G * N, trace.src_ranks, trace.experts

    def fits(r: int) -> bool:
        return E % r == 0 and (S == 1 or S % r == 0)

    if not fits(ranks):
        problems = []
        if E % ranks:
            problems.append(f"its {E} experts do not split evenly over {ranks} ranks")
        if S != 1 and S % ranks:
            problems.append(f"its {S} source ranks cannot be folded onto {ranks} ranks (a trace replays on its "
                            "source ranks or a divisor of them, never on more)")
        sizes = [r for r in range(1, E + 1) if fits(r)]
        keep_g = [r for r in sizes if r % G == 0]  # the most ranks with the nodes as they are, if any
        hint = (f"--ranks-per-node {G} --nodes {keep_g[-1] // G}" if keep_g
                else f"--ranks-per-node {sizes[-1]} --nodes 1")
        _fail(f"trace {path} does not fit --ranks-per-node {G} --nodes {N} ({ranks} ranks): {'; '.join(problems)}; "
              f"ranks that fit: {', '.join(map(str, sizes))}, e.g. {hint}")
    return trace


def _check_outputs(args, policies: list) -> None:
    """Fail before the simulation, not after it, on what would stop it at the end."""
    outputs = [p for p in (args.json, args.markdown, args.plot, args.dump_plans) if p]
    for path in outputs:
        folder = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(folder):
            _fail(f"cannot write {path}: folder {folder} does not exist")
    if args.dump_plans and "feplb" not in policies:
        _fail("--dump-plans writes feplb's plans: add feplb to --policies")
    unknown = [p for p in policies if p not in POLICY_NAMES]
    if unknown or not policies:
        _fail(f"unknown policy {', '.join(map(repr, unknown)) or '(none given)'} in --policies; "
              f"choose from {','.join(POLICY_NAMES)}")
    if args.plot:
        from .report import pyplot
        try:
            pyplot()
        except ImportError as e:
            _fail(f"--plot: {e}")
    if "milp" in policies:
        from .oracle import require_highspy
        try:
            require_highspy()
        except ImportError as e:
            _fail(f"--policies milp: {e}")


def _have(module: str) -> bool:
    try:
        __import__(module)
    except ImportError:
        return False
    return True


def _setup(args, trace, D):
    from deepspeed_feplb.plan.cost import ExpertShape
    from deepspeed_feplb.sim.calibrate import get_profile

    from .policies import SimSetup

    hidden = args.hidden or trace.hidden or 6144
    ffn = args.ffn_hidden or trace.ffn_hidden or 2048
    shape = ExpertShape(hidden=hidden, ffn_hidden=ffn, mats=args.expert_mats)
    profile = get_profile(args.profile, shape if args.profile != "cpu" else None)
    if args.message_us is not None:
        if args.message_us < 0:
            _fail(f"--message-us must be >= 0 (got {args.message_us:g})")
        from deepspeed_feplb.plan.cost import scaled
        profile = scaled(profile, message_us=args.message_us)
    return SimSetup(ranks_per_node=args.ranks_per_node, nodes=args.nodes, experts=trace.experts,
                    dynamic_experts=D, max_helpers=args.max_helpers,
                    chunk_align=chunk_align_rows(args.chunk_align, profile.name != "cpu", args.max_rows_over_mean),
                    shape=shape, profile=profile, ce_budget=args.ce_budget,
                    eplb_redundant=args.eplb_redundant, eplb_interval=args.eplb_interval,
                    placement=args.placement,
                    placement_interval=args.placement_interval or _RUNTIME.placement.interval_steps
                    * args.micro_batches_per_step,
                    placement_horizon=args.placement_horizon, placement_warmup=args.placement_warmup,
                    micro_batches_per_step=args.micro_batches_per_step, residency=args.residency,
                    max_resident=args.max_resident, resident_budget_mb=args.resident_budget_mb,
                    max_rows_over_mean=args.max_rows_over_mean,
                    redundant_per_rank=replica_slots(args.redundant_per_rank, args.nodes, profile.name != "cpu"),
                    replica_host_us=args.replica_host_us,
                    serve_parts=args.serve_parts, serve_part_rows=args.serve_part_rows,
                    serve_on_arrival=serves_on_arrival(_SETTING[args.serve_on_arrival], profile.name != "cpu"),
                    keep_copies_across_steps=args.keep_copies_across_steps == "on")


def _compare_measured(args, trace, setup) -> dict:
    """`sim.measured.compare_measured` of ``trace`` under the setup's time model, with the profile's
    compute costs and (where the trace has them) with the run's own fitted costs; prints a line
    each and, with ``--plot``, draws predicted against measured per micro-batch."""
    from deepspeed_feplb.plan.timeline import TimeModel

    from .measured import cpu_share, errors, over_ideal, predicted_and_measured
    model = TimeModel.of(setup.shape, setup.profile)
    out = {"profile": setup.profile.name, "model": dataclasses.asdict(model), "cpu_share": cpu_share(trace)}
    if out["cpu_share"] is not None:
        print(f"the recorded ranks used {out['cpu_share']:.0%} of a core during their stage (median); the time model "
              "has each rank on its own processor")
    for recorded, key, what in ((False, "profile_costs", f"profile {setup.profile.name}'s compute costs"),
                                (True, "recorded_costs", "the run's own fitted costs, as its planner had them")):
        try:
            rows = predicted_and_measured(trace, model, setup.ranks_per_node, recorded_costs=recorded,
                                          dynamic_experts=setup.dynamic_experts,
                                          recorded_message_us=args.message_us is None)
            figures = errors(rows)
        except ValueError as e:
            if recorded:  # a run that fitted nothing (fixed_costs "ignore") has no recorded costs
                continue
            _fail(f"--compare-measured: {args.trace}: {e}")
        out[key] = figures
        print(f"time model vs measured, {what} ({figures['micro_batches']} micro-batches x domains): median "
              f"|error| {figures['median_abs_rel_error']:.1%}, p90 {figures['p90_abs_rel_error']:.1%}, median signed "
              f"{figures['median_rel_error']:+.1%} (negative: the model predicts less time than was measured)")
        if recorded:  # the ideal under the run's own costs
            split = out["over_ideal"] = over_ideal(rows)
            print(f"measured expert stage over the ideal (every rank at the mean rows, computed at home, the run's "
                  f"own costs): {split['measured_time_us']:,.0f} µs / {split['ideal_time_us']:,.0f} µs = "
                  f"{split['time_over_ideal']:.3f}; excess: imbalance {split['imbalance_us']:,.0f} µs (slowest rank "
                  f"over the mean), rest {split['rest_us']:,.0f} µs (pieces, copies, messages, host work)")
        if args.plot:
            from .report import plot_measured
            stem, _ = os.path.splitext(args.plot)
            plot_measured(f"{stem}_measured_{key}.png", rows, title=f"{os.path.basename(args.trace)}: {what}")
    return out


def run_simulate(args) -> int:
    from dataclasses import asdict, replace

    from .report import markdown_table, plot
    from .simulate import simulate

    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    _check_outputs(args, policies)
    trace = _load_fitting_trace(args)
    setup = _setup(args, trace, args.dynamic_experts)
    try:
        setup.check()  # options that contradict each other (replica slots without the placement layer)
    except ValueError as e:
        _fail(str(e))
    result = simulate(trace, setup, policies, progress=not args.no_progress and _have("tqdm"),
                      keep_moves=bool(args.dump_plans))
    metrics = result.metrics()
    d_sweep = None
    if args.sweep_d or args.plot:
        E_local = setup.experts_per_rank
        ds = args.sweep_d or sorted({0, *[2 ** i for i in range(0, 16) if 2 ** i <= E_local], E_local})
        swept = [p for p in ("feplb-paper", "feplb") if p in policies]
        if swept:
            d_sweep = {p: {} for p in swept}
            for D in ds:
                res = simulate(trace, replace(setup, dynamic_experts=D), swept)
                for p in swept:
                    d_sweep[p][D] = float(res.runs[p].token_straggler.mean())
    setup_json = asdict(setup)
    out = {
        "policies": {p: metrics[p] for p in ["vanilla", *policies] if p in metrics},
        "setup": setup_json,
        "trace": {"path": str(args.trace), "micro_batches": trace.micro_batches, "layers": trace.layers,
                  "src_ranks": trace.src_ranks, "experts": trace.experts, "top_k": trace.top_k,
                  "source": trace.source},
        "averaging": "means over all (micro-batch, layer) pairs; reductions are 1 - ratio of means",
    }
    if d_sweep:
        out["d_sweep"] = {p: {str(d): v for d, v in by_d.items()} for p, by_d in d_sweep.items()}
    if args.compare_measured:
        out["measured_vs_model"] = _compare_measured(args, trace, setup)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2, default=float)
    table = markdown_table(out["policies"], setup_json)
    print(table)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(table + "\n")
    if args.dump_plans:
        run = result.runs["feplb"]
        with open(args.dump_plans, "wb") as f:
            # the file contract keeps its name
            np.savez_compressed(f, moves=run.moves.reshape(-1, 6), rank_tokens=run.rank_rows)
    if args.plot:
        title = (f"{os.path.basename(args.trace)}: {setup.ranks} ranks ({setup.ranks_per_node} per node x "
                 f"{setup.nodes}), D = {setup.dynamic_experts}, cost profile {setup.profile.name}, "
                 f"{trace.micro_batches} micro-batches x {trace.layers} layer{'s' if trace.layers != 1 else ''}")
        plot(args.plot, result.runs, d_sweep, title=title)
    return 0
