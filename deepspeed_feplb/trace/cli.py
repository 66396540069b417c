"""``python -m deepspeed_feplb trace ...``: write a synthetic routing trace
(``--kind noaux|zipf|dirichlet|biased|lplb``) or import a Megatron-Core router_trace
(``--megatron DIR_OR_FILES``), in the ``.npz`` format of `format`."""
from __future__ import annotations

__all__ = ["add_parser", "run_trace"]


def add_parser(subparsers) -> None:
    """Register ``trace`` on an argparse sub-parsers object."""
    t = subparsers.add_parser("trace", help="generate a synthetic routing trace or import one")
    t.add_argument("--out", required=True, help="trace .npz to write")
    t.add_argument("--kind", default="noaux", help="noaux | zipf | dirichlet | biased | lplb")
    t.add_argument("--megatron", nargs="+", help="import Megatron-Core router_trace JSONL files/dirs")
    t.add_argument("--steps", type=int, default=100)
    t.add_argument("--layers", type=int, default=2)
    t.add_argument("--ranks", type=int, default=8, help="source ranks")
    t.add_argument("--experts", type=int, default=128)
    t.add_argument("--tokens-per-rank", type=int, default=4096)
    t.add_argument("--top-k", type=int, default=8)
    t.add_argument("--skew", type=float, help="zipf exponent / dirichlet concentration / bias std / sigma")
    t.add_argument("--hidden", type=int)
    t.add_argument("--ffn-hidden", type=int)
    t.add_argument("--seed", type=int, default=0)
    t.set_defaults(func=run_trace)


def run_trace(args) -> int:
    from deepspeed_feplb.trace.format import save_trace
    from deepspeed_feplb.trace.generators import GENERATORS
    from deepspeed_feplb.trace.importers import read_megatron_router_trace

    if args.megatron:
        trace = read_megatron_router_trace(args.megatron, num_experts=args.experts)
    else:
        if args.kind not in GENERATORS:
            raise SystemExit(f"unknown trace kind {args.kind!r} (one of {', '.join(GENERATORS)})")
        kw = {"tokens_per_rank": args.tokens_per_rank, "top_k": args.top_k, "seed": args.seed}
        if args.hidden:
            kw["hidden"] = args.hidden
        if args.ffn_hidden:
            kw["ffn_hidden"] = args.ffn_hidden
        if args.skew is not None:
            kw[{"zipf": "skew", "dirichlet": "skew", "biased": "bias_std", "lplb": "sigma"}.get(args.kind, "skew")] = args.skew
            if args.kind == "noaux":
                raise SystemExit("--skew does not apply to --kind noaux (it is calibrated)")
        trace = GENERATORS[args.kind](args.steps, args.layers, args.ranks, args.experts, **kw)
    save_trace(args.out, trace)
    print(f"wrote {args.out}: counts {list(trace.counts.shape)} ({trace.source})")
    return 0
