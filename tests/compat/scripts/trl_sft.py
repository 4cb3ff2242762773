"""A TRL supervised fine-tune written for DeepSpeed, as TRL's docs write one: `SFTTrainer` on a tiny LLaMA from a
local folder (the byte-level tokenizer bundled with examples/finetune_llm), a text dataset built in the script,
`SFTConfig(deepspeed=<json>)` with Hugging Face's "auto" values. fp32 (TRL's bf16 default is turned off): the
losses are compared to 1e-5. Runs unchanged under the real DeepSpeed and under shardwise's compatibility package
(and, with --no-deepspeed, as a plain run: the oracle). Prints `RESULT <json>` on rank 0."""

from __future__ import annotations

from tests.compat.scripts.trl_common import base_model, report, script_args, training_kwargs


def texts(n: int = 32) -> list[dict]:
    """Short question/answer lines of varied length, so padding and the loss mask matter."""
    return [{"text": f"Question: what is {i} plus {3 * i % 7}? Answer: {i + 3 * i % 7}." + " Yes." * (i % 3)}
            for i in range(n)]


def main() -> None:
    args, ds_path = script_args(2)

    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    config = SFTConfig(**training_kwargs(args, ds_path), max_length=48)
    base = base_model(args.base)
    trainer = SFTTrainer(model=base, args=config, train_dataset=Dataset.from_list(texts()))
    trainer.train()
    report(trainer, extra=("mean_token_accuracy",))


if __name__ == "__main__":
    main()
