"""`shardwise config schema`: the JSON schema accepts every config the parser accepts — DeepSpeed's whole key
catalogue (sample values and defaults), "auto" wherever the parser takes it and nowhere else it singles it
out, DeepSpeed's other spellings — and flags what the parser refuses as typos, wrong types and values.
Checked with tests/json_schema.py (the `jsonschema` package is not a dependency)."""

from __future__ import annotations

import copy
import json
import logging
import sys
from pathlib import Path
from typing import Any

import pytest

from shardwise.config import ConfigError, config_json_schema, parse_config
from shardwise import cli
from tests.json_schema import errors, unknown_keywords

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))
from deepspeed_config_keys import build_config  # noqa: E402 - the catalogue's own config builder

KEYS: dict[str, dict[str, Any]] = json.loads((REPO / "tests" / "data" / "deepspeed_0_19_8_config_keys.json").read_text())["keys"]
SCHEMA = config_json_schema()
STAGE3 = {"zero_optimization": {"stage": 3}}

# A Hugging Face Trainer-style ZeRO-3 config in DeepSpeed's spellings, "auto" wherever shardwise accepts it.
HF_STYLE = {
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": "auto",
    "bfloat16": {"enabled": True}, "communication_data_type": "BF16", "steps_per_print": None,
    "zero_optimization": {
        "stage": 3, "overlap_comm": None, "contiguous_gradients": "auto", "reduce_bucket_size": "auto",
        "prefetch_bucket_size": "auto", "param_persistence_threshold": "auto", "max_live_parameters": "auto",
        "sub_group_size": "auto", "stage3_gather_16bit_weights_on_model_save": True,
        "offload_param": {"device": "cpu", "pin_memory": True, "buffer_count": "auto"},
        "offload_optimizer": {"device": "cpu", "ratio": 1, "fast_init": "auto"},
    },
    "aio": {"intra_op_parallelism": 2}, "data_types": {"grad_accum_dtype": "torch.float32", "keep_in_fp32_modules": "auto"},
    "checkpoint": {"tag_validation": "fail"}, "comms_logger": {"prof_ops": ["all_gather_into_tensor"]},
    "optimizer": {"type": "adamw", "params": {"lr": 1e-4}}, "scheduler": {"type": "CosineAnnealingLR"},
    "timers": {"throughput": {"enabled": True}}, "compile": {"deepcompile": False}, "amp": {"enabled": False},
}


def parses(config: dict[str, Any]) -> bool:
    try:
        parse_config(config, dp_size=1)
    except ConfigError:
        return False
    return True


def _catalogue_configs() -> list[tuple[str, dict[str, Any]]]:
    """Each DeepSpeed key at its sample, its default and "auto", as given and under ZeRO-3 (test_config_keys'
    cases, plus the stage that changes what the parser reads: offload_param is dropped below 3)."""
    configs = []
    for path, entry in KEYS.items():
        values = [entry["sample"], "auto"]
        if entry["default"] is not None and not entry.get("code_only"):
            values.append(entry["default"])
        for value in values:
            config = build_config(path, value, entry.get("context"))
            configs.append((f"{path}={value!r}", config))
            if isinstance(config.get("zero_optimization", {}), dict):
                configs.append((f"{path}={value!r} at stage 3", _merged(config, STAGE3)))
    return configs


def _merged(config: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """`config` with `extra`'s keys set, section by section."""
    out = copy.deepcopy(config)
    for key, value in extra.items():
        both_sections = isinstance(value, dict) and isinstance(out.get(key), dict)
        out[key] = _merged(out[key], value) if both_sections else copy.deepcopy(value)
    return out


def test_schema_uses_only_keywords_the_checker_checks() -> None:
    assert unknown_keywords(SCHEMA) == []
    assert SCHEMA["$schema"] == "https://json-schema.org/draft/2020-12/schema"


def test_every_catalogue_config_the_parser_accepts_validates() -> None:
    logging.disable(logging.WARNING)  # the parser's notes about no-op keys
    try:
        cases = _catalogue_configs()
        refused = {name: errors(config, SCHEMA)[:1] for name, config in cases if parses(config) and errors(config, SCHEMA)}
    finally:
        logging.disable(logging.NOTSET)
    assert len(cases) > 1500 and refused == {}


def test_auto_is_allowed_exactly_where_the_parser_takes_it() -> None:
    """At every DeepSpeed key: the parser takes "auto" => the schema does; and where the schema allows
    "auto" but not just any string there, the parser takes it."""
    base = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 1}  # "auto" in one batch key is derived
    wrong = []
    for path, entry in KEYS.items():
        for extra in ({}, STAGE3):
            def config(value: Any) -> dict[str, Any]:
                return _merged(build_config(path, value, entry.get("context"), base=base), extra)

            by_parser, by_schema = parses(config("auto")), not errors(config("auto"), SCHEMA)
            any_string = not errors(config("no-such-value"), SCHEMA)
            if by_parser != by_schema and not (by_schema and any_string):
                wrong.append(f"{path} ({extra or 'as given'}): parser {by_parser}, schema {by_schema}")
    assert wrong == []


@pytest.mark.parametrize("name", ["demo", "finetune_llm"])
def test_example_configs_validate(name: str) -> None:
    config = json.loads((REPO / "examples" / name / "ds_config.json").read_text())
    assert parses(config) and errors(config, SCHEMA) == []


def test_a_hugging_face_style_config_with_autos_and_aliases_validates() -> None:
    assert parses(HF_STYLE)
    assert errors(HF_STYLE, SCHEMA) == []


@pytest.mark.parametrize(("change", "where"), [
    ({"zero_optimization": {"stage": 3, "reduce_bucket_sise": 5}}, "reduce_bucket_sise: not allowed"),
    ({"gradient_clipping": "auto"}, "$.gradient_clipping"),
    ({"zero_optimization": {"stage": 4}}, "$.zero_optimization"),
    ({"bf16": {"enabled": True, "check_grad_overflow": False}}, "$.bf16.check_grad_overflow"),
    ({"amp": {"enabled": True}}, "$.amp"),
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "gpu"}}}, "$.zero_optimization"),
    ({"optimizer": {"type": "adamw_torch"}}, "$.optimizer"),
    ({"checkpoint": {"tag_validation": "sometimes"}}, "$.checkpoint.tag_validation"),
])
def test_what_the_parser_refuses_the_schema_flags(change: dict[str, Any], where: str) -> None:
    config = _merged(HF_STYLE, change)
    assert not parses(config)
    assert any(where in problem for problem in errors(config, SCHEMA)), errors(config, SCHEMA)


def test_shardwise_config_schema_prints_it(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["config", "schema"]) == 0
    assert json.loads(capsys.readouterr().out) == json.loads(json.dumps(SCHEMA))
