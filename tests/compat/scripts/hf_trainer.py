"""A Hugging Face Trainer fine-tune written for DeepSpeed, as users write them: a tiny LLaMA from a local
config, optional peft LoRA, `TrainingArguments(deepspeed=<json>)` with Hugging Face's "auto" values.
Runs unchanged under the real DeepSpeed and under shardwise's compatibility package (and, with
--no-deepspeed, as a plain Trainer run: the oracle). Prints `RESULT <json>` on rank 0."""

from __future__ import annotations

import argparse
import json
import os

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

VOCAB, SEQ = 64, 16


def ds_config(args: argparse.Namespace) -> dict:
    zero = {"stage": args.stage, "overlap_comm": True, "contiguous_gradients": True, "sub_group_size": 1e9,
            "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
            "stage3_param_persistence_threshold": "auto", "stage3_max_live_parameters": 1e9,
            "stage3_max_reuse_distance": 1e9, "stage3_gather_16bit_weights_on_model_save": True}
    if args.offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        if args.stage == 3:
            zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    config = {"fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"}, "zero_optimization": zero,
              "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 2000,
              "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False}
    if args.ds_optimizer:  # DeepSpeed's own optimizer and scheduler, every value "auto"
        config["optimizer"] = {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                            "weight_decay": "auto"}}
        config["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                               "warmup_num_steps": "auto"}}
    if args.save_format:  # shardwise's key: saves in DeepSpeed's layout (the real DeepSpeed is never given it)
        config["checkpoint"] = {"format": args.save_format}
    return config


class Tokens(torch.utils.data.Dataset):
    def __init__(self, samples: int = 64) -> None:
        self.samples = samples

    def __len__(self) -> int:
        return self.samples

    def __getitem__(self, i: int) -> dict:
        ids = torch.randint(0, VOCAB, (SEQ,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones(SEQ, dtype=torch.long)}


def base_model(path: str) -> str:
    if int(os.environ.get("RANK", 0)) == 0 and not os.path.isdir(path):
        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                             tie_word_embeddings=False)
        LlamaForCausalLM(config).save_pretrained(path)
    return path


def placement(trainer: Trainer) -> dict | None:
    """Where shardwise's engine keeps the trained state: its device, where the stage-3 parameter slices and the
    optimizer's masters live (None under the real DeepSpeed or without one)."""
    engine = trainer.model_wrapped
    strategy = getattr(engine, "strategy", None)
    if strategy is None:
        return None
    tensors = strategy.model_state_tensors()
    slices = [u.shard for u in getattr(strategy, "units", []) if not u.persistent and u.shard.numel()]
    return {"engine": torch.device(engine.device).type,
            "offloaded": [tensors.optimizer_offloaded, tensors.params_offloaded],
            "slices": sorted({t.device.type for t in slices}),
            "masters": sorted({m.device.type for m in tensors.masters if m.numel()})}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--base", required=True)
    p.add_argument("--stage", type=int, default=3)
    p.add_argument("--offload", action="store_true")
    p.add_argument("--lora", action="store_true")
    p.add_argument("--gc", action="store_true", help="gradient checkpointing")
    p.add_argument("--ds_optimizer", action="store_true", help="optimizer/scheduler sections in the DeepSpeed config")
    p.add_argument("--no-deepspeed", dest="use_deepspeed", action="store_false")
    p.add_argument("--deepspeed", default=None, help="a DeepSpeed config file to use instead of the one built from "
                                                     "the flags (as Hugging Face's example scripts take it)")
    p.add_argument("--per_device_train_batch_size", type=int, default=2)
    p.add_argument("--gradient_accumulation_steps", type=int, default=2)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--samples", type=int, default=64, help="the dataset's size (4: one batch, seen at every step)")
    p.add_argument("--save_steps", type=int, default=0)
    p.add_argument("--resume", default=None)
    p.add_argument("--save_format", default=None, help='shardwise\'s checkpoint.format ("deepspeed")')
    p.add_argument("--local_rank", type=int, default=-1)
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    ds_path = args.deepspeed or os.path.join(args.out, "ds_config.json")
    if not args.deepspeed:
        with open(ds_path, "w") as f:
            json.dump(ds_config(args), f)
    base = base_model(args.base)
    training_args = TrainingArguments(
        output_dir=args.out, per_device_train_batch_size=args.per_device_train_batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps, max_steps=args.steps,
        learning_rate=1e-2, warmup_steps=1, logging_steps=1, save_steps=args.save_steps or args.steps,
        save_strategy="steps" if args.save_steps else "no", report_to=[], seed=0, data_seed=0,
        deepspeed=ds_path if args.use_deepspeed else None, gradient_checkpointing=args.gc,
        use_cpu=not torch.cuda.is_available())
    if torch.distributed.is_initialized():
        torch.distributed.barrier()  # rank 0 wrote the base model
    model = LlamaForCausalLM.from_pretrained(base)
    devices = set()  # where the forward computed
    model.register_forward_hook(lambda module, inputs, out: devices.add(out.logits.device.type))
    if args.lora:
        from peft import LoraConfig, get_peft_model
        from transformers import set_seed

        set_seed(0)  # the adapter's random init, alike on every rank and in every run
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                 lora_dropout=0.0))
    trainer = Trainer(model=model, args=training_args, train_dataset=Tokens(args.samples))
    trainer.train(resume_from_checkpoint=args.resume)
    final = os.path.join(args.out, "final")
    trainer.save_model(final)
    if int(os.environ.get("RANK", 0)) == 0:
        logs = [h for h in trainer.state.log_history if "loss" in h]
        print("RESULT " + json.dumps({"losses": [h["loss"] for h in logs], "steps": [h["step"] for h in logs],
                                      "grad_norms": [h.get("grad_norm") for h in logs],
                                      "saved": sorted(os.listdir(final)), "devices": sorted(devices),
                                      "placement": placement(trainer)}),
              flush=True)


if __name__ == "__main__":
    main()
