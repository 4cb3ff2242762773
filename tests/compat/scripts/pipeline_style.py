"""A pipeline-parallel classifier trained the way DeepSpeedExamples' pipeline tutorial trains one, written for
DeepSpeed: a `deepspeed.pipe.PipelineModule` over a list of layers (modules the script builds and
`LayerSpec`s each stage builds), `deepspeed.initialize(args=..., model=..., model_parameters=..., training_data=...)`, then
`engine.train_batch()` per step from the engine's own loader. Synthetic data. Prints `RESULT <json>` on rank 0."""

from __future__ import annotations

import argparse
import json

import deepspeed
import torch
import torch.nn as nn
from deepspeed.pipe import LayerSpec, PipelineModule


class Points(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 512

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        g = torch.Generator().manual_seed(i)
        label = int(torch.randint(0, 4, (1,), generator=g))
        return torch.randn(16, generator=g) + label, label


def layers() -> list:
    torch.manual_seed(0)
    built = [nn.Linear(16, 32), nn.ReLU()]  # modules the script builds itself, on every rank
    return built + [LayerSpec(nn.Linear, 32, 32), LayerSpec(nn.Tanh), LayerSpec(nn.Linear, 32, 32),
                    LayerSpec(nn.ReLU), LayerSpec(nn.Linear, 32, 4)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--zero_stage", type=int, default=0)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--partition", default="uniform")
    parser.add_argument("--clip", type=float, default=0.5)
    parser.add_argument("--local_rank", type=int, default=-1)
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    net = PipelineModule(layers=layers(), loss_fn=nn.CrossEntropyLoss(), num_stages=args.stages,
                         partition_method=args.partition)
    config = {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000,
              "gradient_clipping": args.clip, "zero_optimization": {"stage": args.zero_stage},
              "optimizer": {"type": "Adam", "params": {"lr": 0.01, "weight_decay": 0.0}}}
    engine, _, _, _ = deepspeed.initialize(args=args, model=net, training_data=Points(), config=config,
                                           model_parameters=[p for p in net.parameters() if p.requires_grad])
    losses = [engine.train_batch().item() for _ in range(args.steps)]
    if engine.global_rank == 0:
        print("RESULT " + json.dumps({"losses": losses, "steps": engine.global_steps,
                                      "micro_batches": engine.micro_batches,
                                      "first": engine.is_first_stage(), "parts": net.parts}), flush=True)


if __name__ == "__main__":
    main()
