"""A TRL preference fine-tune written for DeepSpeed: `DPOTrainer` with a policy and a reference model loaded from
the same tiny LLaMA folder, a prompt/chosen/rejected dataset built in the script, `DPOConfig(deepspeed=<json>)`.
TRL hands the reference model to `deepspeed.initialize` with no optimizer (trl.models.utils.prepare_deepspeed),
partitioned like the policy at ZeRO-3. fp32; prints `RESULT <json>` on rank 0 (--no-deepspeed: the plain run,
the oracle)."""

from __future__ import annotations

from tests.compat.scripts.trl_common import base_model, report, script_args, training_kwargs


def preferences(n: int = 32) -> list[dict]:
    return [{"prompt": f"What is {i} plus {i % 5}?", "chosen": f" It is {2 * i - i + i % 5}.",
             "rejected": f" Maybe {i * 3 + 1}, or{' not' * (i % 3)} so."} for i in range(n)]


def main() -> None:
    args, ds_path = script_args(3)

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
