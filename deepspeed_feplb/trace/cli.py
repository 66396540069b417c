"""``python -m deepspeed_feplb trace ...``: write a synthetic routing trace
(``--kind noaux|zipf|dirichlet|biased|lplb``) or import a Megatron-Core router_trace
(``--megatron DIR_OR_FILES``), in the ``.npz`` format of `format`. Bad input ends in one line on
stderr and exit status 2."""
from __future__ import annotations

import argparse
import os

__all__ = ["add_parser", "run_trace"]

KINDS = ("noaux", "zipf", "dirichlet", "biased", "lplb")


def whole_number(low: int, high: int | None = None):
    """argparse type: an int >= ``low`` (and <= ``high``) (argparse prints the message and exits
    with status 2)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{value} is below {low}")
        if high is not None and value > high:
            raise argparse.ArgumentTypeError(f"{value} is above {high}")
        return value
    return parse


def add_parser(subparsers) -> None:
    """Register ``trace`` on an argparse sub-parsers object."""
    t = subparsers.add_parser(
        "trace", help="generate a synthetic routing trace or import one",
        description="Write a routing trace (.npz with counts int64 [micro_batches, layers, src_ranks, experts]: tokens "
                    "that each source rank's router sent to each expert, per micro-batch) for "
                    "`python -m deepspeed_feplb simulate`: a synthetic one (--kind) or one imported from "
                    "Megatron-Core router_trace files (--megatron).")
    t.add_argument("--out", required=True, metavar="T.npz", help="trace file to write")
    t.add_argument("--kind", default="noaux", choices=KINDS,
                   help="synthetic routing: noaux (Zipf popularity calibrated to training without an auxiliary "
                        "loss), zipf (Zipf popularity drifting over steps), dirichlet (Dirichlet popularity), "
                        "biased (random logits plus a fixed per-expert bias, exact top-k), lplb (i.i.d. "
                        "per-expert load noise, one source rank) (default: %(default)s)")
    t.add_argument("--megatron", nargs="+", metavar="PATH",
                   help="import Megatron-Core router_trace JSONL files, or folders holding them, instead of "
                        "generating (every record one micro-batch; ranks and layers as recorded)")
    t.add_argument("--micro-batches", "--steps", type=whole_number(1), default=100, dest="micro_batches",
                   help="micro-batches to generate (default: %(default)s; --steps: its old name)")
    t.add_argument("--layers", type=whole_number(1), default=2, help="MoE layers (default: %(default)s)")
    t.add_argument("--ranks", type=whole_number(1), default=8,
                   help="source ranks (the EP size the trace is recorded at; simulate replays it on this many "
                        "ranks or a divisor) (default: %(default)s)")
    t.add_argument("--experts", type=whole_number(1),
                   help="experts per layer (default: 128 for generated traces; for --megatron the highest "
                        "expert index + 1 in the records)")
    t.add_argument("--tokens-per-rank", type=whole_number(1), default=4096, metavar="TOKENS",
                   help="tokens per source rank and micro-batch; each is routed to --top-k experts "
                        "(default: %(default)s)")
    t.add_argument("--top-k", type=whole_number(1), default=8, metavar="K",
                   help="experts per token (default: %(default)s)")
    t.add_argument("--skew", type=float,
                   help="how skewed the routing is, per kind: zipf exponent (default 1.0, 0 = uniform), "
                        "dirichlet concentration (default 0.5, smaller = more skewed), biased: std of the "
                        "per-expert logit bias (default 1.0), lplb: sigma of the load noise (default 0.3); "
                        "not for noaux (calibrated)")
    t.add_argument("--hidden", type=whole_number(1),
                   help="expert hidden size stored in the trace for simulate's cost model (default: 6144 for "
                        "noaux, none for the other kinds: simulate then assumes 6144)")
    t.add_argument("--ffn-hidden", type=whole_number(1),
                   help="expert FFN size stored in the trace for simulate's cost model (default: 2048 for "
                        "noaux, none for the other kinds: simulate then assumes 2048)")
    t.add_argument("--seed", type=int, default=0, help="random seed; the same seed gives the same trace "
                                                       "(default: %(default)s)")
    t.set_defaults(func=run_trace)


def _fail(message: str):
    """One line on stderr and exit status 2, as argparse does for a bad option; no traceback."""
    from deepspeed_feplb.exits import fail

    fail("trace", message)


def run_trace(args) -> int:
    from deepspeed_feplb.trace.format import save_trace
    from deepspeed_feplb.trace.generators import GENERATORS
    from deepspeed_feplb.trace.importers import read_megatron_router_trace

    folder = os.path.dirname(os.path.abspath(args.out))
    if not os.path.isdir(folder):
        _fail(f"cannot write {args.out}: folder {folder} does not exist")
    if args.megatron:
        missing = [p for p in args.megatron if not os.path.exists(p)]
        if missing:
            _fail(f"--megatron: {', '.join(missing)} not found")
        try:
            trace = read_megatron_router_trace(args.megatron, num_experts=args.experts)
        except (OSError, ValueError) as e:
            _fail(f"--megatron: {e}")
    else:
        experts = args.experts or 128
        if args.top_k > experts:
            _fail(f"--top-k {args.top_k} is more than the {experts} experts (a token picks distinct experts); "
                  "lower --top-k or raise --experts")
        kw = {"tokens_per_rank": args.tokens_per_rank, "top_k": args.top_k, "seed": args.seed}
        if args.hidden:
            kw["hidden"] = args.hidden
        if args.ffn_hidden:
            kw["ffn_hidden"] = args.ffn_hidden
        if args.skew is not None:
            if args.kind == "noaux":
                _fail("--skew does not apply to --kind noaux (it is calibrated); use --kind zipf --skew S")
            kw[{"zipf": "skew", "dirichlet": "skew", "biased": "bias_std", "lplb": "sigma"}[args.kind]] = args.skew
        try:
            trace = GENERATORS[args.kind](args.micro_batches, args.layers, args.ranks, experts, **kw)
        except ValueError as e:
            _fail(f"--kind {args.kind}: {e}")
    save_trace(args.out, trace)
    print(f"wrote {args.out}: counts {list(trace.counts.shape)} ({trace.source})")
    return 0
