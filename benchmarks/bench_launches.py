"""The launch budget: aten operations and host time per FEPLB layer, balanced and not, on 2 ranks.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_launches.py [--json OUT.json] [--device cuda]

One DeepSpeed-kind FEPLB layer per variant (64 experts top-8 over 2 ranks: 32 local experts, hidden
16, ffn 64, 512 tokens per rank, a gate skewed towards rank 0's experts, no auxiliary loss):

* ``grouped, balanced`` / ``grouped, off``: the experts are ``Sequential(Linear, GELU, Linear)``, a
  known MLP (`deepspeed_feplb.grouped_mlp`; grouped where its GEMM runs natively: on CUDA in bf16,
  ``--dtype bfloat16``); balanced with D = 2 and the shared-memory transport
  (``cuda_ce`` with ``--device cuda``), or with ``dynamic_experts_per_rank: 0``;
* ``loop, balanced`` / ``loop, off``: the same weights in an expert class FEPLB does not know, so
  every expert is its own call (what every expert was before the grouped path).

Per variant and rank, counted with a `TorchDispatchMode` over one micro-batch after three warm-up
ones: aten operations (all, and non-view: the ones that launch work on a GPU) of the whole layer's
forward and backward, and of its expert stage alone (dispatch to combine, exclusive: from
`ExpertStage.run`'s start to its end in forward, from its output's gradient to its rows' in
backward; the parameters' gradients start as None, as after an optimizer step). Then host
time of forward + backward per micro-batch (median of ``--reps``, slower rank of each), variants
interleaved micro-batch by micro-batch so that machine noise hits all alike.
``--profile``: one more micro-batch per variant under `torch.profiler` (CPU, and CUDA on a GPU),
after the timed ones: per rank the top events by host and by device self time, and the host time
of every event that waits (a device sync, a blocking copy, a collective; `profile_summary`), so
that a GPU run tells where a variant's host time goes.
The script runs on older checkouts too (put one first on ``PYTHONPATH``): the counter is this
file's own copy of `deepspeed_feplb.testing.op_count`, loaded by path.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VARIANTS = ("grouped, balanced", "grouped, off", "loop, balanced", "loop, off")


def _op_count():
    spec = importlib.util.spec_from_file_location("feplb_op_count", os.path.join(ROOT, "deepspeed_feplb", "testing",
                                                                                  "op_count.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


# the transport backend's calls that are CUDA API calls on a GPU (a copy, a stream memory operation, an event)
DEVICE_CALLS = ("memcpy_async", "stream_wait_value32", "stream_write_value32", "event_record", "stream_wait_event",
                "event_query", "event_synchronize", "stream_synchronize")


def _use_ce_on_host(calls: dict) -> None:
    """Phase 2 through the Copy-Engine transport's code path on host memory (`HostBackend`), as
    `migrate.transport_class` picks it on a GPU; its device calls are tallied into ``calls["now"]``
    (a dict, or None outside the counted micro-batch)."""
    from deepspeed_feplb import expert_stage
    from deepspeed_feplb.migrate.backend import HostBackend
    from deepspeed_feplb.migrate.cuda_ce import on_host

    def tallied(name):
        def call(self, *args, **kwargs):
            if calls["now"] is not None:
                calls["now"][name] = calls["now"].get(name, 0) + 1
            return getattr(HostBackend, name)(self, *args, **kwargs)
        return call

    CountingBackend = type("CountingBackend", (HostBackend,), {name: tallied(name) for name in DEVICE_CALLS})
    transport = on_host(lambda prefix, _: CountingBackend(prefix=prefix))
    expert_stage.transport_class = lambda config, expert_params: transport


def _worker(opts: dict) -> dict:
    import torch
    import torch.distributed as dist
    import torch.profiler

    import deepspeed_feplb
    from deepspeed_feplb.expert_stage import ExpertStage

    op_count = _op_count()
    cuda = opts["device"] == "cuda"
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    dtype = getattr(torch, opts["dtype"])
    if cuda:
        torch.cuda.set_device(0)
    hidden, ffn, experts, k, tokens = opts["hidden"], opts["ffn"], opts["experts"], opts["k"], opts["tokens"]

    class UnknownExpert(torch.nn.Sequential):
        """The same MLP under a class FEPLB does not know: one call per expert."""

    transport = "cuda_ce" if cuda else "shm"
    calls = {"now": None}  # the transport backend's device calls during the counted micro-batch
    if opts["transport"] == "ce-host":
        transport = "shm"  # the config's choice on CPU; the stage is handed the CE transport below
        _use_ce_on_host(calls)

    layers = {}
    for name in VARIANTS:
        torch.manual_seed(0)
        cls = torch.nn.Sequential if name.startswith("grouped") else UnknownExpert
        expert = cls(torch.nn.Linear(hidden, ffn), torch.nn.GELU(), torch.nn.Linear(ffn, hidden))
        feplb = {"nvlink_domain_size": 2, "dynamic_experts_per_rank": 2 if name.endswith("balanced") else 0,
                 "chunk_align_tokens": 1, "fixed_costs": "ignore", "transport": transport,
                 "scheduler": {"start_after_steps": 0}, "max_helpers_per_expert": 4}
        layer = deepspeed_feplb.MoE(hidden_size=hidden, expert=expert, num_experts=experts, ep_size=2, k=k,
                                    min_capacity=0, drop_tokens=False, use_rts=False, feplb_config=feplb)
        with torch.no_grad():  # no auxiliary loss: the gate favours rank 0's experts
            layer.deepspeed_moe.gate.wg.weight[:experts // 2] += opts["skew"] / hidden
        layer.set_deepspeed_parallelism()
        layers[name] = layer.to(dev, dtype)
        if opts.get("flat_params"):  # as ZeRO 1/2's flat buffers hold them
            from deepspeed_feplb.testing import experts_in_one_buffer
            experts_in_one_buffer(layer.deepspeed_moe.experts.deepspeed_experts)

    g = torch.Generator().manual_seed(1 + dist.get_rank())
    batches = [((torch.randn(tokens, hidden, generator=g) + 1.0).to(dev, dtype),
                torch.randn(tokens, hidden, generator=g).to(dev, dtype)) for _ in range(4)]

    def step(layer, batch):
        x = batch[0].clone().requires_grad_(True)
        out, l_aux, _ = layer(x)
        return out, l_aux

    def sync():
        if cuda:
            torch.cuda.synchronize()

    # the expert stage's share: the counting mode is told where the stage starts and ends
    where = {"now": "layer"}
    original_run = ExpertStage.run

    def labelled_run(self, rows, *args, **kwargs):
        where["now"] = "stage"
        if rows.requires_grad:
            rows.register_hook(lambda grad: where.update(now="layer"))
        out = original_run(self, rows, *args, **kwargs)
        where["now"] = "layer"
        if out.requires_grad:
            out.register_hook(lambda grad: where.update(now="stage"))
        return out

    ExpertStage.run = labelled_run

    class Split(op_count._Counting):
        """`count_ops`'s mode, counting into the layer's or the stage's `OpCount` by `where`."""

        def __init__(self, counts):
            super().__init__(None)
            self.counts = counts

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.into = self.counts[where["now"]]
            return super().__torch_dispatch__(func, types, args, kwargs)

    figures = {}
    for name, layer in layers.items():
        for batch in batches[:3]:
            out, l_aux = step(layer, batch)
            ((out * batch[1]).sum() + l_aux).backward()
        sync()
        layer.zero_grad(set_to_none=True)  # as after an optimizer step: gradients are handed over, not added
        counts = {}
        forward = {"layer": op_count.OpCount(), "stage": op_count.OpCount()}
        device_calls = {"forward": {}, "backward": {}}
        calls["now"] = device_calls["forward"]
        with Split(forward):
            out, l_aux = step(layer, batches[3])
        calls["now"] = None
        loss = (out * batches[3][1]).sum() + l_aux  # outside the count: the model's, not the layer's
        backward = {"layer": op_count.OpCount(), "stage": op_count.OpCount()}
        calls["now"] = device_calls["backward"]
        with Split(backward):
            loss.backward()
        calls["now"] = None
        for direction, parts in (("forward", forward), ("backward", backward)):
            counts[direction] = {"layer_ops": parts["layer"].ops + parts["stage"].ops,
                                 "layer_non_view": parts["layer"].non_view + parts["stage"].non_view,
                                 "stage_ops": parts["stage"].ops, "stage_non_view": parts["stage"].non_view,
                                 "stage_top": parts["stage"].top(opts.get("top", 6)),
                                 "transport_calls": dict(sorted(device_calls[direction].items()))}
        stats = layer.feplb_stats
        figures[name] = {**counts, "migrated_rows": int(stats.get("migrated_tokens", 0)),
                         "grouped": getattr(layer.deepspeed_moe, "stacked_mlp", None) is not None}
    ExpertStage.run = original_run

    host = {name: [] for name in layers}
    for rep in range(opts["reps"]):
        for name, layer in layers.items():  # interleaved: noise hits every variant alike
            batch = batches[rep % len(batches)]
            sync()
            start = time.perf_counter()
            out, l_aux = step(layer, batch)
            ((out * batch[1]).sum() + l_aux).backward()
            sync()
            host[name].append((time.perf_counter() - start) * 1e6)
    for name in layers:
        figures[name]["host_us"] = host[name]
    if opts.get("profile"):
        for name, layer in layers.items():
            batch = batches[0]
            sync()
            activities = [torch.profiler.ProfilerActivity.CPU] + [torch.profiler.ProfilerActivity.CUDA] * cuda
            try:  # a profiler that cannot start on this machine (no CUPTI) costs the profile, not the counts
                with torch.profiler.profile(activities=activities) as prof:
                    out, l_aux = step(layer, batch)
                    ((out * batch[1]).sum() + l_aux).backward()
                    sync()
                figures[name]["profile"] = profile_summary(prof.key_averages(), opts.get("top", 6) * 2)
            except RuntimeError as exc:
                figures[name]["profile"] = {"error": f"{type(exc).__name__}: {exc}"}
    dist.barrier()
    return figures


# host events that wait: for the device (CUDA runtime), for other ranks (the dispatcher's all-to-all,
# whose autograd function holds the collective's wait; gloo, NCCL)
WAITS = ("Synchronize", "cudaStreamWaitEvent", "cudaMemcpy", "AllToAll", "gloo", "nccl", "wait")


def profile_summary(averages, top: int) -> dict:
    """What one micro-batch spent its time on, from `torch.profiler`'s ``key_averages()``: the
    ``top`` events by host self time and by device self time (name, calls, µs), and every event
    whose name says it waits (`WAITS`: a device sync, a blocking copy, a collective) with its
    host self time, so that a GPU run tells launches from waits."""
    def rows(key):
        ranked = sorted((e for e in averages if key(e) > 0), key=key, reverse=True)
        return [[e.key, e.count, round(key(e), 1)] for e in ranked[:top]]

    def host(e):
        return e.self_cpu_time_total

    def device(e):
        return e.self_device_time_total

    waits = sorted(([e.key, e.count, round(host(e), 1)] for e in averages if any(w in e.key for w in WAITS)),
                   key=lambda w: -w[2])
    return {"host_self_us": rows(host), "device_self_us": rows(device), "waits_host_us": waits,
            "host_self_us_total": round(sum(map(host, averages)), 1),
            "device_self_us_total": round(sum(map(device, averages)), 1)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=512, help="tokens per rank")
    parser.add_argument("--hidden", type=int, default=16)
    parser.add_argument("--ffn", type=int, default=64)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--skew", type=float, default=3.0, help="gate skew towards rank 0's experts")
    parser.add_argument("--reps", type=int, default=30, help="timed micro-batches per variant")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: both ranks on GPU 0, the CE transport")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="bfloat16: the dtype whose grouped GEMM CUDA runs natively (Hopper, Blackwell)")
    parser.add_argument("--transport", choices=("shm", "ce-host"), default="shm",
                        help="on CPU, phase 2 through the shared-memory transport (its copies are aten ops) or "
                             "through the Copy-Engine transport's code path on host memory (its copies are "
                             "transport calls, as cudaMemcpyAsync is on a GPU)")
    parser.add_argument("--flat-params", action="store_true",
                        help="lay each layer's expert parameters out as ZeRO 1/2's flat buffers do (one expert "
                             "after the other in one buffer), as a run with a DeepSpeed engine has them")
    parser.add_argument("--profile", action="store_true",
                        help="also profile one micro-batch per variant (torch.profiler: the top host and device "
                             "events, and the waits), after the timed ones")
    parser.add_argument("--json", metavar="OUT", help="also write the results as JSON")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if ROOT not in sys.path:  # after PYTHONPATH: an older checkout put there is the one measured
        sys.path.append(ROOT)
    from deepspeed_feplb.testing import run_distributed

    load = os.getloadavg()[0]
    ranks = run_distributed(_worker, 2, vars(args), timeout=900)
    result = {"shape": {k: getattr(args, k) for k in ("tokens", "hidden", "ffn", "experts", "k", "device", "dtype",
                                                       "transport", "flat_params")},
              "load_average_1m": [round(load, 2), round(os.getloadavg()[0], 2)], "variants": {}}
    print(f"{'variant':<20} {'rank':>4} {'layer fwd':>9} {'layer bwd':>9} {'stage fwd':>9} {'stage bwd':>9} "
          f"{'host us (median)':>16}   non-view aten ops (all ops)")
    for name in VARIANTS:
        per_rank = [r[name] for r in ranks]
        slower = [max(samples) for samples in zip(*(r["host_us"] for r in per_rank))]
        result["variants"][name] = {"per_rank": [{k: v for k, v in r.items() if k != "host_us"} for r in per_rank],
                                    "host_us_median_slower_rank": round(statistics.median(slower), 1)}
        for rank, r in enumerate(per_rank):
            f, b = r["forward"], r["backward"]
            print(f"{name:<20} {rank:>4} {f['layer_non_view']:>4} ({f['layer_ops']:>3}) {b['layer_non_view']:>4} "
                  f"({b['layer_ops']:>3}) {f['stage_non_view']:>4} ({f['stage_ops']:>3}) {b['stage_non_view']:>4} "
                  f"({b['stage_ops']:>3}) {statistics.median(r['host_us']):>16.0f}")
        print(f"{'':<20} {'max':>4} {'':>39} {result['variants'][name]['host_us_median_slower_rank']:>16.0f}"
              f"   migrated rows (rank 0): {per_rank[0]['migrated_rows']}")
    for a, b in (("grouped, balanced", "grouped, off"), ("grouped, balanced", "loop, balanced")):
        ratio = (result["variants"][a]["host_us_median_slower_rank"]
                 / result["variants"][b]["host_us_median_slower_rank"])
        result[f"{a} / {b}"] = round(ratio, 3)
        print(f"host time {a} / {b}: {ratio:.3f}")
    for name in VARIANTS:
        for rank, r in enumerate(result["variants"][name]["per_rank"]):
            if r["forward"]["transport_calls"] or r["backward"]["transport_calls"]:
                print(f"transport device calls, {name}, rank {rank}: forward {r['forward']['transport_calls']}, "
                      f"backward {r['backward']['transport_calls']}")
    if args.profile:
        for name in VARIANTS:
            for rank, r in enumerate(result["variants"][name]["per_rank"]):
                p = r["profile"]
                if "error" in p:
                    print(f"profile, {name}, rank {rank}: {p['error']}")
                    continue
                print(f"profile, {name}, rank {rank}: host {p['host_self_us_total']:.0f} us, device "
                      f"{p['device_self_us_total']:.0f} us; waits (host us) {p['waits_host_us'][:4]}")
    print(f"load average (1 min) before / after: {result['load_average_1m']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
