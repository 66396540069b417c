"""The "feplb" ds_config section: defaults, "auto", loading, key-path errors, the checked-in schema."""
import argparse
import json
import pathlib
import re

import pytest

from deepspeed_feplb.config import (
    SCHEMA_COMMAND,
    FEPLBConfig,
    FEPLBConfigError,
    add_parser,
    load_config,
    schema,
    schema_text,
)

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
        "enabled": True, "dynamic_experts_per_rank": 2, "max_helpers_per_expert": 7, "chunk_align_tokens": 8,
        "nvlink_domain_size": "auto", "ep_backend": "auto", "transport": "auto", "copy_engine_gbps": 370.0,
        "ce_budget": "auto", "transport_slot_mb": "auto", "weight_residency": "step", "max_resident_experts": 8,
        "resident_budget_mb": "auto", "max_rows_over_mean": None,
        "fixed_costs": "measured",
        "scheduler": {"mode": "process", "plan_timeout_ms": 20.0, "peer_timeout_s": 60.0, "restart": True,
                      "start_after_steps": 8, "poll_ms": None},
        "placement": {"enabled": False, "interval_steps": 50, "history_decay": 0.1, "redundant_experts_per_rank": 0,
                      "network_gbps": 50.0},
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
    "nvlink_domain_size": 8, "ep_backend": "deepep", "transport": "cuda_ce", "copy_engine_gbps": 300.0,
    "ce_budget": 2e9, "transport_slot_mb": 256.0, "weight_residency": "micro_batch", "max_resident_experts": 3,
    "resident_budget_mb": 4096.0, "max_rows_over_mean": 1.05,
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
