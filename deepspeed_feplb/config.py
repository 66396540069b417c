"""The ``"feplb"`` section of ``ds_config.json``: pydantic models, ``load_config()``, JSON schema.

The models are the documentation: every field's docstring becomes its description in
``config_schemas/feplb.schema.json`` (regenerate with
``python -m deepspeed_feplb schema --output config_schemas/feplb.schema.json``).

Example::

    "feplb": {
        "dynamic_experts_per_rank": 4,
        "nvlink_domain_size": "auto",
        "scheduler": {"mode": "process", "plan_timeout_ms": 20},
        "gating": {"score": "sigmoid"}
    }
"""
import argparse
import difflib
import json
import math
import os
import reprlib
import sys
import warnings
from typing import Annotated, Literal, Optional, Union, get_args, get_origin

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

__all__ = ["FEPLBConfig", "SchedulerConfig", "PlacementConfig", "GatingConfig", "StatsConfig", "FEPLBConfigError", "load_config",
           "schema", "idle_keys", "MIN_TRANSPORT_SLOT_MB"]

SECTION = "feplb"
SCHEMA_COMMAND = "python -m deepspeed_feplb schema --output config_schemas/feplb.schema.json"


class FEPLBConfigError(ValueError):
    """Invalid ``"feplb"`` section; the message names the offending key path (``feplb.scheduler.x``)."""

    what = "invalid ds_config"  # how a job that ends on it says so (`exits`)


class FEPLBModelError(FEPLBConfigError):
    """A model FEPLB cannot run as built (an expert with batch statistics, an ep_size that does not
    divide the world); the message names the module and the fix. A `FEPLBConfigError`, so that one
    ``except`` catches every mistake found before training."""

    what = "unsupported model"


class FEPLBConfigModel(BaseModel):
    """Base of the FEPLB config models, following ``deepspeed.runtime.config_utils.DeepSpeedConfigModel``.

    We replicate its conventions instead of subclassing it because importing it pulls in all of
    DeepSpeed and torch (~4 s and an accelerator warning), too slow for the CLI and the
    simulator: the same ``model_config`` (unknown keys are errors, aliases or field names both
    accepted, validation on assignment), and a value ``"auto"`` for a field that does not accept
    it means "use the default", as DeepSpeed's non-strict mode does (e.g. configs written for HF
    Trainer). Fields whose type includes ``Literal["auto"]`` keep ``"auto"`` as the string. A
    boolean is refused for a number field (pydantic would take ``true`` as 1: a key meant for
    another field, or a number written as a switch, would run as 1 unnoticed); integers are still
    numbers for float fields.
    Deprecations use pydantic's ``Field(deprecated=...)``: a warning on use and
    ``"deprecated": true`` in the schema.
    """

    model_config = ConfigDict(
        validate_default=True,
        validate_assignment=True,
        use_enum_values=True,
        populate_by_name=True,
        extra="forbid",
        arbitrary_types_allowed=True,
        protected_namespaces=(),
        use_attribute_docstrings=True,
    )

    @model_validator(mode="before")
    @classmethod
    def _drop_auto(cls, data):
        if isinstance(data, dict):
            fields = {key: f for name, f in cls.model_fields.items() for key in {name, f.alias} if key}
            data = {k: v for k, v in data.items()
                    if not (isinstance(v, str) and v == "auto" and k in fields and not _accepts_auto(fields[k].annotation))}
        return data

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_numbers(cls, value, info: ValidationInfo):
        if isinstance(value, bool) and _takes_number(cls.model_fields[info.field_name].annotation):
            raise PydanticCustomError("bool_not_number", "Input should be a number, not a boolean")
        return value


def _accepts_auto(annotation) -> bool:
    if get_origin(annotation) is Literal:
        return "auto" in get_args(annotation)
    return any(_accepts_auto(arg) for arg in get_args(annotation))


def _takes_number(annotation) -> bool:
    """Whether a field's type is, or has a member that is, ``int`` or ``float`` (not ``bool``)."""
    if annotation in (int, float):
        return True
    return get_origin(annotation) is not Literal and any(_takes_number(arg) for arg in get_args(annotation))


# The smallest phase-2 slot: a `cuda_ce` ring is `migrate.arena.RING_SLOTS` (4) slots, each a whole
# number of `arena.ALIGN` (256-byte) pieces (`arena.ring_capacity`), and a message travels through
# them as byte ranges (`cuda_ce.part_ranges`; its description is in the control block, not the
# ring), so 1 KiB is the least ring a slot size gives: a smaller one is rounded up to it, and one
# under a byte is 0 bytes, which no part fits. Not imported from `arena`, which loads torch.
MIN_TRANSPORT_SLOT_MB = 4 * 256 / 2**20
SERVE_PARTS_MAX = 16  # `serve_parts`' bound: a part's index travels in 4 bits of a phase-2 message's tag


def _slot_size(value: float) -> float:
    if not (math.isfinite(value) and value >= MIN_TRANSPORT_SLOT_MB):
        raise PydanticCustomError(
            "slot_too_small", "Input should be a finite number of at least {minimum} MiB (1 KiB: a phase-2 ring is 4 "
            "slots of whole 256-byte pieces, so a smaller size is rounded up to it, and one under a byte would be 0 "
            "bytes, which no message part fits)", {"minimum": MIN_TRANSPORT_SLOT_MB})
    return value


class SchedulerConfig(FEPLBConfigModel):
    """The CPU scheduler of each NVLink domain that decides where the tokens of dynamic experts are computed."""

    mode: Literal["process", "inline"] = "process"
    """'process': one scheduler process per NVLink domain (named feplb-sched) plans while the ranks compute their static experts; 'inline': every rank computes the (identical, deterministic) plan itself."""

    plan_timeout_ms: float = Field(20.0, gt=0)
    """How long a rank waits for the scheduler process's plan before computing the same plan in-process."""

    peer_timeout_s: float = Field(60.0, gt=0)
    """A peer rank that does not answer within this many seconds is declared dead; the error names it."""

    restart: bool = True
    """Restart the scheduler process if it dies (ranks use the in-process plan meanwhile)."""

    start_after_steps: int = Field(8, ge=0)
    """'process' mode, where plans move from the first micro-batch (fixed_costs 'ignore', max_rows_over_mean): micro-batch steps (MoE layer passes) the domain's first rank plans in-process before the scheduler process starts, so that short runs such as unit tests never pay for starting it (~0.7 s of CPU); 0 starts it while the engine is built. With measured costs (the default) the process always starts while the engine is built, since the domain moves nothing until it serves."""

    poll_ms: Optional[float] = Field(None, ge=0, deprecated="feplb.scheduler.poll_ms has no effect: the scheduler "
                                     "sleeps until the counts arrive; remove the key")
    """Deprecated, no effect (the scheduler process used to poll for this long after each plan; it now sleeps until a rank's counts wake it)."""

    @field_validator("poll_ms")
    @classmethod
    def _poll_ms_is_deprecated(cls, value):
        if value is not None:
            warnings.warn("feplb.scheduler.poll_ms has no effect: the scheduler sleeps until the counts arrive; "
                          "remove the key", DeprecationWarning, stacklevel=2)
        return value


class GatingConfig(FEPLBConfigModel):
    """How the router scores experts."""

    score: Literal["softmax", "sigmoid"] = "softmax"
    """'softmax': DeepSpeed's own TopKGate (top-1/top-2/top-k); 'sigmoid': sigmoid top-k scoring with aux-loss-free bias balancing (DeepSeek-V3 style)."""

    bias_update_rate: float = Field(1e-3, ge=0)
    """sigmoid: step size of the aux-loss-free balancing bias update (once per training forward, i.e. per micro-batch, towards the mean expert load)."""

    normalize_topk: bool = True
    """sigmoid: renormalise the selected top-k scores to sum to 1."""


class StatsConfig(FEPLBConfigModel):
    """Balancing statistics."""

    enabled: bool = True
    """Fill layer.feplb_stats on every forward: tokens per rank before and after balancing, migrated tokens and experts, plan latency, whether the fallback plan was used."""

    monitor: bool = True
    """Also write the stats to DeepSpeed's monitor (TensorBoard, W&B, CSV, ...) when one is configured."""

    record_trace: Optional[str] = None
    """Path of an .npz routing trace to record (counts int64 [micro_batches, layers, src_ranks, experts]), replayable by `python -m deepspeed_feplb simulate`; null: do not record."""


class PlacementConfig(FEPLBConfigModel):
    """Cross-node expert placement: which rank is each expert's home, re-decided at optimizer steps from the load history."""

    enabled: Union[bool, Literal["auto"]] = False
    """Re-place each MoE layer's experts over its EP group every interval_steps optimizer steps, balancing the nodes' loads; an expert moves with its optimizer state, only when the expected gain exceeds the move's time (the contents of expert slots move: per-parameter state kept outside the optimizer, such as an EMA copy of the weights, must be taken inside deepspeed_feplb.canonical_experts). Checkpoints keep DeepSpeed's layout. false: every expert keeps its home; replica slots (redundant_experts_per_rank) still work, and move no slot's contents. "auto": on when an MoE layer's EP group spans more than one NVLink domain (nodes) and the run supports placement (ZeRO stage 0 to 2 without fp16/bf16 at stage 0, no pipeline), decided at deepspeed_feplb.initialize (or when DeepSpeed's engine configures the layers); one line says why where such a group stays without it; a layer used without an engine has none."""

    interval_steps: int = Field(50, ge=1)
    """Optimizer steps between placement decisions."""

    history_decay: float = Field(0.1, gt=0, le=1)
    """Weight of the newest micro-batch in the exponential moving average of each expert's load."""

    redundant_experts_per_rank: Union[Annotated[int, Field(ge=0)], Literal["auto"]] = "auto"
    """Replica slots per rank (DeepSpeed MoE and AutoEP layers; AutoEP with its all-to-all dispatch), with placement enabled or not (then every expert keeps its home and only replicas are chosen): at each placement decision the hottest experts get a replica on another node where the predicted gain pays for its gradient exchange at every optimizer step (or, with max_rows_over_mean set, where it brings the busiest rank closer to that bound), each micro-batch splits their rows between the nodes, and at every optimizer step between decisions the replicas are chosen again on the recent micro-batches (they follow a hot set that drifts, those held staying unless a new set does better; with fixed_costs 'measured' the hosts' measured work on held replicas is priced too). A replica holds weights only (no optimizer state; each slot one expert's weights and an fp32 sum of its gradient while a step accumulates, plus for 16-bit experts the early half of that sum at the expert's home, and for a DeepSpeed MoE layer one held-back gradient of the expert: all counted at deepspeed_feplb.initialize, docs/GPU.md "Memory per rank"); its gradient is summed into the expert's before the optimizer step. A node holds one copy of an expert at most, so a layer of E experts over R ranks in N nodes fills at most E * (N - 1) / R slots per rank (more is refused when the layer is built); an EP group within one node has no replicas. "auto" (the default): 1 on the layers whose EP group spans more than one NVLink domain and whose experts compute on a GPU, decided at deepspeed_feplb.initialize once DeepSpeed has built the engine, where the run supports replicas (ZeRO stage 0 to 2 without fp16/bf16 at stage 0, no pipeline; DeepSpeed MoE experts without buffers; AutoEP with its all-to-all dispatch, not folded with AutoTP) and one slot in each such layer (with the buffers above) takes at most a quarter of the device memory free then beside FEPLB's other buffers, on every rank; else 0, one line saying why; a layer used without deepspeed_feplb.initialize (a plain deepspeed.initialize, or no engine) has none."""

    network_gbps: float = Field(50.0, gt=0)
    """Bandwidth per rank between nodes, in GB/s (1e9 bytes/s), used to price a move of an expert to another node and the replicas' exchange of gradients and weights at every optimizer step."""


class FEPLBConfig(FEPLBConfigModel):
    """The "feplb" section of ds_config.json: per-micro-batch MoE load balancing over the NVLink copy engine."""

    enabled: bool = True
    """Balance MoE layers with FEPLB, which computes every routed token (dropless; a layer built with drop_tokens=True, DeepSpeed's default, warns once that it drops none). false: the layers run DeepSpeed's own MoE unchanged, including its token dropping."""

    dynamic_experts_per_rank: int = Field(2, ge=0)
    """D: each rank's D hottest local experts of a micro-batch may be moved to helper ranks (and up to D more of its next hottest, one at a time, while the rows of the others exceed its domain's mean); the others are static and start computing at once. 0 disables migration."""

    max_helpers_per_expert: int = Field(7, ge=1)
    """Most helper ranks that the tokens of one dynamic expert are split over (each helper also receives the expert's weights); the planner uses as many as its time model says pay. 7: every other GPU of an 8-GPU node (more than a domain's other ranks means all of them)."""

    chunk_align_tokens: Union[Annotated[int, Field(ge=1)], Literal["auto"]] = "auto"
    """Token chunks moved to helpers are multiples of this many tokens (GEMM tile alignment). "auto": 128 where the experts compute on a GPU (the row tile of Hopper's grouped GEMM: a chunk of whole tiles adds no padded rows), 8 on host memory or with max_rows_over_mean set (a plan may leave a rank up to one chunk less a token over that bound)."""

    serve_parts: int = Field(4, ge=1, le=SERVE_PARTS_MAX)
    """A helper computes the chunks it serves for one home in up to this many parts, each of at least serve_part_rows rows, and sends each part's results (outputs, in backward input-gradients) home as soon as it is computed, so that only the last part's return is not hidden behind the helper's compute. 1: one call and one return per home."""

    serve_part_rows: int = Field(1024, ge=1)
    """Fewest rows in one of serve_parts' parts: smaller parts would cost more in calls and messages than their earlier return saves."""

    serve_on_arrival: Union[bool, Literal["auto"]] = "auto"
    """A helper computes each home's chunks as soon as their rows (in backward their output-gradients) are in, beside its own experts, and sends the results home at once, instead of after its own experts: on a GPU on a high-priority CUDA stream. On CPU ranks, where nothing runs beside the rank's own compute, it only serves before the rank's own dynamic experts' rows in forward. "auto": on where the experts compute on a GPU, off on host memory."""

    nvlink_domain_size: Union[Annotated[int, Field(ge=1)], Literal["auto"]] = "auto"
    """Consecutive ranks that share an NVLink / copy-engine domain (a node); migration stays inside a domain, which never spans hosts. 'auto': the ranks per host: the launcher's local world size (LOCAL_WORLD_SIZE or LOCAL_SIZE), else counted from the ranks' hostnames by deepspeed_feplb.initialize."""

    ep_backend: Literal["auto", "torch", "deepep"] = "auto"
    """Phase-1 expert-parallel dispatch: 'torch' (all_to_all_single), 'deepep' (DeepEP, CUDA); 'auto': deepep when available, else torch."""

    transport: Literal["auto", "shm", "cuda_ce"] = "auto"
    """Phase-2 migration transport: 'shm' (shared-memory arena and copy thread, CPU), 'cuda_ce' (CUDA IPC peer buffers, copies on the copy engine); 'auto': cuda_ce on CUDA, else shm."""

    copy_engine_gbps: float = Field(370.0, gt=0)
    """One-way copy-engine bandwidth between two GPUs of a domain, in GB/s (1e9 bytes/s); the planner's time model prices weight and row copies with it."""

    ce_budget: Union[Literal["auto"], Annotated[float, Field(ge=0)]] = "auto"
    """Cap on the expert-weight bytes a rank sends, and receives, per MoE layer pass (rows not counted). 'auto': no cap; the planner's time model keeps only the copies that shorten the slowest rank."""

    transport_slot_mb: Union[Literal["auto"], Annotated[float, AfterValidator(_slot_size),
                                                        Field(json_schema_extra={"minimum": MIN_TRANSPORT_SLOT_MB})]] = "auto"
    """Size of each phase-2 receive ring (one per peer of the domain, on the GPU with 'cuda_ce', split into 4 slots of a quarter each), in MiB, allocated once when the domain opens; a larger message travels through it in parts. At least 1/1024 (1 KiB: a ring of 4 slots of whole 256-byte pieces). 'auto': D chunks with their weights plus a rank's mean rows in one part (docs/GPU.md has the formula)."""

    weight_residency: Literal["step", "micro_batch"] = "step"
    """'step': a helper keeps a received copy until the optimizer step (later micro-batches need no new copy) and returns its accumulated weight-gradient in the step's last backward. 'micro_batch': copy and return every micro-batch (the paper's scheme)."""

    max_resident_experts: int = Field(8, ge=0)
    """'step' residency: expert copies a rank keeps per MoE layer; each costs its weights plus an fp32 weight-gradient (docs/GPU.md has the memory formula)."""

    keep_copies_across_steps: bool = True
    """'step' residency: the copies a step's last micro-batch used stay on their helpers for the next step: right after each optimizer step (from the second on, once the optimizer's state exists) every home sends them its new weights, which travel while the next step's first layers compute, so the next step's first micro-batch copies no weights in its MoE layers. Layers with cross-node placement or replica slots, pipeline-parallel runs, and layers stepped without deepspeed_feplb.initialize's engine forget their copies at the step's end instead. A forward without gradients (an evaluation) never computes with a kept copy."""

    resident_budget_mb: Union[Literal["auto"], Annotated[float, Field(ge=0)]] = "auto"
    """'step' residency: MiB of kept copies a rank holds over all its FEPLB layers (each copy counts its weights and its fp32 weight-gradient); a copy beyond it is used for its micro-batch only. 'auto': half the device memory a rank has free after deepspeed.initialize beside FEPLB's other buffers (the least over its domain; measured when the domain opens where deepspeed_feplb.initialize was not used), at most what max_resident_experts copies per layer take; no bound for CPU experts."""

    max_rows_over_mean: Optional[Annotated[float, Field(ge=1.0, allow_inf_nan=False)]] = None
    """Bound on any rank's rows, as a multiple of the EP group's mean rows per rank (e.g. to bound activation memory); the fastest plan within the bound wins; with placement.redundant_experts_per_rank, replicas are chosen to bring the busiest rank within it too, even where they cost time. null: minimise expert time alone, which at small micro-batches may leave rows unbalanced."""

    fixed_costs: Literal["measured", "ignore"] = "measured"
    """'measured': price each expert piece and message as timed on this rank, and skip micro-batches no move can speed up; replica slots (placement.redundant_experts_per_rank) are priced with what the hosts spent on held replicas beyond their modelled exchange, measured each step. 'ignore': rows and bytes only, so moves happen at any size (exactness tests at toy sizes)."""

    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    placement: PlacementConfig = Field(default_factory=PlacementConfig)
    gating: GatingConfig = Field(default_factory=GatingConfig)
    stats: StatsConfig = Field(default_factory=StatsConfig)


# (why the keys have no effect, when, the keys): `idle_keys`, checked in this order
_MIGRATION = ("transport", "max_helpers_per_expert", "chunk_align_tokens", "serve_on_arrival", "serve_parts", "serve_part_rows", "ce_budget", "transport_slot_mb", "weight_residency",
              "max_resident_experts", "keep_copies_across_steps", "resident_budget_mb", "scheduler.mode", "scheduler.plan_timeout_ms",
              "scheduler.restart", "scheduler.start_after_steps")
_IDLE_RULES = (
    ("feplb.dynamic_experts_per_rank is 0: no expert moves inside a node (no phase 2, no scheduler)",
     lambda c: c.dynamic_experts_per_rank == 0, _MIGRATION),
    ("feplb.placement.enabled is false and feplb.placement.redundant_experts_per_rank 0: no cross-node layer",
     lambda c: c.placement.enabled is False and c.placement.redundant_experts_per_rank == 0,
     ("placement.interval_steps", "placement.history_decay", "placement.network_gbps")),
    ("feplb.placement.enabled is false: every expert keeps its home and replicas are chosen from the last "
     "micro-batches, not the load history",
     lambda c: c.placement.enabled is False, ("placement.history_decay", )),
    ("feplb.weight_residency is \"micro_batch\": no copy is kept past its micro-batch",
     lambda c: c.weight_residency == "micro_batch",
     ("max_resident_experts", "resident_budget_mb", "keep_copies_across_steps")),
    ("feplb.max_resident_experts is 0: no copy is kept past its micro-batch",
     lambda c: c.max_resident_experts == 0, ("resident_budget_mb", "keep_copies_across_steps")),
    ("feplb.scheduler.mode is \"inline\": every rank plans itself, no scheduler process",
     lambda c: c.scheduler.mode == "inline",
     ("scheduler.plan_timeout_ms", "scheduler.restart", "scheduler.start_after_steps")),
    ("feplb.gating.score is \"softmax\": DeepSpeed's own gate scores the experts",
     lambda c: c.gating.score == "softmax", ("gating.bias_update_rate", "gating.normalize_topk")),
    ("feplb.stats.enabled is false", lambda c: not c.stats.enabled, ("stats.monitor", )),
)


def idle_keys(config: FEPLBConfig) -> list[str]:
    """One line per reason that keys set in ``config`` (to other than their default) have no
    effect beside the others, naming them (each key once, under the first reason):
    ``deepspeed_feplb.initialize`` says each line once per job, so that a setting that does nothing
    is not taken for one that works. A key left at its default is never named: it changes nothing
    either way."""
    named, lines = set(), []
    for why, applies, keys in _IDLE_RULES:
        if not applies(config):
            continue
        idle = [key for key in keys if key not in named and _changed(config, key)]
        named.update(idle)
        if idle:
            what = ", ".join(f"feplb.{key}" for key in idle)
            lines.append(f"{why}, so {what} {'has' if len(idle) == 1 else 'have'} no effect")
    return lines


def _changed(config: FEPLBConfig, key: str) -> bool:
    """Whether the dotted ``key`` (under ``feplb``) was given a value other than its default."""
    *parents, name = key.split(".")
    model = config
    for parent in parents:
        model = getattr(model, parent)
    field = type(model).model_fields[name]
    return name in model.model_fields_set and getattr(model, name) != field.get_default(call_default_factory=True)


def load_config(ds_config: Union[dict, str, os.PathLike]) -> FEPLBConfig:
    """Validate the ``"feplb"`` section of a whole ds_config (a dict, or the path of a JSON file).

    A missing section gives the defaults. Raises ``FEPLBConfigError`` naming the offending key
    path (``feplb.scheduler.plan_timeout_ms: ...``), the file, or the section.
    """
    where = "ds_config"
    if isinstance(ds_config, (str, os.PathLike)):
        where = os.fspath(ds_config)
        try:
            with open(where) as f:
                ds_config = json.load(f)
        except (OSError, ValueError) as e:
            raise FEPLBConfigError(f"{where}: cannot read the ds_config JSON file: {e}") from e
    if not isinstance(ds_config, dict):
        raise FEPLBConfigError(f"{where}: the ds_config must be a JSON object (got {type(ds_config).__name__})")
    if SECTION not in ds_config:
        misspelled = [k for k in ds_config if isinstance(k, str)
                      and difflib.get_close_matches(SECTION, [k.lower()], n=1, cutoff=0.7)]
        if misspelled:  # DeepSpeed ignores unknown sections: the run would go on without FEPLB's settings
            raise FEPLBConfigError(f"{misspelled[0]}: unknown ds_config section, did you mean '{SECTION}'?")
    section = ds_config.get(SECTION, {})
    if not isinstance(section, dict):
        raise FEPLBConfigError(f"{SECTION}: the section must be a JSON object (got {reprlib.repr(section)})")
    try:
        return FEPLBConfig(**section)
    except ValidationError as e:
        raise FEPLBConfigError(_describe(e)) from None


def _describe(error: ValidationError) -> str:
    """One line per offending key: ``feplb.<path>: <problem> (got <value>)``."""
    problems = {}  # path -> (messages, input); the alternatives of a union share one path
    for err in error.errors(include_url=False):
        path, model = [SECTION], FEPLBConfig
        for part in err["loc"]:  # stop at the first key that is not a sub-model (drops union tags)
            path.append(str(part))
            parent, field = model, model.model_fields.get(part)
            model = field.annotation if field else None
            if not (isinstance(model, type) and issubclass(model, BaseModel)):
                break
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            close = difflib.get_close_matches(str(err["loc"][-1]), list(parent.model_fields), n=1)
            msg = "unknown key" + (f", did you mean '{close[0]}'?" if close else f"; valid keys: {', '.join(parent.model_fields)}")
        messages, _ = problems.setdefault(".".join(path), ([], err["input"]))
        messages.append(msg)
    return "\n".join(f"{path}: {_either(msgs)} (got {reprlib.repr(value)})" for path, (msgs, value) in problems.items())


def _either(messages) -> str:
    """Join the alternatives of a union: "Input should be 'auto' or greater than or equal to 0"."""
    first, *rest = messages
    return " or ".join([first, *(m.removeprefix("Input should be ") for m in rest)])


def schema() -> dict:
    """The JSON schema of the ``"feplb"`` section (as checked in at ``config_schemas/feplb.schema.json``)."""
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", **FEPLBConfig.model_json_schema()}


def schema_text() -> str:
    """``schema()`` as written to ``config_schemas/feplb.schema.json``: sorted keys, indent 2, final newline."""
    return json.dumps(schema(), indent=2, sort_keys=True) + "\n"


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``python -m deepspeed_feplb schema [--output PATH]``."""
    parser = subparsers.add_parser("schema", help="print the JSON schema of the \"feplb\" ds_config section",
                                   description="Print (or write) the JSON schema of the \"feplb\" section of ds_config.json.")
    parser.add_argument("--output", metavar="PATH", help="write the schema to PATH instead of stdout")
    parser.set_defaults(func=_schema_command)
    return parser


def _schema_command(args) -> int:
    text = schema_text()
    if args.output:
        with open(args.output, "w") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    return 0
