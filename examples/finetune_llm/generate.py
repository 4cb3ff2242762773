"""Greedy completions from a fine-tuned model: merged weights, or a base model plus a LoRA adapter.

    python examples/finetune_llm/generate.py --model checkpoints/finetune_llm/out/merged
    python examples/finetune_llm/generate.py --adapter checkpoints/finetune_llm/out/adapter   # base from the adapter
    python examples/finetune_llm/generate.py --model BASE --adapter ADAPTER --prompt "What is 2 plus 3?"

One process, no shardwise needed: what train.py saved is plain Hugging Face / peft output. Prompts
are formatted as in training (--template); without --prompt, a few held-out-style questions are used.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402

from examples.finetune_llm.model_io import fp32, greedy_completions  # noqa: E402

DEFAULT_PROMPTS = ["What is 21 plus 14?", "Which day comes after Friday?", "Is 38 even or odd?",
                   "Spell the word 'garden' backwards."]


def load(model: str | None, adapter: str | None) -> tuple[torch.nn.Module, object]:
    """The model to generate with and its tokenizer (the adapter's directory has one when train.py saved it)."""
    import transformers

    if model is None and adapter is None:
        raise SystemExit("generate: pass --model (a merged or base model directory), --adapter, or both.")
    if model is None:
        model = json.loads((Path(adapter) / "adapter_config.json").read_text())["base_model_name_or_path"]
    network = transformers.AutoModelForCausalLM.from_pretrained(model, **fp32())
    if adapter is not None:
        import peft

        network = peft.PeftModel.from_pretrained(network, adapter)
    has_tokenizer = adapter is not None and (Path(adapter) / "tokenizer_config.json").is_file()
    tokenizer = transformers.AutoTokenizer.from_pretrained(adapter if has_tokenizer else model)
    return network.eval(), tokenizer


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="model directory: merged weights, or the base for --adapter")
    parser.add_argument("--adapter", help="peft LoRA adapter directory")
    parser.add_argument("--prompt", action="append", help="a prompt (repeatable); rm-static turns are understood")
    parser.add_argument("--template", choices=["auto", "chat", "plain"], default="auto")
    parser.add_argument("--max_new_tokens", type=int, default=32)
    args = parser.parse_args(argv)
    model, tokenizer = load(args.model, args.adapter)
    template = args.template if args.template != "auto" else ("chat" if tokenizer.chat_template else "plain")
    prompts = args.prompt or [f"\n\nHuman: {p}\n\nAssistant:" for p in DEFAULT_PROMPTS]
    for prompt, ids in zip(prompts, greedy_completions(model, tokenizer, prompts, template, args.max_new_tokens)):
        print(f"--- {' '.join(prompt.split())}\n    {tokenizer.decode(ids, skip_special_tokens=True).strip()}")


if __name__ == "__main__":
    main()
