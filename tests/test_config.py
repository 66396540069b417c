"""The "feplb" ds_config section: defaults, "auto", loading, key-path errors, the checked-in schema."""
import argparse
import json
import pathlib
import re

import pytest

from deepspeed_feplb.config import (
    MIN_TRANSPORT_SLOT_MB,
    SCHEMA_COMMAND,
    FEPLBConfig,
    FEPLBConfigError,
    add_parser,
    idle_keys,
    load_config,
    schema,
    schema_text,
)
from deepspeed_feplb.once import forget

SCHEMA_FILE = pathlib.Path(__file__).resolve().parents[1] / "config_schemas" / "feplb.schema.json"


def test_schema_file_is_not_stale():
    assert SCHEMA_FILE.exists(), f"missing {SCHEMA_FILE}; generate it with: {SCHEMA_COMMAND}"
    assert SCHEMA_FILE.read_text() == schema_text(), f"{SCHEMA_FILE} is stale; regenerate it with: {SCHEMA_COMMAND}"


def test_schema_documents_every_field():
    s = schema()
    for model in [s, *s["$defs"].values()]:
        assert model["additionalProperties"] is False
        for name, prop in model["properties"].items():
            assert "$ref" in prop or prop.get("description"), f"{name} has no docstring"


@pytest.mark.parametrize("output", [None, "out.json"])
def test_schema_command(tmp_path, capsys, output):
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["schema"] + (["--output", str(tmp_path / output)] if output else []))
    assert args.func(args) == 0
    text = (tmp_path / output).read_text() if output else capsys.readouterr().out
    assert json.loads(text) == schema() and text == schema_text()


def test_defaults():
    cfg = load_config({})
    assert cfg == FEPLBConfig()
    assert cfg.model_dump() == {
        "enabled": True, "dynamic_experts_per_rank": 2, "max_helpers_per_expert": 7, "chunk_align_tokens": "auto",
        "serve_parts": 4, "serve_part_rows": 1024, "serve_on_arrival": "auto",
        "nvlink_domain_size": "auto", "ep_backend": "auto", "transport": "auto", "copy_engine_gbps": 370.0,
        "ce_budget": "auto", "transport_slot_mb": "auto", "weight_residency": "step", "max_resident_experts": 8,
        "keep_copies_across_steps": True, "resident_budget_mb": "auto", "max_rows_over_mean": None,
        "fixed_costs": "measured",
        "scheduler": {"mode": "process", "plan_timeout_ms": 20.0, "peer_timeout_s": 60.0, "restart": True,
                      "start_after_steps": 8, "poll_ms": None},
        "placement": {"enabled": False, "interval_steps": 50, "history_decay": 0.1,
                      "redundant_experts_per_rank": "auto", "network_gbps": 50.0},
        "gating": {"score": "softmax", "bias_update_rate": 1e-3, "normalize_topk": True},
        "stats": {"enabled": True, "monitor": True, "record_trace": None},
    }


@pytest.mark.parametrize("ds_config", [{}, {"train_batch_size": 8}, {"feplb": {}}])
def test_missing_or_empty_section_gives_defaults(ds_config):
    assert load_config(ds_config) == FEPLBConfig()


def test_auto():
    # Fields that accept "auto" keep the string; elsewhere "auto" means the default (DeepSpeed's convention).
    auto = {"nvlink_domain_size": "auto", "ce_budget": "auto", "ep_backend": "auto", "transport": "auto"}
    cfg = load_config({"feplb": {**auto, "dynamic_experts_per_rank": "auto", "scheduler": {"plan_timeout_ms": "auto"}}})
    assert cfg.model_dump(include=set(auto)) == auto
    assert cfg.dynamic_experts_per_rank == 2 and cfg.scheduler.plan_timeout_ms == 20.0
    assert cfg.model_fields_set == set(auto) | {"scheduler"}
    cfg = load_config({"feplb": {"nvlink_domain_size": 4, "ce_budget": 1e8}})
    assert cfg.nvlink_domain_size == 4 and cfg.ce_budget == 1e8
    cfg.nvlink_domain_size = "auto"  # validated on assignment
    assert cfg.nvlink_domain_size == "auto"
    with pytest.raises(ValueError):
        cfg.nvlink_domain_size = 0


SECTION = {
    "enabled": False, "dynamic_experts_per_rank": 4, "max_helpers_per_expert": 3, "chunk_align_tokens": 64,
    "serve_parts": 2, "serve_part_rows": 512, "serve_on_arrival": False, "nvlink_domain_size": 8,
    "ep_backend": "deepep", "transport": "cuda_ce",
    "copy_engine_gbps": 300.0,
    "ce_budget": 2e9, "transport_slot_mb": 256.0, "weight_residency": "micro_batch", "max_resident_experts": 3,
    "keep_copies_across_steps": False, "resident_budget_mb": 4096.0, "max_rows_over_mean": 1.05,
    "fixed_costs": "ignore",
    "scheduler": {"mode": "inline", "plan_timeout_ms": 5.0, "peer_timeout_s": 10.0, "restart": False,
                  "start_after_steps": 0, "poll_ms": None},
    "placement": {"enabled": True, "interval_steps": 10, "history_decay": 0.5, "redundant_experts_per_rank": 0,
                  "network_gbps": 25.0},
    "gating": {"score": "sigmoid", "bias_update_rate": 0.01, "normalize_topk": False},
    "stats": {"enabled": False, "monitor": False, "record_trace": "trace.npz"},
}


def test_load_from_dict():
    assert load_config({"train_batch_size": 8, "feplb": SECTION}).model_dump() == SECTION


def test_load_from_json_file(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps({"train_batch_size": 8, "feplb": SECTION}))
    assert load_config(path).model_dump() == SECTION
    assert load_config(str(path)).model_dump() == SECTION


def test_bad_json_file_names_the_file(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text('{"feplb": {"enabled": true,}}')
    with pytest.raises(FEPLBConfigError, match=re.escape(str(path))):
        load_config(path)
    with pytest.raises(FEPLBConfigError, match=re.escape(str(tmp_path / "missing.json"))):
        load_config(tmp_path / "missing.json")
    path.write_text("[1, 2]")
    with pytest.raises(FEPLBConfigError, match=re.escape(str(path))):
        load_config(path)


@pytest.mark.parametrize("section", [None, 5, "auto", [1]])
def test_bad_section_type_names_the_section(section):
    with pytest.raises(FEPLBConfigError, match=r"^feplb: .*JSON object"):
        load_config({"feplb": section})


BAD_VALUES = [
    ("enabled", "maybe"),
    ("dynamic_experts_per_rank", -1),
    ("dynamic_experts_per_rank", 1.5),
    ("max_helpers_per_expert", 0),
    ("chunk_align_tokens", 0),
    ("chunk_align_tokens", "tile"),
    ("serve_parts", 0),
    ("serve_parts", 17),
    ("serve_part_rows", 0),
    ("serve_on_arrival", "sometimes"),
    ("keep_copies_across_steps", "always"),
    ("nvlink_domain_size", 0),
    ("nvlink_domain_size", "node"),
    ("ep_backend", "nccl"),
    ("transport", "nvshmem"),
    ("copy_engine_gbps", 0),
    ("ce_budget", -1),
    ("ce_budget", "lots"),
    ("weight_residency", "forever"),
    ("max_resident_experts", -1),
    ("max_rows_over_mean", 0.9),
    ("max_rows_over_mean", "tight"),
    ("max_rows_over_mean", float("inf")),
    ("fixed_costs", "none"),
    ("scheduler", 3),
    ("scheduler.mode", "thread"),
    ("scheduler.plan_timeout_ms", -1),
    ("scheduler.peer_timeout_s", 0),
    ("scheduler.restart", "sometimes"),
    ("scheduler.poll_ms", -1),
    ("scheduler.start_after_steps", -1),
    ("transport_slot_mb", 0),
    ("transport_slot_mb", 1e-9),
    ("transport_slot_mb", float("inf")),
    ("dynamic_experts_per_rank", True),
    ("copy_engine_gbps", True),
    ("nvlink_domain_size", True),
    ("placement.redundant_experts_per_rank", True),
    ("resident_budget_mb", -1),
    ("gating", "sigmoid"),
    ("gating.score", "relu"),
    ("gating.bias_update_rate", -1e-3),
    ("gating.normalize_topk", "maybe"),
    ("placement", 1),
    ("placement.enabled", "yes please"),
    ("placement.interval_steps", 0),
    ("placement.history_decay", 1.5),
    ("placement.redundant_experts_per_rank", -1),
    ("placement.redundant_experts_per_rank", "many"),
    ("placement.network_gbps", 0),
    ("stats", True),
    ("stats.enabled", "maybe"),
    ("stats.monitor", [1]),
    ("stats.record_trace", 3),
]


def _nest(path, value):
    head, _, rest = path.partition(".")
    return {head: _nest(rest, value) if rest else value}


@pytest.mark.parametrize("path,value", BAD_VALUES, ids=[f"{p}={v!r}" for p, v in BAD_VALUES])
def test_bad_value_names_its_key_path(path, value):
    with pytest.raises(FEPLBConfigError) as info:
        load_config({"feplb": _nest(path, value)})
    message = str(info.value)
    assert message.startswith(f"feplb.{path}: ") and message.endswith(f"(got {value!r})"), message
    assert "\n" not in message, message


def test_example_message():
    with pytest.raises(FEPLBConfigError) as info:
        load_config({"feplb": {"scheduler": {"plan_timeout_ms": -1}}})
    assert str(info.value) == "feplb.scheduler.plan_timeout_ms: Input should be greater than 0 (got -1)"
    assert isinstance(info.value, ValueError)


def test_every_field_is_covered_by_bad_values():
    covered = {p for p, _ in BAD_VALUES}
    s = schema()
    fields = set(s["properties"])
    fields |= {f"{name}.{sub}" for name in fields if "$ref" in s["properties"][name]
               for sub in s["$defs"][s["properties"][name]["$ref"].split("/")[-1]]["properties"]}
    assert fields <= covered, sorted(fields - covered)


@pytest.mark.parametrize("section,path,hint", [
    ({"dynamic_experts": 4}, "feplb.dynamic_experts", "did you mean 'dynamic_experts_per_rank'?"),
    ({"zzz": 1}, "feplb.zzz", "valid keys: enabled,"),
    ({"schedular": {}}, "feplb.schedular", "did you mean 'scheduler'?"),
    ({"scheduler": {"deadline_us": 50}}, "feplb.scheduler.deadline_us", "valid keys: mode,"),
    ({"gating": {"scores": "sigmoid"}}, "feplb.gating.scores", "did you mean 'score'?"),
    ({"stats": {"record": "t.npz"}}, "feplb.stats.record", "did you mean 'record_trace'?"),
    ({"scheduler": {"typo": "auto"}}, "feplb.scheduler.typo", "unknown key"),  # "auto" does not hide a typo
])
def test_unknown_keys_name_their_path(section, path, hint):
    with pytest.raises(FEPLBConfigError) as info:
        load_config({"feplb": section})
    assert str(info.value).startswith(f"{path}: unknown key") and hint in str(info.value), str(info.value)


def test_all_errors_reported_one_per_line():
    with pytest.raises(FEPLBConfigError) as info:
        load_config({"feplb": {"max_helpers_per_expert": 0, "gating": {"score": "x"}, "foo": 1}})
    lines = str(info.value).splitlines()
    assert [line.split(":")[0] for line in lines] == ["feplb.max_helpers_per_expert", "feplb.gating.score", "feplb.foo"]


def test_deprecated_poll_ms_still_loads_and_warns():
    with pytest.warns(DeprecationWarning, match="feplb.scheduler.poll_ms has no effect"):
        cfg = load_config({"feplb": {"scheduler": {"poll_ms": 5}}})
    assert cfg.scheduler.mode == "process"
    assert schema()["$defs"]["SchedulerConfig"]["properties"]["poll_ms"]["deprecated"] is True


@pytest.mark.parametrize("section", ["fepbl", "FEPLB", "feplb_"])
def test_a_misspelled_section_is_refused_instead_of_running_on_defaults(section):
    """DeepSpeed ignores an unknown top-level section: a misspelled one would train without its settings."""
    with pytest.raises(FEPLBConfigError, match=f"^{section}: unknown ds_config section, did you mean 'feplb'"):
        load_config({section: {"dynamic_experts_per_rank": 2}, "train_batch_size": 8})
    assert load_config({"train_batch_size": 8, "fp16": {"enabled": False}}) == load_config({})


def _number_fields():
    """Dotted paths of every field of the section whose schema takes an integer or a number."""
    s = schema()

    def numeric(prop):
        return prop.get("type") in ("integer", "number") or any(numeric(p) for p in prop.get("anyOf", []))

    paths = []
    for name, prop in s["properties"].items():
        if "$ref" in prop:
            sub = s["$defs"][prop["$ref"].split("/")[-1]]["properties"]
            paths += [f"{name}.{key}" for key, p in sub.items() if numeric(p)]
        elif numeric(prop):
            paths.append(name)
    return paths


NUMBER_FIELDS = _number_fields()


def test_number_fields_are_found():
    assert {"dynamic_experts_per_rank", "nvlink_domain_size", "ce_budget", "transport_slot_mb", "max_rows_over_mean",
            "scheduler.plan_timeout_ms", "placement.redundant_experts_per_rank", "gating.bias_update_rate"} \
        <= set(NUMBER_FIELDS)
    assert "enabled" not in NUMBER_FIELDS and "scheduler.restart" not in NUMBER_FIELDS


@pytest.mark.parametrize("path", NUMBER_FIELDS)
@pytest.mark.parametrize("value", [True, False])
def test_a_boolean_is_not_taken_for_a_number(path, value):
    """pydantic would take true as 1 (false as 0) for an int or float key: refused, naming the key."""
    with pytest.raises(FEPLBConfigError) as info:
        load_config({"feplb": _nest(path, value)})
    assert str(info.value) == f"feplb.{path}: Input should be a number, not a boolean (got {value!r})"
    cfg = FEPLBConfig()
    *parents, name = path.split(".")
    model = getattr(cfg, parents[0]) if parents else cfg
    with pytest.raises(ValueError, match="not a boolean"):  # on assignment too
        setattr(model, name, value)


def test_integers_are_still_numbers_and_auto_still_works():
    cfg = load_config({"feplb": {"copy_engine_gbps": 300, "transport_slot_mb": 1, "ce_budget": 0,
                                 "max_rows_over_mean": 2, "scheduler": {"plan_timeout_ms": 5},
                                 "placement": {"history_decay": 1}, "gating": {"bias_update_rate": 0}}})
    assert cfg.copy_engine_gbps == 300.0 and cfg.transport_slot_mb == 1.0 and cfg.max_rows_over_mean == 2.0
    cfg = load_config({"feplb": {"transport_slot_mb": "auto", "ce_budget": "auto", "dynamic_experts_per_rank": "auto"}})
    assert cfg.transport_slot_mb == "auto" and cfg.ce_budget == "auto" and cfg.dynamic_experts_per_rank == 2
    assert load_config({"feplb": {"enabled": True, "scheduler": {"restart": False}}}).enabled is True


def test_the_smallest_transport_slot_is_the_smallest_ring():
    """1 KiB: a ring of RING_SLOTS slots of one 256-byte piece each, what any smaller slot is rounded
    up to (`arena.ring_capacity`); under a byte the slot would be 0 bytes, which no message part fits."""
    from deepspeed_feplb.migrate.arena import ALIGN, RING_SLOTS, inbound_bytes, ring_capacity

    smallest = int(MIN_TRANSPORT_SLOT_MB * 2**20)
    assert smallest == RING_SLOTS * ALIGN == inbound_bytes(1) == inbound_bytes(smallest)
    assert ring_capacity(0) == 0 and ring_capacity(smallest) == ALIGN
    smallest_mb = load_config({"feplb": {"transport_slot_mb": MIN_TRANSPORT_SLOT_MB}}).transport_slot_mb
    assert smallest_mb == MIN_TRANSPORT_SLOT_MB
    with pytest.raises(FEPLBConfigError) as info:
        load_config({"feplb": {"transport_slot_mb": 1e-9}})
    message = str(info.value)
    assert message.startswith("feplb.transport_slot_mb: Input should be 'auto' or a finite number of at least "
                              "0.0009765625 MiB (1 KiB") and message.endswith("(got 1e-09)"), message


def test_message_splitting_refuses_a_slot_of_no_bytes():
    """The second line of defence: a 0-byte ring slot used to split a message into empty parts
    without end (MemoryError on one rank, a timeout on its peer)."""
    from deepspeed_feplb.migrate.cuda_ce import CudaCETransport, part_ranges

    assert list(part_ranges(600, 256)) == [(0, 256), (256, 512), (512, 600)]
    assert list(part_ranges(0, 256)) == [(0, 0)]
    with pytest.raises(ValueError, match="ring slots of 0 bytes .*feplb.transport_slot_mb must be at least"):
        list(part_ranges(600, 0))
    with pytest.raises(ValueError, match="slot_bytes=0 gives ring slots of no bytes"):
        CudaCETransport("feplb-test-noslot", 0, 2, 1.0, True, slot_bytes=0)  # before any CUDA or segment


def _with(**section):
    return load_config({"feplb": section})


@pytest.mark.parametrize("section,lines", [
    ({}, []),
    ({"placement": {"redundant_experts_per_rank": 0}}, []),  # no key of the cross-node layer set: nothing idle
    ({"placement": {"enabled": True, "redundant_experts_per_rank": 2}}, []),
    ({"placement": {"enabled": False, "redundant_experts_per_rank": 2}}, []),  # replicas, every home kept
    ({"placement": {"enabled": False, "redundant_experts_per_rank": 0, "interval_steps": 3, "history_decay": 0.5}},
     ["feplb.placement.enabled is false and feplb.placement.redundant_experts_per_rank 0: no cross-node layer, so "
      "feplb.placement.interval_steps, feplb.placement.history_decay have no effect"]),
    ({"placement": {"enabled": False, "redundant_experts_per_rank": 1, "interval_steps": 3, "history_decay": 0.5}},
     ["feplb.placement.enabled is false: every expert keeps its home and replicas are chosen from the last "
      "micro-batches, not the load history, so feplb.placement.history_decay has no effect"]),
    ({"placement": {"enabled": "auto", "redundant_experts_per_rank": 2}}, []),  # on where an EP group spans nodes
    ({"placement": {"interval_steps": 3, "history_decay": 0.5}},  # replica slots "auto": the layer may run
     ["feplb.placement.enabled is false: every expert keeps its home and replicas are chosen from the last "
      "micro-batches, not the load history, so feplb.placement.history_decay has no effect"]),
    ({"weight_residency": "micro_batch", "max_resident_experts": 3, "resident_budget_mb": 100},
     ['feplb.weight_residency is "micro_batch": no copy is kept past its micro-batch, so '
      "feplb.max_resident_experts, feplb.resident_budget_mb have no effect"]),
    ({"max_resident_experts": 0, "resident_budget_mb": 100},
     ["feplb.max_resident_experts is 0: no copy is kept past its micro-batch, so feplb.resident_budget_mb has no "
      "effect"]),
    ({"scheduler": {"mode": "inline", "plan_timeout_ms": 5, "peer_timeout_s": 10}},
     ['feplb.scheduler.mode is "inline": every rank plans itself, no scheduler process, so '
      "feplb.scheduler.plan_timeout_ms has no effect"]),
    ({"gating": {"bias_update_rate": 0.1, "normalize_topk": False}},
     ["feplb.gating.score is \"softmax\": DeepSpeed's own gate scores the experts, so "
      "feplb.gating.bias_update_rate, feplb.gating.normalize_topk have no effect"]),
    ({"gating": {"score": "sigmoid", "bias_update_rate": 0.1}}, []),
    ({"stats": {"enabled": False, "monitor": False}},
     ["feplb.stats.enabled is false, so feplb.stats.monitor has no effect"]),
    ({"dynamic_experts_per_rank": 0, "transport": "cuda_ce", "serve_on_arrival": True, "serve_parts": 2},
     ["feplb.dynamic_experts_per_rank is 0: no expert moves inside a node (no phase 2, no scheduler), so "
      "feplb.transport, feplb.serve_on_arrival, feplb.serve_parts have no effect"]),
    ({"dynamic_experts_per_rank": 0, "weight_residency": "micro_batch", "max_resident_experts": 3,
      "scheduler": {"restart": False}},  # each key once, under the first reason
     ["feplb.dynamic_experts_per_rank is 0: no expert moves inside a node (no phase 2, no scheduler), so "
      "feplb.weight_residency, feplb.max_resident_experts, feplb.scheduler.restart have no effect"]),
])
def test_keys_without_effect_are_named(section, lines):
    assert idle_keys(_with(**section)) == lines


def test_keys_without_effect_are_said_once_per_job(capsys):
    from deepspeed_feplb.integration.engine import say_idle_keys

    config = _with(placement={"enabled": False, "redundant_experts_per_rank": 0, "interval_steps": 3})
    [line] = idle_keys(config)
    forget(("idle keys", line))
    try:
        say_idle_keys(config)
        # another initialize of the job
        say_idle_keys(_with(placement={"enabled": False, "interval_steps": 3}))
        assert capsys.readouterr().out == f"deepspeed_feplb: {line}\n"
    finally:
        forget(("idle keys", line))
