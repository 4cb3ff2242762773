"""A small layered model for pipeline tests, its single-process oracle, and the DeepSpeed-style loop.

Layers are built with `seed_layers` semantics (layer i after `torch.manual_seed(BASE_SEED + i)`), so the
oracle, built layer by layer the same way in one process, starts from the same weights at any partition.
"""

from __future__ import annotations

from typing import Any

import torch

from tests.parity import oracle_step

BASE_SEED = 1234
WIDTH, IN, OUT = 16, 8, 4


class Block(torch.nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.fc = torch.nn.Linear(width, width)
        self.norm = torch.nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(self.norm(x)))


class Head(torch.nn.Module):
    def __init__(self, width: int, out: int):
        super().__init__()
        self.fc = torch.nn.Linear(width, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


def _project_back(embed: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The tied use: the input projection's weight, transposed (as an LM head reuses the embedding)."""
    return x @ embed.weight


def layer_specs(blocks: int = 6, tied: bool = False) -> list[Any]:
    from shardwise.pipe import LayerSpec, TiedLayerSpec

    if tied:
        first = TiedLayerSpec("embed", torch.nn.Linear, IN, WIDTH, bias=False)
        last = TiedLayerSpec("embed", torch.nn.Linear, IN, WIDTH, bias=False, forward_fn=_project_back)
        return [first, *[LayerSpec(Block, WIDTH) for _ in range(blocks)], last]
    return [LayerSpec(torch.nn.Linear, IN, WIDTH), *[LayerSpec(Block, WIDTH) for _ in range(blocks)],
            LayerSpec(Head, WIDTH, OUT)]


def loss_fn(outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(outputs, labels)


class Oracle(torch.nn.Module):
    """The same layers in one process; tied specs share one module, as a single-process model shares it."""

    def __init__(self, specs: list[Any]):
        super().__init__()
        from shardwise.pipe import TiedLayerSpec

        self.funcs: list[Any] = []
        self.layers = torch.nn.ModuleList()
        tied: dict[str, torch.nn.Module] = {}
        for index, spec in enumerate(specs):
            torch.manual_seed(BASE_SEED + index)
            if isinstance(spec, TiedLayerSpec):
                if spec.key not in tied:
                    tied[spec.key] = spec.build()
                    self.layers.append(tied[spec.key])
                module = tied[spec.key]
                self.funcs.append((lambda m, f: (lambda x: f(m, x)))(module, spec.forward_fn) if spec.forward_fn
                                  else module)
            else:
                module = spec.build()
                self.layers.append(module)
                self.funcs.append(module)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for f in self.funcs:
            x = f(x)
        return x


def out_width(tied: bool) -> int:
    return IN if tied else OUT


def global_batch(step: int, size: int, tied: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(500 + step)
    return torch.randn(size, IN, generator=g), torch.randn(size, out_width(tied), generator=g)


def micro_batches(step: int, micro: int, accum: int, dp_rank: int, dp: int, tied: bool = False):
    """Data-parallel rank `dp_rank`'s micro-batches of step `step` (the oracle's batch, split)."""
    x, y = global_batch(step, micro * accum * dp, tied)
    for m in range(accum):
        start = (m * dp + dp_rank) * micro
        yield x[start : start + micro], y[start : start + micro]


def oracle_run(steps: int, batch: int, lr: float, clip: float = 0.0, blocks: int = 6, tied: bool = False,
               optimizer: str = "sgd") -> tuple[list[float], dict[str, torch.Tensor]]:
    model = Oracle(layer_specs(blocks, tied))
    opt = (torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9) if optimizer == "sgd"
           else torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.01))
    losses = []
    for step in range(steps):
        x, y = global_batch(step, batch, tied)
        losses.append(oracle_step(model, opt, loss_fn(model(x), y), clip))
    return losses, {f"layer{i}": p.detach().clone() for i, p in enumerate(model.parameters())}


def pipe_config(micro: int, accum: int, lr: float, clip: float = 0.0, optimizer: str = "sgd", **extra: Any) -> dict:
    opt = ({"type": "SGD", "params": {"lr": lr, "momentum": 0.9}} if optimizer == "sgd"
           else {"type": "AdamW", "params": {"lr": lr, "betas": [0.9, 0.99], "eps": 1e-8, "weight_decay": 0.01}})
    # weight_decay stated on both sides: torch's AdamW defaults to 0.01, DeepSpeed's (and shardwise's) to 0
    return {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": accum, "gradient_clipping": clip,
            "steps_per_print": 1000, "optimizer": opt, **extra}


def pipe_run(stages: int, config: dict, steps: int, blocks: int = 6, tied: bool = False,
             partition_method: str = "parameters", **module_kwargs: Any) -> dict[str, Any]:
    """A DeepSpeed pipeline script: PipelineModule of LayerSpecs, then train_batch per step."""
    import shardwise
    from shardwise.pipe import PipelineModule

    module = PipelineModule(layer_specs(blocks, tied), num_stages=stages, loss_fn=loss_fn, seed_layers=True,
                            base_seed=BASE_SEED, partition_method=partition_method, **module_kwargs)
    engine, _, _, _ = shardwise.initialize(model=module, model_parameters=module.parameters(), config=config)
    micro, accum = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    dp, dp_rank = engine.grid.get_data_parallel_world_size(), engine.grid.get_data_parallel_rank()
    losses = [engine.train_batch(iter(micro_batches(step, micro, accum, dp_rank, dp, tied))).item()
              for step in range(steps)]
    return {"losses": losses, "stage": engine.stage_id, "engine": engine,
            "params": {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}}
