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
    """The loss in fp32: bf16/fp16 outputs are cast to the labels' dtype first. torch 2.13's mse_loss promotes
    mixed dtypes the same way (bit-identical loss and gradients), but torch 2.11's mse_loss backward fails on
    them ("Found dtype Float but expected BFloat16", pytorch/pytorch#36553)."""
    return torch.nn.functional.mse_loss(outputs.to(labels.dtype), labels)


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


# --- a tiny Megatron-style GPT for 3D (pipe x tensor x data) tests ---------------------------------------------
# Written with shardwise.tensor_parallel.layers: whole torch layers that initialize splits over the tensor-parallel
# group (autotp_size), so at tensor-parallel size 1, built layer by layer in one process, they are the oracle.
VOCAB, GPT_WIDTH, HEADS, SEQ = 32, 16, 4, 6


class GPTEmbed(torch.nn.Module):
    def __init__(self, vocab: int, width: int, seq: int):
        from shardwise.tensor_parallel import VocabParallelEmbedding

        super().__init__()
        self.tokens = VocabParallelEmbedding(vocab, width)
        self.positions = torch.nn.Embedding(seq, width)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.tokens(ids) + self.positions.weight[: ids.shape[1]]


class GPTBlock(torch.nn.Module):
    """Pre-norm attention and MLP. qkv's output features are head-major ([head][q, k, v][head_dim], Megatron's
    layout), so a column split hands each tensor-parallel rank whole heads: it attends over out_features //
    (3 * head_dim) of them. qkv has no bias: a key bias's gradient is zero in exact arithmetic (it adds the same
    q.b to every score of a row), so Adam would turn its rounding noise into lr-sized steps that no two
    summation orders share."""

    def __init__(self, width: int, heads: int):
        from shardwise.tensor_parallel import ColumnParallelLinear, RowParallelLinear

        super().__init__()
        self.head_dim = width // heads
        self.ln1, self.ln2 = torch.nn.LayerNorm(width), torch.nn.LayerNorm(width)
        self.qkv, self.proj = ColumnParallelLinear(width, 3 * width, bias=False), RowParallelLinear(width, width)
        self.fc1, self.fc2 = ColumnParallelLinear(width, 4 * width), RowParallelLinear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, -1, 3, self.head_dim).permute(3, 0, 2, 1, 4).unbind(0)
        attended = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(b, t, -1))
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln2(x))))


class GPTHead(torch.nn.Module):
    def __init__(self, width: int, vocab: int):
        from shardwise.tensor_parallel import ColumnParallelLinear

        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.lm_head = ColumnParallelLinear(width, vocab, bias=False, gather_output=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(x))


def gpt_specs(blocks: int = 2) -> list[Any]:
    from shardwise.pipe import LayerSpec

    return [LayerSpec(GPTEmbed, VOCAB, GPT_WIDTH, SEQ), *[LayerSpec(GPTBlock, GPT_WIDTH, HEADS) for _ in range(blocks)],
            LayerSpec(GPTHead, GPT_WIDTH, VOCAB)]


def gpt_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def gpt_batch(step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and their next tokens."""
    tokens = torch.randint(0, VOCAB, (size, SEQ + 1), generator=torch.Generator().manual_seed(700 + step))
    return tokens[:, :-1], tokens[:, 1:]


def gpt_micro_batches(step: int, micro: int, accum: int, dp_rank: int, dp: int):
    """Data-parallel rank `dp_rank`'s micro-batches of step `step` (every tensor-parallel rank reads the same)."""
    x, y = gpt_batch(step, micro * accum * dp)
    for m in range(accum):
        start = (m * dp + dp_rank) * micro
        yield x[start : start + micro], y[start : start + micro]


def gpt_oracle_run(steps: int, batch: int, lr: float, clip: float = 0.0, blocks: int = 2,
                   optimizer: str = "adamw") -> tuple[list[float], dict[str, torch.Tensor]]:
    """The whole GPT trained in one process (pipe_config's optimizers); the final parameters by the
    PipelineModule's names ("1.qkv.weight")."""
    model = Oracle(gpt_specs(blocks))
    opt = (torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9) if optimizer == "sgd"
           else torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.01))
    losses = []
    for step in range(steps):
        x, y = gpt_batch(step, batch)
        losses.append(oracle_step(model, opt, gpt_loss(model(x), y), clip))
    return losses, {n.removeprefix("layers."): p.detach().clone() for n, p in model.named_parameters()}
