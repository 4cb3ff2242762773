"""An image classifier trained the way DeepSpeedExamples' CIFAR-10 tutorial trains it, written for DeepSpeed:
`deepspeed.initialize(args=..., model=..., model_parameters=..., training_data=...)` with the tutorial's
config keys (Adam + WarmupLR sections, fp16/bf16 sections, "cpu_offload": false, float bucket sizes), the
returned training loader, `get_accelerator().device_name(engine.local_rank)`, `bfloat16_enabled()` /
`fp16_enabled()`, and the MoE parameter-group helper. The data source is synthetic 32x32 images (no
torchvision here). Prints `RESULT <json>` on rank 0."""

from __future__ import annotations

import argparse
import json

import deepspeed
import torch
import torch.nn as nn
import torch.nn.functional as F
from deepspeed.accelerator import get_accelerator
from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer


class Images(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 256

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        g = torch.Generator().manual_seed(i)
        label = int(torch.randint(0, 10, (1,), generator=g))
        image = torch.randn(3, 32, 32, generator=g) * 0.5 + label / 10.0
        return image, label


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(3, 6, 5), nn.Conv2d(6, 16, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.fc1, self.fc2, self.fc3 = nn.Linear(16 * 5 * 5, 120), nn.Linear(120, 84), nn.Linear(84, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = torch.flatten(x, 1)
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))


def ds_config(args: argparse.Namespace) -> dict:
    return {
        "train_batch_size": 16, "steps_per_print": 2000,
        "optimizer": {"type": "Adam", "params": {"lr": 0.001, "betas": [0.8, 0.999], "eps": 1e-8, "weight_decay": 3e-7}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.001, "warmup_num_steps": 5}},
        "gradient_clipping": 1.0, "prescale_gradients": False,
        "bf16": {"enabled": args.dtype == "bf16"},
        "fp16": {"enabled": args.dtype == "fp16", "fp16_master_weights_and_grads": False, "loss_scale": 0,
                 "loss_scale_window": 500, "hysteresis": 2, "min_loss_scale": 1, "initial_scale_power": 15},
        "wall_clock_breakdown": False,
        "zero_optimization": {"stage": args.stage, "allgather_partitions": True, "reduce_scatter": True,
                              "allgather_bucket_size": 5e7, "reduce_bucket_size": 5e7, "overlap_comm": True,
                              "contiguous_gradients": True, "cpu_offload": False},
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--stage", type=int, default=0)
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "fp16", "bf16"])
    parser.add_argument("--moe-param-group", action="store_true")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--local_rank", type=int, default=-1)
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()
    deepspeed.init_distributed()
    get_accelerator().set_device(args.local_rank if args.local_rank >= 0 else 0)
    torch.manual_seed(0)
    net = Net()
    parameters = filter(lambda p: p.requires_grad, net.parameters())
    if args.moe_param_group:
        parameters = split_params_into_different_moe_groups_for_optimizer(
            {"params": [p for p in net.parameters()], "name": "parameters"})
    engine, optimizer, trainloader, _ = deepspeed.initialize(args=args, model=net, model_parameters=parameters,
                                                             training_data=Images(), config=ds_config(args))
    device = get_accelerator().device_name(engine.local_rank)
    target_dtype = torch.bfloat16 if engine.bfloat16_enabled() else torch.half if engine.fp16_enabled() else None
    criterion = nn.CrossEntropyLoss()
    losses = []
    for i, (inputs, labels) in enumerate(trainloader):
        inputs, labels = inputs.to(device), labels.to(device)
        if target_dtype is not None:
            inputs = inputs.to(target_dtype)
        loss = criterion(engine(inputs), labels)
        engine.backward(loss)
        engine.step()
        mean = loss.detach().float().clone()
        torch.distributed.all_reduce(mean)
        losses.append(mean.item() / torch.distributed.get_world_size())
        if i + 1 == args.steps:
            break
    if engine.global_rank == 0:
        print("RESULT " + json.dumps({"losses": losses, "lr": engine.get_lr(), "steps": engine.global_steps}), flush=True)


if __name__ == "__main__":
    main()
