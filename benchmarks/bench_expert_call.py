"""Host cost of one expert call, the three ways the expert stage can make it, side by side.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_expert_call.py [--hidden 64] [--rows 4] [--json OUT]

A DeepSpeed-style expert (Linear, ReLU, Linear) on a few rows, so the call's host overhead shows:

* ``direct``: the module itself (the static experts: `LocalExperts.calls` binds the parameters
  once per forward, a cost shared by all local experts and not counted here);
* ``bound per call``: `ExpertSpec.call`, the weights bound into the module around the call (phase
  2's pieces);
* ``functional_call``: `torch.func.functional_call`, what both used before.

Rounds alternate the three; the medians per call (µs) and the load average are printed.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=30, help="alternating rounds of --calls calls each")
    parser.add_argument("--calls", type=int, default=500)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)

    import torch
    from torch.func import functional_call

    from deepspeed_feplb.experts import ExpertSpec

    torch.manual_seed(0)
    expert = torch.nn.Sequential(torch.nn.Linear(args.hidden, 2 * args.hidden), torch.nn.ReLU(),
                                 torch.nn.Linear(2 * args.hidden, args.hidden))
    spec = ExpertSpec.of(expert)
    weights = [p.detach().clone().requires_grad_() for p in expert.parameters()]
    named = dict(zip(spec.param_names, weights))
    x = torch.randn(args.rows, args.hidden)
    ways = {"direct": lambda: expert(x), "bound per call": lambda: spec.call(expert, weights, [], x),
            "functional_call": lambda: functional_call(expert, named, (x, ))}
    for call in ways.values():  # warm-up: first-call imports and allocator
        for _ in range(50):
            call()
    samples: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(args.rounds):
        for name, call in ways.items():
            start = time.perf_counter()
            for _ in range(args.calls):
                call()
            samples[name].append((time.perf_counter() - start) / args.calls * 1e6)
    result = {"hidden": args.hidden, "rows": args.rows, "load_average": os.getloadavg(),
              "median_us_per_call": {name: round(statistics.median(v), 2) for name, v in samples.items()}}
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
