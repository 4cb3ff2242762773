"""A TRL preference fine-tune written for DeepSpeed: `DPOTrainer` with a policy and a reference model loaded from
the same tiny LLaMA folder, a prompt/chosen/rejected dataset built in the script, `DPOConfig(deepspeed=<json>)`.
TRL hands the reference model to `deepspeed.initialize` with no optimizer (trl.models.utils.prepare_deepspeed),
partitioned like the policy at ZeRO-3. fp32; prints `RESULT <json>` on rank 0 (--no-deepspeed: the plain run,
the oracle)."""

from __future__ import annotations

import argparse
import json
import os

from tests.compat.scripts.trl_common import base_model, ds_config, report, training_kwargs


def preferences(n: int = 32) -> list[dict]:
    return [{"prompt": f"What is {i} plus {i % 5}?", "chosen": f" It is {2 * i - i + i % 5}.",
             "rejected": f" Maybe {i * 3 + 1}, or{' not' * (i % 3)} so."} for i in range(n)]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--base", required=True)
    p.add_argument("--stage", type=int, default=3)
    p.add_argument("--no-deepspeed", dest="use_deepspeed", action="store_false")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--local_rank", type=int, default=-1)
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    ds_path = os.path.join(args.out, "ds_config.json")
    with open(ds_path, "w") as f:
        json.dump(ds_config(args.stage), f)

    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import DPOConfig, DPOTrainer

    config = DPOConfig(**training_kwargs(args, ds_path), max_length=48)
    base = base_model(args.base)
    # from_pretrained after the config: at ZeRO-3 both models are built partitioned (HfDeepSpeedConfig)
    model = AutoModelForCausalLM.from_pretrained(base)
    ref_model = AutoModelForCausalLM.from_pretrained(base)
    trainer = DPOTrainer(model=model, ref_model=ref_model, args=config, train_dataset=Dataset.from_list(preferences()))
    trainer.train()
    report(trainer, extra=("rewards/margins", "rewards/accuracies"))


if __name__ == "__main__":
    main()
