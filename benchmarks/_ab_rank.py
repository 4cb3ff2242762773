"""One rank of one lane of `ab.py`: builds its configuration once, then runs a step each time it is told to.

A lane is `floor` or `zero-S` (S = 0..3). Its shardwise is whatever `import shardwise` finds first: ab.py puts
the tree under test's `src` at the front of PYTHONPATH. The model, the batches and the config come from the
harness's own tree (its examples/ and benchmarks/), so two trees are measured on identical work.

Protocol, one line each way: ab.py writes `step I` (run step I on batch I) or `quit`; the rank answers
`{"wall": s, "cpu": s}` or, once ready, `{"ready": true, "shardwise": path}`. Answers go to the stdout the
process started with; everything else the libraries print goes to stderr (the lane's log), so a stray print
cannot break the protocol.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

HARNESS = Path(__file__).resolve().parent
sys.path.insert(0, str(HARNESS))
sys.path.insert(1, str(HARNESS.parent))  # examples.demo.model of the harness's tree


def _floor_step(model: Any, world: int) -> Callable[[Any, Any], None]:
    """The work of a ZeRO 1-3 rank with no communication: forward + backward, AdamW over 1/world of the elements."""
    import torch
    from zero_stages import _torch_adamw

    shard = torch.nn.Parameter(torch.randn(-(-model.num_parameters() // world)) * 0.02)
    shard.grad = torch.randn_like(shard) * 1e-3
    opt, _ = _torch_adamw([shard])

    def step(x: Any, y: Any) -> None:
        model(x, y).backward()
        model.zero_grad(set_to_none=True)
        opt.step()

    return step


def _engine_step(model: Any, stage: int, micro: int) -> Callable[[Any, Any], None]:
    import shardwise
    from zero_stages import ds_config

    engine, *_ = shardwise.initialize(model=model, model_parameters=model.param_groups(),
                                      config=ds_config(stage, micro))

    def step(x: Any, y: Any) -> None:
        engine.backward(engine(x, y))
        engine.step()

    return step


def main() -> None:
    lane, preset_name, seq_len, micro, count = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6])
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    import torch

    torch.set_num_threads(1)
    from _harness import token_batches
    from examples.demo.model import GPT, preset

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.manual_seed(0)
    model = GPT(preset(preset_name, seq_len=seq_len))
    batches = token_batches(model.cfg.vocab_size, micro, seq_len, count, rank)
    step = _floor_step(model, world) if lane == "floor" else _engine_step(model, int(lane.split("-")[1]), micro)
    torch.set_num_threads(1)  # whatever the library chose at init
    source = sys.modules["shardwise"].__file__ if "shardwise" in sys.modules else None
    answers.write(json.dumps({"ready": True, "shardwise": source}) + "\n")
    for line in sys.stdin:
        command = line.split()
        if command[0] == "quit":
            break
        x, y = batches[int(command[1]) % count]
        start, cpu_start = time.perf_counter(), time.process_time()
        step(x, y)
        answers.write(json.dumps({"wall": time.perf_counter() - start, "cpu": time.process_time() - cpu_start}) + "\n")


if __name__ == "__main__":
    main()
