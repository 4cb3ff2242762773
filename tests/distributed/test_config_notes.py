"""The "a DeepSpeed setting with no effect in shardwise" notes at world size 2: given once for the job, by rank 0,
and only for keys DeepSpeed itself would act on at the config's ZeRO stage."""

from __future__ import annotations

import logging

from tests.harness import run_distributed
from tests.logs import LogMessages
from tests.parity import ds_config, make_model, param_groups

NO_EFFECT = "a DeepSpeed setting with no effect in shardwise"
# Keys DeepSpeed 0.19.8 reads only in its stage-3 optimizer / zero.Init, and one its ZeRO optimizers (1-3) read.
STAGE3_KEYS = {"stage3_module_granularity_threshold": 0, "stage3_use_all_reduce_for_fetch_params": True,
               "stage3_allgather_sequential": True, "memory_efficient_linear": False, "log_trace_cache_warnings": True}
ZERO_KEY = {"contiguous_gradients": True}


def _notes_by_stage() -> dict[int, list[str]]:
    import shardwise
    from shardwise.config import notes

    notes._given.clear()  # a fresh process would not have given these notes yet
    by_stage = {}
    for stage in (0, 1, 2, 2):  # stage 2 twice: a second engine of the same job repeats nothing
        messages = LogMessages()
        logger = logging.getLogger("shardwise.config")
        logger.addHandler(messages)
        logger.setLevel(logging.INFO)
        model = make_model()
        shardwise.initialize(model=model, model_parameters=param_groups(model), config=ds_config(
            2, 1, zero_optimization={"stage": stage, **STAGE3_KEYS, **ZERO_KEY}))
        logger.removeHandler(messages)
        by_stage.setdefault(stage, []).extend(m for m in messages.messages if NO_EFFECT in m)
    return by_stage


def test_no_effect_notes_once_on_rank_zero_for_keys_deepspeed_reads():
    rank0, rank1 = run_distributed(_notes_by_stage, 2)
    assert rank1 == {0: [], 1: [], 2: []}
    assert rank0[0] == []  # stage 0: DeepSpeed builds no ZeRO optimizer, so none of these keys acts there either
    assert [m.split(":")[0] for m in rank0[1]] == ["zero_optimization.contiguous_gradients"]
    assert rank0[2] == []  # given once, at stage 1, for the job
