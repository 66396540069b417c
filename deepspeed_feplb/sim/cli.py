"""``python -m deepspeed_feplb simulate ...``::

    python -m deepspeed_feplb simulate --trace T.npz --ranks-per-node G --nodes N \\
        --dynamic-experts D --policies vanilla,fastermoe,eplb,feplb --json OUT.json \\
        [--dump-plans PLANS.npz] [--plot OUT.png] [--markdown OUT.md]

OUT.json: ``{"policies": {name: {"token_straggler", "token_max_over_mean", "gemm_straggler_us",
"reduction_vs_vanilla", ...}}, "setup": {...}, "trace": {...}, "d_sweep": {...}}``.
PLANS.npz (feplb): ``moves`` int64 [M, 6] = (step, layer, expert, home_rank, helper_rank, tokens)
and ``rank_tokens`` int64 [steps, layers, ranks].
"""
from __future__ import annotations

import json
import math
import sys

import numpy as np

__all__ = ["add_parser", "run_simulate"]


def add_parser(subparsers) -> None:
    """Register ``simulate`` on an argparse sub-parsers object."""
    p = subparsers.add_parser("simulate", help="replay a routing trace through balancing policies")
    p.add_argument("--trace", required=True, help="trace .npz: counts int64 [steps, layers, src_ranks, experts] (docs/ARCHITECTURE.md)")
    p.add_argument("--ranks-per-node", type=int, required=True, help="G: ranks per NVLink domain")
    p.add_argument("--nodes", type=int, default=1, help="N: nodes in the EP group")
    p.add_argument("--dynamic-experts", type=int, default=4, help="D: dynamic experts per rank")
    p.add_argument("--policies", default="vanilla,fastermoe,eplb,feplb-paper,feplb",
                   help="comma list of vanilla,fastermoe,eplb,feplb-paper,feplb,milp")
    p.add_argument("--json", required=True, help="write the metrics here")
    p.add_argument("--dump-plans", help="write feplb's moves and rank tokens here (.npz)")
    p.add_argument("--plot", help="write figures here (.png)")
    p.add_argument("--markdown", help="also write the markdown table here")
    p.add_argument("--max-helpers", type=int, default=2)
    p.add_argument("--chunk-align", type=int, default=8, help="tokens; chunks are multiples of it")
    p.add_argument("--ce-budget", default="auto",
                   help="hard cap on weight bytes per rank and micro-batch: auto | inf (no cap: the time model "
                        "decides) | bytes")
    p.add_argument("--micro-batches-per-step", type=int, default=1, metavar="M",
                   help="consecutive micro-batches of the trace that form one optimizer step (gradient "
                        "accumulation); weight copies kept with --residency step last that long")
    p.add_argument("--residency", default="step", choices=("step", "micro_batch"),
                   help="feplb's weight residency: keep copies on helpers for the step, or copy every micro-batch")
    p.add_argument("--max-resident", type=int, default=8,
                   help="weight copies a rank keeps per layer with --residency step")
    p.add_argument("--profile", default="h100", help="cost profile: h100 | h200 | cpu (measured now)")
    p.add_argument("--hidden", type=int, help="expert hidden size (default: the trace's, else 6144)")
    p.add_argument("--ffn-hidden", type=int, help="expert FFN size (default: the trace's, else 2048)")
    p.add_argument("--expert-mats", type=int, default=3, help="3 for gated (SwiGLU) experts, 2 for MLP")
    p.add_argument("--eplb-redundant", type=int, help="EPLB redundant experts (default: one per rank)")
    p.add_argument("--eplb-interval", type=int, default=20, help="steps between EPLB re-placements")
    p.add_argument("--placement", default="auto", choices=("auto", "on", "off"),
                   help="feplb's cross-node placement layer (auto: on when nodes > 1)")
    p.add_argument("--placement-interval", type=int, default=20)
    p.add_argument("--sweep-d", help="comma list of D for the straggler-vs-D figure "
                                     "(default with --plot: 0,1,2,4,... up to experts per rank)")
    p.add_argument("--steps", type=int, help="only the first STEPS micro-batches")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=run_simulate)



def _parse_budget(text: str):
    if text in ("auto", "inf"):
        return text
    value = float(text)
    return "inf" if math.isinf(value) else value


def _setup(args, trace, D):
    from deepspeed_feplb.plan.cost import ExpertShape
    from deepspeed_feplb.sim.calibrate import get_profile
    from .policies import SimSetup

    hidden = args.hidden or trace.hidden or 6144
    ffn = args.ffn_hidden or trace.ffn_hidden or 2048
    shape = ExpertShape(hidden=hidden, ffn_hidden=ffn, mats=args.expert_mats)
    profile = get_profile(args.profile, shape if args.profile != "cpu" else None)
    return SimSetup(ranks_per_node=args.ranks_per_node, nodes=args.nodes, experts=trace.experts,
                    dynamic_experts=D, max_helpers=args.max_helpers, chunk_align=args.chunk_align,
                    shape=shape, profile=profile, ce_budget=_parse_budget(args.ce_budget),
                    eplb_redundant=args.eplb_redundant, eplb_interval=args.eplb_interval,
                    placement=args.placement, placement_interval=args.placement_interval,
                    micro_batches_per_step=args.micro_batches_per_step, residency=args.residency,
                    max_resident=args.max_resident)


def run_simulate(args) -> int:
    from dataclasses import asdict, replace

    from .report import markdown_table, plot
    from .simulate import simulate
    from deepspeed_feplb.trace.format import load_trace

    trace = load_trace(args.trace)
    if args.steps:
        trace = trace.with_counts(trace.counts[: args.steps])
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    setup = _setup(args, trace, args.dynamic_experts)
    result = simulate(trace, setup, policies, progress=not args.no_progress,
                      keep_moves=bool(args.dump_plans))
    metrics = result.metrics()
    d_sweep = None
    if args.sweep_d or args.plot:
        E_local = setup.experts_per_rank
        if args.sweep_d:
            ds = sorted({int(x) for x in args.sweep_d.split(",")})
        else:
            ds = sorted({0, *[2 ** i for i in range(0, 16) if 2 ** i <= E_local], E_local})
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
        "trace": {"path": str(args.trace), "steps": trace.steps, "layers": trace.layers,
                  "src_ranks": trace.src_ranks, "experts": trace.experts, "top_k": trace.top_k,
                  "source": trace.source},
        "averaging": "means over all (micro-batch, layer) pairs; reductions are 1 - ratio of means",
    }
    if d_sweep:
        out["d_sweep"] = {p: {str(d): v for d, v in by_d.items()} for p, by_d in d_sweep.items()}
    with open(args.json, "w") as f:
        json.dump(out, f, indent=2, default=float)
    table = markdown_table(out["policies"])
    print(table)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(table + "\n")
    if args.dump_plans:
        run = result.runs.get("feplb")
        if run is None:
            print("--dump-plans: the feplb policy was not simulated; nothing dumped", file=sys.stderr)
        else:
            with open(args.dump_plans, "wb") as f:
                np.savez_compressed(f, moves=run.moves.reshape(-1, 6), rank_tokens=run.rank_tokens)
    if args.plot:
        plot(args.plot, result.runs, d_sweep)
    return 0
