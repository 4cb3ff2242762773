"""Every key DeepSpeed 0.19.8 reads is accepted by shardwise's parser, or refused as not implemented.

The catalogue (tests/data/deepspeed_0_19_8_config_keys.json) is extracted from DeepSpeed itself by
tools/deepspeed_config_keys.py, with a valid DeepSpeed value (`sample`, checked against DeepSpeed when
written) for each key. Each key is set, alone, to that value and to DeepSpeed's default: the config must
parse, or fail only with "a DeepSpeed setting that shardwise does not implement yet" — never as an
unknown key, never with another error.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from shardwise.config import ConfigError, parse_config
from shardwise.config import deepspeed_keys as ds

TOOLS = Path(__file__).parents[2] / "tools"
sys.path.insert(0, str(TOOLS))
from deepspeed_config_keys import build_config  # noqa: E402 - the tool that wrote the catalogue builds its configs

CATALOGUE = json.loads((Path(__file__).parents[1] / "data" / "deepspeed_0_19_8_config_keys.json").read_text())
KEYS: dict[str, dict[str, Any]] = CATALOGUE["keys"]
NOT_IMPLEMENTED = "a DeepSpeed setting that shardwise does not implement yet"
REVIVED = {"curriculum_learning", "sparse_attention"}
"""Removed from DeepSpeed 0.19.8, implemented by shardwise for configs written for older versions."""
INCOMPLETE_ALONE = {"curriculum_learning", "sparse_attention", "data_efficiency.data_routing.random_ltd.enabled",
                    "data_efficiency.data_sampling.curriculum_learning.enabled"}
"""Switching these on without the rest of their section (a schedule, the layers, a metric) is refused naming
what is missing; DeepSpeed accepts the config and fails at initialize with a KeyError."""
IMPLEMENTED_TOGETHER = {"bf16.bf16_master_weights_and_grads", "bf16.bf16_optimizer_states"}
"""Implemented only as a pair: bf16 master weights with fp32 optimizer state (one key's value without the other's)
is refused as not implemented (DeepSpeed runs it only with DeepSpeedCPUAdam offload)."""


def _cases() -> list[Any]:
    cases = []
    for path, entry in KEYS.items():
        values = {"sample": entry["sample"]}
        if entry["default"] is not None and entry["default"] != entry["sample"] and not entry.get("code_only"):
            values["default"] = entry["default"]
        for which, value in values.items():
            cases.append(pytest.param(path, value, entry.get("context"), "removed" in entry, id=f"{path}={which}"))
    return cases


def test_catalogue_is_deepspeed_0_19_8_and_complete():
    assert CATALOGUE["deepspeed_version"] == "0.19.8"
    # A few keys that were refused as unknown before this table existed, in their DeepSpeed spellings.
    for key in ("zero_optimization.stage3_model_persistence_threshold", "zero_optimization.prefetch_bucket_size",
                "zero_optimization.stage3_module_granularity_threshold", "zero_optimization.cpu_offload_use_pin_memory",
                "bf16.immediate_grad_update", "checkpoint.load_universal", "torch_autocast.enabled", "compile.deepcompile",
                "timers.throughput.enabled", "hybrid_engine.enabled", "dataloader_drop_last"):
        assert key in KEYS, key
    assert len(KEYS) > 350


@pytest.mark.parametrize("path", sorted(KEYS))
def test_every_key_has_one_treatment(path):
    assert ds.lookup(path) is not None, f"{path}: no entry in config/deepspeed_keys.py TABLE"


@pytest.mark.parametrize("path, value, context, removed", _cases())
def test_key_is_accepted_or_refused_as_not_implemented(path, value, context, removed):
    config = build_config(path, value, context)
    try:
        parse_config(config, dp_size=1)
    except ConfigError as e:
        if path in INCOMPLETE_ALONE and ds.lookup(path).kind != ds.REFUSED:
            assert all("required" in p or "needs" in p for p in e.problems), e.problems
            return
        unexpected = [p for p in e.problems if NOT_IMPLEMENTED not in p]
        assert not unexpected, f"{config} was refused for another reason: {unexpected}"
        assert ds.lookup(path).kind == ds.REFUSED or ds.canonical(path) in IMPLEMENTED_TOGETHER or any(
            ds.lookup(p.split(":")[0]).kind == ds.REFUSED for p in e.problems)
        return
    assert not removed or path in REVIVED, f"{path} was removed from DeepSpeed 0.19.8 and must stay refused; {config} was accepted"


def test_docs_page_is_rendered_from_the_table():
    from shardwise.config.key_docs import render

    page = Path(__file__).parents[2] / "docs" / "reference" / "config.md"
    assert page.read_text() == render(), "docs/reference/config.md is stale: python -m shardwise.config.key_docs > docs/reference/config.md"


def test_catalogue_matches_the_installed_deepspeed():
    """Re-extracts the catalogue from the real DeepSpeed (`make test-deepspeed` runs this in its venv)."""
    from tests.reference import real_deepspeed

    deepspeed = real_deepspeed()
    if deepspeed.__version__ != CATALOGUE["deepspeed_version"]:
        pytest.skip(f"deepspeed {deepspeed.__version__} installed; the catalogue is of {CATALOGUE['deepspeed_version']}")
    import deepspeed_config_keys as tool

    extracted = tool.catalogue()
    assert json.loads(json.dumps(extracted, sort_keys=True)) == KEYS
    assert tool.check_samples(extracted) == []
