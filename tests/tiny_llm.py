"""A tiny Hugging Face LLaMA folder for the inference and serving tests, and its single-process greedy oracle.

The config and the byte-level BPE tokenizer are those bundled with the fine-tuning example
(examples/finetune_llm/tiny_llama, built locally by its make_assets.py); the weights are a random init after
`torch.manual_seed(seed)`, saved in several safetensors shards so loading walks the index. Nothing is downloaded.
"""

from __future__ import annotations

import shutil
from pathlib import Path

TINY = Path(__file__).resolve().parents[1] / "examples" / "finetune_llm" / "tiny_llama"
PROMPTS = [
    "\n\nHuman: What is 12 plus 30?\n\nAssistant:",
    "Spell the word 'garden' backwards.",
    "Which day comes after Monday?",
    "hi",
    "\n\nHuman: How many minutes are in 3 hours?\n\nAssistant: 3 hours is",
    "Is 41 even or odd?",
    "What is the plural of 'mouse'?",
    "Repeat the word 'river' two times.",
    "Write 'apple stone' in capital letters.",
]


def write_tiny_llama(out: Path, seed: int = 0) -> Path:
    import torch
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(TINY))
    model.save_pretrained(out, max_shard_size="300KB")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TINY / name, out / name)
    return out


def greedy_oracle(folder: Path, prompts: list[str], max_new_tokens: int) -> dict[str, list[int]]:
    """Each prompt alone through the plain transformers model and `generate` (greedy): the new token ids."""
    import torch
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    out = {}
    with torch.no_grad():
        for prompt in prompts:
            ids = tokenizer(prompt, return_tensors="pt").input_ids
            generated = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                       do_sample=False, pad_token_id=tokenizer.pad_token_id)
            out[prompt] = generated[0, ids.shape[1]:].tolist()
    return out
