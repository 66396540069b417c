"""The device check's hot-path stages (issue "GPU hot path I"): what one FEPLB layer costs the host
and the device, measured where it runs. `device_check.py` calls them; ``cpu=True`` runs the same
code on CPU stand-ins with tiny shapes (CI's dry run), where syncs and kernels cannot be counted.

* `syncs`: device-to-host synchronisations per layer forward and backward of a balanced
  micro-batch (``torch.cuda.set_sync_debug_mode``), fp32 and bf16, with the frames that asked for
  each; those inside torch.distributed collectives are not counted (one GPU hosts both ranks over
  gloo, which copies CUDA tensors through the host; NCCL would not), and those reached from no
  frame of FEPLB or DeepSpeed are listed apart (``*_unattributed``: on an H200, one per forward
  from ``torch/cuda/__init__.py``, most likely gloo's own thread).
* `launches`: CUDA kernels per layer forward and backward (the profiler).
* `memory`: four FEPLB layers, 8 micro-batches per step, residency ``"step"``: the peak device
  memory FEPLB adds (allocator peak with FEPLB on minus off, plus the transport's slots) against
  the bound of docs/GPU.md.
* `layer_speed`: one GPU, EP = 1, bf16, 64 experts top-8, 8k tokens, hidden 2048 / ffn 1408:
  forward + backward of the FEPLB layer (its experts grouped, `grouped_mlp`, and one call per
  expert) against DeepSpeed's MoE.
* `launch_budget`: `benchmarks/bench_launches.py` on the device (aten ops and host time per layer).
* `parity` (issue "the model is the runtime"): 2 ranks on one GPU train a balancing layer (bf16,
  16 experts top-2, 8k tokens per rank, hidden 2048 / ffn 1408, costs measured) with a recorded
  trace; the time model replays its plans with the costs its planner had (`sim.measured`):
  median |error| <= 15%, p90 <= 30% of the measured stage makespan (CUDA events).
"""
from __future__ import annotations

import contextlib
import statistics
import time
import traceback
import warnings

import torch
import torch.distributed as dist

_COLLECTIVES = ("all_gather", "all_to_all_single", "all_reduce", "barrier", "broadcast", "all_gather_object",
                "monitored_barrier")


@contextlib.contextmanager
def _collectives_unsynced():
    """Collectives run with sync debugging off (gloo's host copies are not FEPLB's syncs)."""
    saved = {name: getattr(dist, name) for name in _COLLECTIVES}

    def quiet(fn):
        def call(*args, **kwargs):
            mode = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode(0)
            try:
                return fn(*args, **kwargs)
            finally:
                torch.cuda.set_sync_debug_mode(mode)
        return call

    for name, fn in saved.items():
        setattr(dist, name, quiet(fn))
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


@contextlib.contextmanager
def _count_syncs(cpu: bool, into: dict, key: str):
    """Count the synchronising CUDA calls inside the block into ``into[key]`` (None on CPU) and
    their source lines into ``into[key + "_where"]``."""
    if cpu:
        yield
        into[key] = None
        return
    caught, unattributed = [], []

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" not in str(message):
            return
        # the caller's frames (torch's own line says only where it synced): a sync reached from no
        # frame of the layer (FEPLB's or DeepSpeed's code) came from elsewhere: a warning raised in
        # another thread (gloo copies CUDA tensors through the host in its own) or the harness
        frames = [f for f in traceback.extract_stack()[:-1] if "/warnings.py" not in f.filename]
        ours = [f for f in frames if ("deepspeed_feplb" in f.filename and "testing/launcher" not in f.filename)
                or "deepspeed/" in f.filename]
        where = " <- ".join(f"{'/'.join(f.filename.rsplit('/', 3)[-3:])}:{f.lineno}"
                            for f in [frames[-1], *reversed(ours[-3:])])
        (caught if ours else unattributed).append(where)

    with warnings.catch_warnings(), _collectives_unsynced():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode(0)
    into[key] = len(caught)
    into[key + "_where"] = sorted(set(caught))
    into[key + "_unattributed"] = sorted(set(unattributed))


def _balanced_layer(cpu: bool, num_experts: int = 16, residency: str = "micro_batch", dtype=torch.float32):
    """A FEPLB layer on 2 ranks (one GPU), tokens skewed to rank 0, domain open and balancing."""
    import moe_cases
    dev = torch.device("cpu") if cpu else torch.device("cuda", 0)
    feplb = {"nvlink_domain_size": 2, "dynamic_experts_per_rank": 2, "chunk_align_tokens": 1, "fixed_costs": "ignore",
             "transport": "shm" if cpu else "cuda_ce", "scheduler": {"start_after_steps": 0},
             "weight_residency": residency, "max_helpers_per_expert": 4}
    _, layer = moe_cases.build_pair(num_experts, 2, 2, feplb, seed=3)
    return layer.to(dev, dtype), dev


def _warm_layer(cpu: bool, dtype=torch.float32):
    """`_balanced_layer` after three micro-batches (the domain opens, the scheduler serves, buffers
    are allocated), and the measured micro-batch's input (requiring gradients) and output weight."""
    import moe_cases
    if not cpu:
        torch.cuda.set_device(0)
    layer, dev = _balanced_layer(cpu, dtype=dtype)
    for seed in range(3):
        x, w = moe_cases.rank_inputs(seed)
        moe_cases.run_layer(layer, x.to(dev, dtype), w.to(dev, dtype))
    x, w = moe_cases.rank_inputs(9)
    return layer, x.to(dev, dtype).requires_grad_(True), w.to(dev, dtype)


def _syncs_worker(cpu: bool, dtype) -> dict:
    layer, x, w = _warm_layer(cpu, dtype)
    figures: dict = {}
    with _count_syncs(cpu, figures, "forward"):
        out, l_aux, _ = layer(x)
    loss = (out * w).sum() + l_aux
    with _count_syncs(cpu, figures, "backward"):
        loss.backward()
    figures["migrated_tokens"] = int(layer.feplb_stats["migrated_tokens"])
    figures["grouped_experts"] = layer.deepspeed_moe.stacked_mlp is not None
    return figures


def syncs(cpu: bool) -> dict:
    """fp32 (one call per expert on CUDA: `grouped_mlp.grouped_mm_runs`) and bf16 (grouped)."""
    from deepspeed_feplb.testing import run_distributed
    figures = {"layer_kind": "DeepSpeed MoE (FEPLBMOELayer)",
               "autoep_kind": "not measured here: needs transformers on the device"}
    ok = True
    for dtype in (torch.float32, torch.bfloat16):
        results = run_distributed(_syncs_worker, 2, cpu, dtype, timeout=150)
        figures[f"per_rank_{str(dtype).split('.')[-1]}"] = results
        ok = ok and all(r["forward"] is None or (r["forward"] <= 1 and r["backward"] == 0) for r in results)
        ok = ok and sum(r["migrated_tokens"] for r in results) > 0
    if cpu:
        return {**figures, "note": "CPU dry run: the path runs, syncs are counted on CUDA only"}
    return {"ok": ok, **figures}


def _launches_worker(cpu: bool) -> dict:
    from torch.profiler import ProfilerActivity, profile
    layer, x, w = _warm_layer(cpu)
    activities = [ProfilerActivity.CPU] + ([] if cpu else [ProfilerActivity.CUDA])
    counts = {}
    with profile(activities=activities) as forward:
        out, l_aux, _ = layer(x)
        if not cpu:
            torch.cuda.synchronize()
    loss = (out * w).sum() + l_aux
    with profile(activities=activities) as backward:
        loss.backward()
        if not cpu:
            torch.cuda.synchronize()
    for name, prof in (("forward", forward), ("backward", backward)):
        events = prof.events()
        counts[f"{name}_kernels"] = None if cpu else sum(e.device_type == torch.autograd.DeviceType.CUDA
                                                          for e in events)
        counts[f"{name}_aten_ops"] = sum(e.name.startswith("aten::") for e in events)
    return counts


def launches(cpu: bool) -> dict:
    from deepspeed_feplb.testing import run_distributed
    return {"per_rank": run_distributed(_launches_worker, 2, cpu, timeout=150)}


def host_calls(cpu: bool) -> dict:
    """Host µs per call (median of 5 runs of 1,000 calls) of what a layer pass calls often on a GPU's
    host: torch's handle of the current stream (``torch.cuda.current_stream``, with and without the
    device), the raw handle (`kernels.cuda.current_stream_ptr`), a timing mark
    (`expert_costs.device_mark`) and a bare timing event's record. The dry run times a CPU call in
    their place (``empty_us``), to run the timer."""
    import statistics
    import time

    def per_call_us(fn) -> float:
        runs = []
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(1000):
                fn()
            runs.append((time.perf_counter() - start) * 1e3)  # µs per call: seconds / 1000 * 1e6
        return round(statistics.median(runs), 3)

    if cpu:
        return {"empty_us": per_call_us(lambda: torch.empty(0))}
    from deepspeed_feplb.expert_costs import device_mark
    from deepspeed_feplb.kernels.cuda import current_stream_ptr
    device = torch.device("cuda", 0)
    figures = {"current_stream_us": per_call_us(torch.cuda.current_stream),
               "current_stream_of_device_us": per_call_us(lambda: torch.cuda.current_stream(device)),
               "current_stream_ptr_us": per_call_us(lambda: current_stream_ptr(0)),
               "device_mark_us": per_call_us(lambda: device_mark(device)),
               "event_record_us": per_call_us(lambda: torch.cuda.Event(enable_timing=True).record())}
    torch.cuda.synchronize()
    return figures


def _memory_worker(cpu: bool, enabled: bool) -> dict:
    import deepspeed_feplb
    from deepspeed_feplb.migrate.resident import copy_bytes

    import moe_cases
    dev = torch.device("cpu") if cpu else torch.device("cuda", 0)
    if not cpu:
        torch.cuda.set_device(0)
    layers_n, micro_batches, D, G = 4, 8, 2, 2
    feplb = {"enabled": enabled, "nvlink_domain_size": G, "dynamic_experts_per_rank": D, "chunk_align_tokens": 1,
             "fixed_costs": "ignore", "transport": "shm" if cpu else "cuda_ce", "scheduler": {"start_after_steps": 0},
             "weight_residency": "step", "max_helpers_per_expert": 4}
    torch.manual_seed(5)
    layers = torch.nn.ModuleList()
    for _ in range(layers_n):
        layer = deepspeed_feplb.MoE(hidden_size=moe_cases.HIDDEN, expert=moe_cases.make_expert(), num_experts=16,
                                    ep_size=2, k=2, min_capacity=0, drop_tokens=False, use_rts=False,
                                    feplb_config=feplb)
        moe_cases.skew_gate(layer.deepspeed_moe.gate.wg.weight)
        layer.set_deepspeed_parallelism()
        layers.append(layer)
    layers = layers.to(dev)
    checked = {}
    if enabled:  # what deepspeed_feplb.initialize checks and records (none for host memory)
        from deepspeed_feplb.memory import check_at_initialize
        checked = check_at_initialize([layer.deepspeed_moe.memory_facts() for layer in layers],
                                      layers[0].deepspeed_moe.feplb_config)
    if not cpu:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    most_kept = 0
    for micro in range(micro_batches):
        for layer in layers:
            layer.deepspeed_moe.step_ends = lambda micro=micro: micro == micro_batches - 1
        x, w = moe_cases.rank_inputs(20 + micro)
        h = x.to(dev).requires_grad_(True)
        aux = 0.0
        for layer in layers:
            out, l_aux, _ = layer(h)
            h, aux = h + out, aux + l_aux
        ((h * w.to(dev)).sum() + aux).backward()
        domain = layers[0].deepspeed_moe.stage.domain if enabled else None
        if domain is not None:
            most_kept = max(most_kept, int(domain.kept_bytes.held.max()))
    expert = layers[0].deepspeed_moe.experts.deepspeed_experts[0]
    params = list(expert.parameters())
    figures = {"peak_allocated": None if cpu else torch.cuda.max_memory_allocated() - base,
               "most_kept_bytes": most_kept, "copy_bytes": copy_bytes(params),
               "expert_bytes": sum(p.numel() * p.element_size() for p in params)}
    stage = layers[0].deepspeed_moe.stage
    if enabled and stage.domain is not None:
        transport = stage.domain.transport
        figures["slot_bytes"] = sum(transport.capacities().values()) if hasattr(transport, "capacities") else 0
        figures["domain_kept_budget"] = stage.domain.kept_bytes.budget
    for need, budget in checked.values():
        figures.update(initialize_fixed_bytes=need.fixed, initialize_kept_most=need.kept_most,
                       initialize_kept_budget=budget)
    return figures


def memory(cpu: bool) -> dict:
    """FEPLB's added peak (allocator peak on minus off, plus the slots) against docs/GPU.md's bound."""
    from deepspeed_feplb.testing import run_distributed
    on = run_distributed(_memory_worker, 2, cpu, True, timeout=200)
    off = run_distributed(_memory_worker, 2, cpu, False, timeout=200)
    layers_n, D, G, max_resident = 4, 2, 2, 8
    rows = []
    for rank, (a, b) in enumerate(zip(on, off)):
        bound = (layers_n * max_resident * a["copy_bytes"]  # kept copies
                 + layers_n * D * (G - 1) * a["expert_bytes"]  # copies held forward to backward
                 + a.get("slot_bytes", 0))
        added = None if cpu else a["peak_allocated"] - b["peak_allocated"] + a.get("slot_bytes", 0)
        rows.append({"rank": rank, "added_bytes": added, "bound_bytes": bound, **a})
    # on a GPU, the budget deepspeed_feplb.initialize records is the one the domain keeps
    ok = cpu or all(r["added_bytes"] <= 1.05 * r["bound_bytes"] and r.get("domain_kept_budget") is not None
                    and r.get("initialize_kept_budget") == r["domain_kept_budget"] for r in rows)
    return {"ok": ok, "per_rank": rows, "note": "added = peak allocated (on - off) + slots; bound: docs/GPU.md; "
                                                "initialize_*: memory.check_at_initialize's figures"}


def _time_ms(fn, reps: int, cpu: bool) -> float:
    """Median wall time of ``fn`` (forward + backward), ms."""
    samples = []
    for _ in range(reps):
        if not cpu:
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if not cpu:
            torch.cuda.synchronize()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def _layer_speed_worker(cpu: bool) -> dict:
    from deepspeed.moe.layer import MoE as DeepSpeedMoE

    import deepspeed_feplb
    dev = torch.device("cpu") if cpu else torch.device("cuda", 0)
    experts, k, tokens, hidden, ffn = (8, 2, 256, 64, 48) if cpu else (64, 8, 8192, 2048, 1408)
    dtype = torch.float32 if cpu else torch.bfloat16
    expert = torch.nn.Sequential(torch.nn.Linear(hidden, ffn), torch.nn.GELU(), torch.nn.Linear(ffn, hidden))
    kwargs = dict(hidden_size=hidden, expert=expert, num_experts=experts, ep_size=1, k=k, min_capacity=0,
                  drop_tokens=False, use_rts=False)
    torch.manual_seed(0)
    layers = {"deepspeed_moe": DeepSpeedMoE(**kwargs), "feplb_deepspeed_kind": deepspeed_feplb.MoE(**kwargs),
              # the same MLP in a class FEPLB does not know: one call per expert (the path before grouping)
              "feplb_loop": deepspeed_feplb.MoE(**{**kwargs, "expert": UnknownExpert(*expert)})}
    for name in ("feplb_deepspeed_kind", "feplb_loop"):
        layers[name].load_state_dict(layers["deepspeed_moe"].state_dict())
    x = torch.randn(tokens, hidden, device=dev, dtype=dtype, requires_grad=True)
    figures = {"shape": {"experts": experts, "top_k": k, "tokens": tokens, "hidden": hidden, "ffn": ffn,
                         "dtype": str(dtype)}}
    for name, layer in layers.items():
        layer.set_deepspeed_parallelism()
        layer.to(dev, dtype)

        def step(layer=layer):
            out, l_aux, _ = layer(x)
            (out.float().square().mean() + l_aux).backward()

        _time_ms(step, 3, cpu)  # warm-up
        figures[f"{name}_ms"] = round(_time_ms(step, 5 if cpu else 20, cpu), 3)
    figures["feplb_over_deepspeed"] = round(figures["feplb_deepspeed_kind_ms"] / figures["deepspeed_moe_ms"], 3)
    figures["feplb_loop_over_deepspeed"] = round(figures["feplb_loop_ms"] / figures["deepspeed_moe_ms"], 3)
    figures["autoep_grouped_experts"] = "not measured here: needs transformers on the device"
    return figures


class UnknownExpert(torch.nn.Sequential):
    """A ``Sequential`` under a class FEPLB does not know (`grouped_mlp.StackedMLP.of`): every expert its own call."""


def launch_budget(cpu: bool, out_dir) -> dict:
    """`benchmarks/bench_launches.py` on this device: aten ops per layer and per expert stage, forward
    and backward, and host time per micro-batch, grouped and per-expert experts, balanced and not
    (2 ranks; on a GPU both on device 0 with the CE transport), and one micro-batch of each under
    `torch.profiler` (``--profile``: where the host time goes, and the waits)."""
    import json
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    sys.path.insert(0, str(root / "benchmarks"))
    import bench_launches
    path = Path(out_dir) / "launch_budget.json"
    bench_launches.main(["--device", "cpu" if cpu else "cuda", "--dtype", "float32" if cpu else "bfloat16",
                         "--reps", "5" if cpu else "30", "--profile", "--json", str(path)])
    result = json.loads(path.read_text())
    balanced = result["variants"]["grouped, balanced"]["per_rank"]
    return {**result, "ok": all(r["migrated_rows"] > 0 for r in balanced[:1])}


def layer_speed(cpu: bool) -> dict:
    from deepspeed_feplb.testing import run_distributed
    (figures, ) = run_distributed(_layer_speed_worker, 1, cpu, timeout=200)
    return {"ok": cpu or figures["feplb_over_deepspeed"] <= 1.0, **figures}


PARITY_STEPS, PARITY_SKIP = 40, 10  # micro-batches trained, and skipped before comparing (fits settle)


def _parity_worker(cpu: bool, trace_path: str) -> dict:
    import deepspeed_feplb
    from deepspeed_feplb.trace.record import get_recorder

    import moe_cases
    dev = torch.device("cpu") if cpu else torch.device("cuda", 0)
    if not cpu:
        torch.cuda.set_device(0)
    tokens, hidden, ffn = (256, 32, 64) if cpu else (8192, 2048, 1408)
    dtype = torch.float32 if cpu else torch.bfloat16
    feplb = {"nvlink_domain_size": 2, "dynamic_experts_per_rank": 2, "transport": "shm" if cpu else "cuda_ce",
             "scheduler": {"start_after_steps": 0}, "stats": {"record_trace": trace_path}}
    torch.manual_seed(0)
    expert = torch.nn.Sequential(torch.nn.Linear(hidden, ffn), torch.nn.GELU(), torch.nn.Linear(ffn, hidden))
    layer = deepspeed_feplb.MoE(hidden_size=hidden, expert=expert, num_experts=16, ep_size=2, k=2, min_capacity=0,
                                drop_tokens=False, use_rts=False, feplb_config=feplb)
    moe_cases.skew_gate(layer.deepspeed_moe.gate.wg.weight, spread=False)
    layer.set_deepspeed_parallelism()
    layer.to(dev, dtype)
    g = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(PARITY_STEPS):
        x = (torch.randn(tokens, hidden, generator=g) + 1.0).to(dev, dtype).requires_grad_(True)
        out, l_aux, _ = layer(x)
        (out.float().square().mean() + l_aux).backward()
    get_recorder(trace_path).flush()
    dist.barrier()
    return {"hidden": hidden, "ffn": ffn, "dtype_bytes": torch.finfo(dtype).bits // 8}


def parity(cpu: bool) -> dict:
    import tempfile
    from dataclasses import replace

    from deepspeed_feplb.plan.cost import PROFILES, ExpertShape
    from deepspeed_feplb.plan.timeline import TimeModel
    from deepspeed_feplb.sim.measured import compare_measured
    from deepspeed_feplb.testing import run_distributed
    from deepspeed_feplb.trace.format import load_trace
    with tempfile.TemporaryDirectory(prefix="feplb-parity-") as folder:
        path = f"{folder}/parity.npz"
        (shape, _) = run_distributed(_parity_worker, 2, cpu, path, timeout=200)
        trace = load_trace(path)
    expert = ExpertShape(hidden=shape["hidden"], ffn_hidden=shape["ffn"], mats=2, dtype_bytes=shape["dtype_bytes"])
    # copies and messages as the transport moves them; compute from the run's own fits
    if cpu:
        from deepspeed_feplb.migrate.shm import ShmTransport as Transport
    else:
        from deepspeed_feplb.migrate.cuda_ce import CudaCETransport as Transport
    model = replace(TimeModel.of(expert, PROFILES["h200"]), message_us=Transport.message_us)
    figures = compare_measured(trace, model, ranks_per_node=2, skip_steps=PARITY_SKIP, recorded_costs=True,
                               dynamic_experts=2)
    figures["moves"] = int(len(trace.plan_moves))
    # each micro-batch's plan when it came: the model's composition alone (PLANNER.md, "How far to trust")
    figures["own_plan_latency"] = compare_measured(trace, model, ranks_per_node=2, skip_steps=PARITY_SKIP,
                                                   recorded_costs=True, dynamic_experts=2, own_plan_latency=True)
    if cpu:
        return {**figures, "note": "CPU dry run: the path runs; the figures are a GPU's only on CUDA"}
    return {"ok": figures["median_abs_rel_error"] <= 0.15 and figures["p90_abs_rel_error"] <= 0.30, **figures}
