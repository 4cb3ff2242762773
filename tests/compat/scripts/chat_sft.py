"""Supervised fine-tuning written the way DeepSpeed-Chat's step-1 SFT is written for DeepSpeed: its own
optimizer from `deepspeed.ops.adam` (DeepSpeedCPUAdam with offload, else FusedAdam), a Hugging Face
scheduler passed to `deepspeed.initialize`, `get_accelerator()` for devices and seeds, `HfDeepSpeedConfig`
so `from_pretrained` builds the model partitioned at ZeRO-3, a hand-written LoRA that sizes itself by
`weight.ds_shape`, `engine.gradient_checkpointing_enable()`, `engine.tput_timer`, and DeepSpeed-Chat's save
sequence: rank 0 writes `module.state_dict()` first, then at ZeRO-3 every rank gathers each parameter
(`hasattr(p, "ds_id")`, `p.ds_status == ZeroParamStatus.NOT_AVAILABLE`) and rank 0 writes the whole
weights. The data source is synthetic token sequences. Prints `RESULT <json>` on rank 0.

ZeRO++'s keys come from --hpz/--qwz/--qgz; --ranks_per_node simulates nodes of consecutive ranks on one machine."""

from __future__ import annotations

import argparse
import json
import math
import os

import deepspeed
import torch
import torch.nn.functional as F
from deepspeed import get_accelerator
from deepspeed.compression.helper import recursive_getattr, recursive_setattr
from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, default_data_collator, get_scheduler
from transformers.integrations.deepspeed import HfDeepSpeedConfig

VOCAB, SEQ = 64, 16


class LoRALinear(torch.nn.Module):
    """A linear layer with a low-rank update: y = x W^T + b + (x R L) * alpha / r."""

    def __init__(self, weight: torch.nn.Parameter, bias: torch.nn.Parameter | None, dim: int, alpha: float = 1.0):
        super().__init__()
        self.weight, self.bias = weight, bias
        rows, columns = weight.ds_shape if hasattr(weight, "ds_shape") else weight.shape  # partitioned at ZeRO-3
        self.lora_right_weight = torch.nn.Parameter(torch.zeros(columns, dim))
        self.lora_left_weight = torch.nn.Parameter(torch.zeros(dim, rows))
        torch.nn.init.kaiming_uniform_(self.lora_right_weight, a=math.sqrt(5))
        self.scaling = alpha / dim
        self.weight.requires_grad = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias) + (x @ self.lora_right_weight @ self.lora_left_weight) * self.scaling


def to_lora(model: torch.nn.Module, part: str, dim: int) -> torch.nn.Module:
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and part in n]
    for name in names:
        linear = recursive_getattr(model, name)
        recursive_setattr(model, name, LoRALinear(linear.weight, linear.bias, dim))
    for name, p in model.named_parameters():
        p.requires_grad = "lora_" in name
    return model


def ds_config(args: argparse.Namespace) -> dict:
    device = "cpu" if args.offload else "none"
    zero = {"stage": args.zero_stage, "overlap_comm": True, "offload_param": {"device": device},
            "offload_optimizer": {"device": device}, "stage3_param_persistence_threshold": args.persistence_threshold,
            "stage3_max_live_parameters": 3e7, "stage3_prefetch_bucket_size": 3e7, "memory_efficient_linear": False}
    if args.hpz > 1:
        zero["zero_hpz_partition_size"] = args.hpz
    if args.qwz:
        zero["zero_quantized_weights"] = True
    if args.qgz:
        zero["zero_quantized_gradients"] = True
    config = {"train_batch_size": args.batch * args.gas * torch.distributed.get_world_size(),
              "train_micro_batch_size_per_gpu": args.batch, "steps_per_print": 10, "zero_optimization": zero,
              "gradient_clipping": 1.0, "prescale_gradients": False, "wall_clock_breakdown": False,
              "hybrid_engine": {"enabled": False, "max_out_tokens": 512, "inference_tp_size": 1,
                                "release_inference_cache": False, "pin_parameters": True,
                                "tp_gather_partition_size": 8},
              "tensorboard": {"enabled": False, "output_path": "step1_tensorboard/ds_tensorboard_logs/",
                              "job_name": "step1_model_tensorboard"}}
    if args.dtype == "bf16":
        config["bfloat16"] = {"enabled": True}
    return config


def data(rank: int, world: int, batch: int) -> torch.utils.data.DataLoader:
    samples = []
    for i in range(64):
        ids = torch.randint(0, VOCAB, (SEQ,), generator=torch.Generator().manual_seed(i))
        samples.append({"input_ids": ids, "attention_mask": torch.ones(SEQ, dtype=torch.long), "labels": ids.clone()})
    sampler = torch.utils.data.distributed.DistributedSampler(samples, num_replicas=world, rank=rank, seed=1234)
    return torch.utils.data.DataLoader(samples, collate_fn=default_data_collator, sampler=sampler, batch_size=batch)


def save_like_deepspeed_chat(engine: deepspeed.DeepSpeedEngine, out: str, zero_stage: int) -> None:
    model = engine.module
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "pytorch_model.bin")
    if torch.distributed.get_rank() == 0:  # at ZeRO-3 this writes placeholders, overwritten just below
        torch.save({k: v for k, v in model.state_dict().items() if "lora" not in k}, path)
    if zero_stage == 3:
        whole = {}
        for name, p in model.named_parameters():
            fetch = [p] if hasattr(p, "ds_id") and p.ds_status == ZeroParamStatus.NOT_AVAILABLE else []
            with deepspeed.zero.GatheredParameters(fetch, enabled=True):
                value = p.data.cpu()
            if torch.distributed.get_rank() == 0 and "lora" not in name:
                whole[name] = value
        if torch.distributed.get_rank() == 0:
            torch.save(whole, path)


def secondary_partitions(engine: deepspeed.DeepSpeedEngine) -> int:
    """Evidence that ZeRO++'s secondary partition (hpZ) is in use, taken after a backward: DeepSpeed's parameters
    holding a `ds_secondary_tensor`, or, under shardwise, the gathers its secondary ("hpz") group served."""
    stats = getattr(getattr(engine, "comm", None), "stats", None)
    if stats is not None:
        return sum(s.calls for (_, group), s in stats.ops.items() if group == "hpz")
    return sum(getattr(p, "ds_secondary_tensor", None) is not None for p in engine.module.parameters())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--output_dir", required=True)
    p.add_argument("--zero_stage", type=int, default=0)
    p.add_argument("--offload", action="store_true")
    p.add_argument("--lora_dim", type=int, default=0)
    p.add_argument("--gradient_checkpointing", action="store_true")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--gas", type=int, default=1)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--persistence_threshold", type=float, default=1e4, help="0: no parameter stays whole")
    p.add_argument("--hpz", type=int, default=1, help="ZeRO++ zero_hpz_partition_size")
    p.add_argument("--qwz", action="store_true", help="ZeRO++ zero_quantized_weights")
    p.add_argument("--qgz", action="store_true", help="ZeRO++ zero_quantized_gradients")
    p.add_argument("--ranks_per_node", type=int, default=0, help="simulate nodes of this many consecutive ranks")
    p.add_argument("--local_rank", type=int, default=-1)
    p = deepspeed.add_config_arguments(p)
    args = p.parse_args()
    if args.ranks_per_node:  # shardwise tells nodes apart by SHARDWISE_NODE; DeepSpeed's CPU accelerator counts a
        # node's devices from LOCAL_SIZE (its qgZ counts nodes so; its hpZ groups consecutive ranks whatever the nodes)
        os.environ["SHARDWISE_NODE"] = f"node{int(os.environ['RANK']) // args.ranks_per_node}"
        os.environ["LOCAL_SIZE"] = str(args.ranks_per_node)
    local_rank = max(args.local_rank, 0)
    get_accelerator().set_device(local_rank)
    device = torch.device(get_accelerator().device_name(), local_rank)
    deepspeed.init_distributed()
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    if rank == 0 and not os.path.isdir(args.model):
        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                     tie_word_embeddings=False)).save_pretrained(args.model)
    torch.distributed.barrier()
    config = ds_config(args)
    keep_alive = HfDeepSpeedConfig(config) if args.zero_stage == 3 else None  # noqa: F841 - zero.Init while loading
    get_accelerator().manual_seed_all(1234)
    model = AutoModelForCausalLM.from_pretrained(args.model)
    if args.lora_dim:
        model = to_lora(model, "self_attn", args.lora_dim)
        model.enable_input_require_grads()  # checkpointed layers need an input that requires grad
    decay = [p for n, p in model.named_parameters() if p.requires_grad and "norm" not in n]
    no_decay = [p for n, p in model.named_parameters() if p.requires_grad and "norm" in n]
    groups = [g for g in ({"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}) if g["params"]]
    optimizer = (DeepSpeedCPUAdam if args.offload else FusedAdam)(groups, lr=1e-2, betas=(0.9, 0.95))
    scheduler = get_scheduler("cosine", optimizer=optimizer, num_warmup_steps=1, num_training_steps=args.steps)
    engine, optimizer, _, scheduler = deepspeed.initialize(model=model, optimizer=optimizer, args=args, config=config,
                                                           lr_scheduler=scheduler, dist_init_required=True)
    if args.gradient_checkpointing:
        engine.gradient_checkpointing_enable()
    params = sum(p.ds_numel if hasattr(p, "ds_tensor") else p.numel() for p in engine.model.parameters())
    losses = []
    for step, batch in enumerate(data(rank, world, args.batch)):
        outputs = engine(**{k: v.to(device) for k, v in batch.items()}, use_cache=False)
        engine.backward(outputs.loss)
        secondary = secondary_partitions(engine)
        engine.step()
        mean = outputs.loss.detach().float().clone()
        torch.distributed.all_reduce(mean)
        losses.append(mean.item() / world)
        if len(losses) == args.steps * args.gas:
            break
    engine.tput_timer.update_epoch_count()
    save_like_deepspeed_chat(engine, args.output_dir, args.zero_stage)
    if rank == 0:
        print("RESULT " + json.dumps({"losses": losses, "params": params, "epochs": engine.tput_timer.epoch_count,
                                      "lr": engine.get_lr(), "secondary": secondary}), flush=True)


if __name__ == "__main__":
    main()
