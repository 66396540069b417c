"""`convert` and `initialize`: FEPLB for models that use DeepSpeed's MoE layer."""
from __future__ import annotations

import inspect
import json
from typing import Optional

import deepspeed
from deepspeed.moe.layer import MoE as DeepSpeedMoE

from deepspeed_feplb import exits
from deepspeed_feplb.config import FEPLBConfig, FEPLBConfigError, FEPLBModelError, idle_keys, load_config
from deepspeed_feplb.domain import learn_ranks_per_host
from deepspeed_feplb.integration import seams
from deepspeed_feplb.integration.deepspeed_moe import MoE
from deepspeed_feplb.once import first_time


def convert(model, feplb_config=None):
    """Swap every `deepspeed.moe.layer.MoE` in ``model`` for `deepspeed_feplb.MoE`, in place.

    Weights, parameter objects and names stay as they are (an optimizer built before keeps
    working). ``feplb_config``: a `FEPLBConfig`, a ``"feplb"`` dict or a ds_config; None lets each
    layer find the engine's section or use the defaults. Returns ``model``; ``print(model)``
    shows each converted layer as ``MoE(FEPLB, ...)``, and ``isinstance(m, deepspeed_feplb.MoE)`` is
    true for it.
    """
    for module in model.modules():
        if isinstance(module, DeepSpeedMoE) and not isinstance(module, MoE):
            MoE.from_deepspeed(module, feplb_config)
        elif isinstance(module, MoE) and feplb_config is not None:
            module.deepspeed_moe.feplb_setup(feplb_config)
    return model


def init_distributed(*args, **kwargs):
    """`deepspeed.init_distributed` (same arguments); on a machine without CUDA it does not build
    DeepSpeed's CPU shared-memory allreduce op (minutes of C++ compile on first use, 66 MiB left
    in /dev/shm per rank), so collectives use gloo."""
    import torch

    if torch.cuda.is_available():
        return deepspeed.init_distributed(*args, **kwargs)
    with seams.without_cpu_shm_op():
        return deepspeed.init_distributed(*args, **kwargs)


def initialize(*args, **kwargs):
    """`deepspeed.initialize` with FEPLB: same arguments, same return.

    Reads and validates the ``"feplb"`` section of the ds_config (`FEPLBConfigError` names a bad
    key; keys set where they have no effect are said once, `say_idle_keys`), converts the model's
    MoE layers and hands everything to DeepSpeed. On a machine
    without CUDA it initialises the process group without DeepSpeed's shared-memory allreduce op
    (`init_distributed`) and gives an ``"Adam"``/``"AdamW"`` optimizer torch's implementation unless
    ``torch_adam`` is set (both would otherwise compile C++ ops for minutes), saying so once. For a
    `PipelineModule` it first creates the expert-parallel groups on every rank (creating them
    lazily on the MoE stages only makes a later ``new_group`` hang), refuses bf16 when some stage
    has no MoE layer (that configuration hangs in DeepSpeed's optimizer, upstream #6714) and
    builds a `deepspeed_feplb.integration.pipeline.FEPLBPipelineEngine`. With ``feplb.stats.enabled`` every
    engine gets ``engine.feplb_monitor`` (a `deepspeed_feplb.integration.monitor.StatsCollector`, also
    ``engine.feplb_stats``, its earlier name): per-layer
    statistics of each step, written to DeepSpeed's monitor when one is configured. Layers that
    DeepSpeed AutoEP (``"expert_parallel"``) built get FEPLB phase 2 too (`deepspeed_feplb.integration.autoep`).
    """
    exits.install()  # one line, not a traceback per rank, for a bad "feplb" section or a Ctrl-C
    bound = inspect.signature(deepspeed.initialize).bind(*args, **kwargs)
    given = bound.arguments
    ds_config = given.get("config") or given.get("config_params")
    if ds_config is None and getattr(given.get("args"), "deepspeed_config", None):
        ds_config = given["args"].deepspeed_config
    model = given.get("model")
    if model is None:
        raise TypeError("deepspeed_feplb.initialize: a model is required (as for deepspeed.initialize)")
    config = load_config(ds_config) if ds_config is not None else FEPLBConfig()
    import torch.distributed as dist
    if not dist.is_initialized() and given.get("dist_init_required") is not False:
        # what deepspeed.initialize would do first, without building the CPU shm op
        init_distributed(**({"distributed_port": given["distributed_port"]} if "distributed_port" in given else {}))
    auto_slots = config.placement.redundant_experts_per_rank == "auto"  # decided by every rank alike, below
    if config.enabled:
        learn_ranks_per_host()  # where the launcher does not tell it (srun, mpirun): domains stay on one host
        from deepspeed_feplb.integration.placement_engine import moe_ep_sizes, resolve_auto
        ds_dict = _as_dict(ds_config)  # a path is read once
        ep_sizes = moe_ep_sizes(model, ds_dict)
        config = resolve_auto(config, model, ds_dict, ep_sizes)
        say_idle_keys(config)
    convert(model, config)
    check_consistency(model, config)
    bound = _cpu_adam(bound, ds_config)

    from deepspeed.runtime.pipe.dualpipev import DualPipeVModule
    from deepspeed.runtime.pipe.module import PipelineModule
    placed = False
    if config.enabled:
        from deepspeed_feplb.integration.placement_engine import check_config as check_placement
        from deepspeed_feplb.integration.placement_engine import cross_node_layer
        placed = cross_node_layer(config, ep_sizes)
        if placed:
            check_placement(model, ds_dict)
    if isinstance(model, PipelineModule) and not isinstance(model, DualPipeVModule):
        from deepspeed_feplb.integration.pipeline import FEPLBPipelineEngine
        _prepare_pipeline(model, _as_dict(ds_config))
        with seams.pipeline_engine_class(FEPLBPipelineEngine):
            result = deepspeed.initialize(*bound.args, **bound.kwargs)
        if config.enabled:
            check_memory(result[0].module, config)
        if not config.stats.enabled:
            result[0].feplb_monitor.remove()
        return result
    result = deepspeed.initialize(*bound.args, **bound.kwargs)
    if config.enabled and auto_slots:  # every rank, whatever its own layers: a collective
        config = resolve_replica_slots(config, result[0].module)
        _reconfigure(result[0].module, config)
        placed = cross_node_layer(config, ep_sizes)
    if placed:
        from deepspeed_feplb.integration.placement_engine import install as install_placement
        install_placement(result[0])
    from deepspeed_feplb.integration.autoep import install as install_autoep
    install_autoep(result[0].module, config, result[0])  # Hugging Face MoE layers sharded by DeepSpeed AutoEP
    if config.enabled:
        check_memory(result[0].module, config)
    if config.enabled and config.weight_residency == "step" and config.keep_copies_across_steps:
        _refresh_after_steps(result[0])
    if config.stats.enabled:
        _attach_stats(result[0], config)
    return result


def _reconfigure(model, config: FEPLBConfig) -> None:
    """Give ``model``'s converted DeepSpeed MoE layers ``config`` with its replica slots decided
    (`resolve_replica_slots`), a layer whose EP group is one NVLink domain none (it has no use for
    them, and no line says that a key it was not given has no effect); they build their FEPLB parts
    from it at their first forward."""
    from deepspeed_feplb.domain import domain_size
    from deepspeed_feplb.integration.deepspeed_moe import FEPLBMOELayer
    from deepspeed_feplb.integration.placement_engine import with_replica_slots
    one_domain = with_replica_slots(config, 0)
    for module in model.modules():
        if isinstance(module, FEPLBMOELayer):
            module.feplb_config = config if module.ep_size > domain_size(config, module.ep_size) else one_domain


def _refresh_after_steps(engine) -> None:
    """Hold the copies each layer's last micro-batch used again after every optimizer step from the
    second (the first may allocate the optimizer's state), with the stepped weights
    (`migrate.refresh`); layers with cross-node placement or replica slots forget theirs."""
    from deepspeed_feplb.expert_stage import ExpertStage
    from deepspeed_feplb.migrate.refresh import refresh_kept_copies

    def after_step(boundary: bool) -> None:
        if not boundary:
            return
        layers = [m for m in engine.module.modules() if isinstance(getattr(m, "stage", None), ExpertStage)]
        if engine.global_steps >= 2:
            refresh_kept_copies([m.stage for m in layers if getattr(m, "placement", None) is None])
        for m in layers:  # what no refresh took is forgotten now, not held through the next step
            if m.stage.residency is not None:
                m.stage.residency.unpark()

    seams.after_step(engine, after_step)


def say_idle_keys(config: FEPLBConfig) -> None:
    """Print each line of `config.idle_keys` (keys set to no effect beside the others) once per job:
    once per process (`once.first_time`), on rank 0."""
    import torch.distributed as dist
    for line in idle_keys(config):
        if first_time(("idle keys", line)) and (not dist.is_initialized() or dist.get_rank() == 0):
            print(f"deepspeed_feplb: {line}", flush=True)


def _cpu_adam(bound: inspect.BoundArguments, ds_config) -> inspect.BoundArguments:
    """On a machine without CUDA, an ``"Adam"``/``"AdamW"`` optimizer that does not choose
    ``torch_adam`` gets torch's implementation: DeepSpeed's own first compiles a C++ op for
    minutes. Says so once (rank 0); the user's config object is not modified."""
    import torch

    if torch.cuda.is_available() or ds_config is None or bound.arguments.get("optimizer") is not None:
        return bound
    config = _as_dict(ds_config)
    optimizer = config.get("optimizer")
    if not isinstance(optimizer, dict) or str(optimizer.get("type", "")).lower() not in ("adam", "adamw"):
        return bound
    params = optimizer.get("params") or {}
    if "torch_adam" in params:
        return bound
    import torch.distributed as dist
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"deepspeed_feplb: no CUDA here: optimizer {optimizer['type']!r} uses torch's implementation "
              "(\"torch_adam\": true) instead of compiling DeepSpeed's C++ Adam op, which takes minutes; set "
              "\"torch_adam\" in the optimizer's params to choose", flush=True)
    config = {**config, "optimizer": {**optimizer, "params": {**params, "torch_adam": True}}}
    args = bound.arguments
    if args.get("config") is not None:
        args["config"] = config
    elif args.get("config_params") is not None:
        args["config_params"] = config
    else:  # given as args.deepspeed_config: DeepSpeed refuses a config in both places
        import copy
        args["args"] = copy.copy(args["args"])
        args["args"].deepspeed_config = None
        args["config"] = config
    return bound


def check_consistency(model, config: FEPLBConfig) -> None:
    """Check the ``"feplb"`` section against the model and this machine; `FEPLBConfigError` says what to change."""
    if not config.enabled:
        return
    import os

    import torch.distributed as dist

    from deepspeed_feplb.dispatch import validate_dispatcher
    from deepspeed_feplb.domain import moves_in_domains, validate_domain_size
    from deepspeed_feplb.migrate import validate_transport

    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    for name, module in model.named_modules():
        if not isinstance(module, MoE):
            continue
        where = f"MoE layer {name or '<model>'}"
        if module.ep_size > world or world % module.ep_size:
            raise FEPLBModelError(f"{where}: ep_size={module.ep_size} does not divide the world size {world}; "
                                   f"use an ep_size that divides {world}")
        if module.num_experts % module.ep_size:
            raise FEPLBModelError(f"{where}: {module.num_experts} experts cannot be split over ep_size="
                                   f"{module.ep_size}; use a multiple of {module.ep_size} experts")
        validate_domain_size(config, module.ep_size)
        if config.dynamic_experts_per_rank > module.num_local_experts:
            raise FEPLBConfigError(
                f"feplb.dynamic_experts_per_rank: {config.dynamic_experts_per_rank} exceeds the "
                f"{module.num_local_experts} local experts per rank of {where}; use at most {module.num_local_experts}")
        params = list(module.deepspeed_moe.experts.deepspeed_experts[0].parameters())
        if moves_in_domains(config, module.ep_size):
            validate_transport(config, params)
        validate_dispatcher(config, module.ep_size, params, module.deepspeed_moe.gate.wg.in_features)


def check_memory(model, config: FEPLBConfig) -> None:
    """`memory.check_at_initialize` over the model's FEPLB layers of both kinds, once DeepSpeed has
    put its weights, gradients and optimizer states on the devices (collective over each EP group)."""
    from deepspeed_feplb.integration.autoep import FEPLBGroupedExperts
    from deepspeed_feplb.integration.deepspeed_moe import FEPLBMOELayer
    from deepspeed_feplb.memory import check_at_initialize
    facts = [m.memory_facts() for m in model.modules() if isinstance(m, (FEPLBMOELayer, FEPLBGroupedExperts))]
    check_at_initialize([f for f in facts if f is not None], config)


# "auto" replica slots take at most this share of the device memory free once the engine is built
AUTO_REPLICA_FREE_SHARE = 0.25


def resolve_replica_slots(config: FEPLBConfig, model) -> FEPLBConfig:
    """``config`` with ``feplb.placement.redundant_experts_per_rank: "auto"`` (left by `resolve_auto`
    for a job whose EP groups span NVLink domains, on a run that supports placement) decided, with
    DeepSpeed's engine built: 1 where every rank's FEPLB layers over such groups (``model``'s
    DeepSpeed MoE and AutoEP layers) can take a replica slot (`_replica_slot_problem`), else 0 with
    one line saying why (global rank 0). Collective over the world, called by every rank of a job
    that asked for "auto" (a rank that `resolve_auto` already set to 0 takes part and keeps 0); any
    other setting is returned as it is."""
    import torch.distributed as dist

    from deepspeed_feplb.collectives import gather_small
    from deepspeed_feplb.integration.placement_engine import with_replica_slots
    rank = dist.get_rank() if dist.is_initialized() else 0
    undecided = config.placement.redundant_experts_per_rank == "auto"
    problem = _replica_slot_problem(config, model, rank) if undecided else None
    problems = gather_small(problem, device=_expert_device(model)) if dist.is_initialized() else [problem]
    if not undecided:
        return config
    found = next((p for p in problems if p is not None), None)
    if found is not None and rank == 0:
        print(f'deepspeed_feplb: feplb.placement.redundant_experts_per_rank is "auto" and stays 0: {found}; set it '
              "to a number of slots to have them anyway", flush=True)
    return with_replica_slots(config, int(found is None))


def _replica_slot_problem(config: FEPLBConfig, model, rank: int) -> Optional[str]:
    """Why this rank's (global ``rank``) FEPLB layers over EP groups that span NVLink domains cannot take one replica
    slot each (None: they can, or there is none): an expert kind that has no replicas, experts in
    host memory (CPU ranks, whose collectives run over gloo: 2 CPU ranks as 2 nodes took 1.135x as
    long per step with a slot that held nothing, the step's loads all-reduce and review alone,
    `benchmarks/bench_replicas_runtime.py`), or slots larger than `AUTO_REPLICA_FREE_SHARE` of the
    device memory free now less what FEPLB's other buffers take (`memory.group_memory` of every
    layer, without a DeepEP buffer, and a ``resident_budget_mb`` set)."""
    from deepspeed_feplb.domain import domain_size, moves_in_domains
    from deepspeed_feplb.integration.autoep import DEEPEP_BACKEND, autoep_layers
    from deepspeed_feplb.integration.deepspeed_moe import FEPLBMOELayer
    from deepspeed_feplb.memory import ExpertSizes, MiB, device_free_bytes, group_memory, replica_bytes
    from deepspeed_feplb.migrate import transport_kind

    layers = []  # (name, EP size, one expert's parameters, hidden size, why it cannot hold a replica or None)
    for name, m in model.named_modules():
        if isinstance(m, FEPLBMOELayer):
            expert = m.experts.deepspeed_experts[0]
            why = f"the experts of MoE layer {name} have buffers, which a replica slot does not hold" \
                if any(True for _ in expert.buffers()) else None
            layers.append((name, m.ep_size, list(expert.parameters()), m.gate.wg.in_features, why))
    for name, layer in autoep_layers(model).items():
        folding = getattr(layer, "folding_group_handles", None)
        why = (f"AutoEP layer {name} dispatches with DeepEP, and replica slots need AutoEP's all-to-all"
               if getattr(layer, "comm_backend", None) == DEEPEP_BACKEND else
               f"AutoEP layer {name} is folded with AutoTP, which replica slots do not cover"
               if folding is not None and folding.spec.tp_size > 1 else None)
        params = [w[0] for w in (layer.experts.w1, layer.experts.w2, layer.experts.w3)]
        layers.append((name, layer.ep_size, params, params[0].shape[1], why))
    spanning = [layer for layer in layers if layer[1] > domain_size(config, layer[1])]
    if not spanning:
        return None
    why = next((why for *_, why in spanning if why is not None), None)
    if why is not None:
        return why
    free = device_free_bytes(spanning[0][2][0].device)
    if free is None:
        return "the experts are in host memory (CPU ranks), where the replicas' step-end collectives cost more than " \
               "they save"
    others = 0
    for size in {layer[1] for layer in layers}:  # each EP group's buffers, as `memory.check_at_initialize` counts them
        members = [layer for layer in layers if layer[1] == size]
        need = group_memory(config, size, domain_size(config, size),
                            [ExpertSizes.of(params, hidden) for _, _, params, hidden, _ in members],
                            moves_in_domains(config, size) and transport_kind(config, members[0][2]) == "cuda_ce")
        others += need.fixed + need.kept_set(config)
    autoep = set(autoep_layers(model))  # whose ranks hold no gradient back (`memory.replica_bytes`)
    need = sum(replica_bytes(params, 1, allocated=False, held_back=name not in autoep)
               for name, _, params, _, _ in spanning)
    if need > AUTO_REPLICA_FREE_SHARE * (free - others):
        return (f"rank {rank} has {free / MiB:,.0f} MiB of device memory free, FEPLB's other buffers take "
                f"{others / MiB:,.0f} MiB, and a replica slot in each of its {len(spanning)} cross-node MoE layers "
                f"takes {need / MiB:,.0f} MiB, more than {AUTO_REPLICA_FREE_SHARE:.0%} of what is left")
    return None


def _expert_device(model):
    """The device of ``model``'s first parameter (for `gather_small` on an NCCL group), or None."""
    first = next(iter(model.parameters()), None)
    return first.device if first is not None else None


def _as_dict(ds_config) -> dict:
    if ds_config is None:
        return {}
    if isinstance(ds_config, dict):
        return ds_config
    with open(ds_config) as f:
        return json.load(f)


def _prepare_pipeline(model, ds_config: dict) -> None:
    """Collective over the world: eager EP/EDP groups for every MoE size of any stage; the bf16 check."""
    import torch.distributed as dist

    sizes = sorted({m.ep_size for m in model.modules() if isinstance(m, DeepSpeedMoE)})
    existing = set(seams.expert_parallel_group_names())
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (sizes, sorted(existing)))
    all_sizes = sorted({s for stage_sizes, _ in everyone for s in stage_sizes})
    for size in all_sizes:
        name = f"ep_size_{size}"
        have = [name in names for _, names in everyone]
        if all(have):
            continue
        if any(have):
            raise RuntimeError(f"deepspeed_feplb.initialize: expert-parallel group {name} exists on ranks "
                               f"{[r for r, h in enumerate(have) if h]} only; create MoE process groups on all ranks "
                               "or on none before initialize")
        seams.create_expert_parallel_groups(size, model.num_stages)
    if all_sizes and _bf16(ds_config) and not all(stage_sizes for stage_sizes, _ in everyone):
        without = [r for r, (stage_sizes, _) in enumerate(everyone) if not stage_sizes]
        raise ValueError("deepspeed_feplb.initialize: bf16 with pipeline parallelism and MoE layers on only some "
                         f"stages hangs in DeepSpeed's BF16 optimizer (deepspeedai/DeepSpeed#6714; ranks {without} "
                         "hold no MoE layer). Put an MoE layer on every stage, or train in fp32.")


def _bf16(ds_config: dict) -> bool:
    section = ds_config.get("bf16", ds_config.get("bfloat16", {}))
    return isinstance(section, dict) and section.get("enabled") is True


def _attach_stats(engine, config: FEPLBConfig) -> None:
    """Collect per-step FEPLB stats on a `DeepSpeedEngine`; flush them at each accumulation boundary."""
    from deepspeed_feplb.integration.monitor import StatsCollector

    collector = engine.feplb_monitor = StatsCollector(engine.module)
    engine.feplb_stats = collector  # its name until the layout change; code written then keeps working
    if not collector.layers:
        return

    def flush(boundary: bool) -> None:
        if boundary:
            collector.flush(engine.global_steps, engine.monitor if config.stats.monitor else None)

    seams.after_step(engine, flush)
