"""What trl_sft.py and trl_dpo.py share: the DeepSpeed config as TRL users write it, the tiny LLaMA folder, the
training arguments both trainers take, and the `RESULT` line."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path

import torch

TOKENIZER = Path(__file__).resolve().parents[3] / "examples" / "finetune_llm" / "tiny_llama"


def script_args(default_stage: int) -> tuple[argparse.Namespace, str]:
    """Both scripts' command line, and the DeepSpeed config written as a JSON file in --out (its path)."""
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--base", required=True)
    p.add_argument("--stage", type=int, default=default_stage)
    p.add_argument("--no-deepspeed", dest="use_deepspeed", action="store_false")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--local_rank", type=int, default=-1)
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    ds_path = os.path.join(args.out, "ds_config.json")
    with open(ds_path, "w") as f:
        json.dump(ds_config(args.stage), f)
    return args, ds_path


def ds_config(stage: int) -> dict:
    zero = {"stage": stage, "overlap_comm": True, "contiguous_gradients": True, "reduce_bucket_size": "auto",
            "stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto",
            "stage3_gather_16bit_weights_on_model_save": True}
    return {"fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"}, "zero_optimization": zero,
            "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 2000,
            "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False}


def base_model(path: str) -> str:
    """A 2-layer LLaMA (random init, seed 0) with the bundled tokenizer, written by rank 0 once."""
    if int(os.environ.get("RANK", 0)) == 0 and not os.path.isdir(path):
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                             tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
        LlamaForCausalLM(config).save_pretrained(path + ".tmp")
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(TOKENIZER / name, os.path.join(path + ".tmp", name))
        os.replace(path + ".tmp", path)  # whole or absent, for the other ranks that wait on it
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    for _ in range(600):  # a plain run's other ranks may have no process group yet
        if os.path.isdir(path):
            break
        time.sleep(0.1)
    return path


def training_kwargs(args: argparse.Namespace, ds_path: str) -> dict:
    """Arguments of SFTConfig/DPOConfig: fp32 (their bf16 default off), logging every step, no saving."""
    return dict(output_dir=args.out, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                max_steps=args.steps, learning_rate=1e-2, warmup_steps=1, logging_steps=1, save_strategy="no",
                report_to=[], seed=0, data_seed=0, bf16=False, fp16=False,
                deepspeed=ds_path if args.use_deepspeed else None, use_cpu=not torch.cuda.is_available(),
                disable_tqdm=True)


def report(trainer, extra: tuple[str, ...] = ()) -> None:
    if int(os.environ.get("RANK", 0)) != 0:
        return
    engine = trainer.model_wrapped
    logs = [h for h in trainer.state.log_history if "loss" in h]
    result = {"losses": [h["loss"] for h in logs], "steps": [h["step"] for h in logs],
              "grad_norms": [h.get("grad_norm") for h in logs], "engine": type(engine).__name__}
    for name in extra:
        result[name] = [h.get(name) for h in logs]
    ref = getattr(trainer, "ref_model", None)
    if ref is not None:
        result["ref_engine"] = type(ref).__name__
    print("RESULT " + json.dumps(result), flush=True)
