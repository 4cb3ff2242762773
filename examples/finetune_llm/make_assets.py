"""Write the bundled assets of the fine-tuning example, and (on request) a randomly initialised base model.

    python examples/finetune_llm/make_assets.py                       # data/pairs.jsonl + tiny_llama/ (bundled)
    python examples/finetune_llm/make_assets.py --skip_bundled --base checkpoints/finetune_llm/base

The prompt/response pairs are generated here from templates (arithmetic, word games, weekdays, unit
conversions): no third-party text, so they are free of any licence. The prompts have the shape of
Dahoas/rm-static (``"\\n\\nHuman: ...\\n\\nAssistant:"``, response starting with a space). The tokenizer is
a byte-level BPE trained on those pairs with the `tokenizers` library; `tiny_llama/` is a LLaMA config
sized for two CPU cores plus that tokenizer and a chat template, loadable with `from_pretrained`.
Re-running writes byte-identical files.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path
from typing import Callable

HERE = Path(__file__).resolve().parent
DATA = HERE / "data" / "pairs.jsonl"
MODEL_DIR = HERE / "tiny_llama"
SPECIAL = ["<pad>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
WORDS = ["apple", "river", "stone", "cloud", "garden", "window", "candle", "forest", "bridge", "silver",
         "yellow", "planet", "rabbit", "pencil", "orange", "summer", "winter", "mirror", "basket", "ladder"]
PLURALS = {"mouse": "mice", "child": "children", "goose": "geese", "tooth": "teeth", "foot": "feet",
           "man": "men", "woman": "women", "person": "people", "leaf": "leaves", "knife": "knives",
           "box": "boxes", "city": "cities", "cat": "cats", "dog": "dogs", "bus": "buses", "wolf": "wolves"}
UNITS = [("hours", "minutes", 60), ("minutes", "seconds", 60), ("days", "hours", 24), ("weeks", "days", 7),
         ("meters", "centimeters", 100), ("kilograms", "grams", 1000)]
COUNT_WORDS = {2: "two", 3: "three", 4: "four"}


def _addition(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(1, 60), rng.randint(1, 60)
    return f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}."


def _subtraction(rng: random.Random) -> tuple[str, str]:
    a = rng.randint(10, 99)
    b = rng.randint(1, a)
    return f"What is {a} minus {b}?", f"{a} minus {b} is {a - b}."


def _reverse(rng: random.Random) -> tuple[str, str]:
    word = rng.choice(WORDS)
    return f"Spell the word '{word}' backwards.", f"'{word}' backwards is '{word[::-1]}'."


def _weekday(rng: random.Random) -> tuple[str, str]:
    i = rng.randrange(7)
    return f"Which day comes after {DAYS[i]}?", f"{DAYS[(i + 1) % 7]} comes after {DAYS[i]}."


def _units(rng: random.Random) -> tuple[str, str]:
    big, small, factor = rng.choice(UNITS)
    n = rng.randint(2, 9)
    return f"How many {small} are in {n} {big}?", f"{n} {big} is {n * factor} {small}."


def _parity(rng: random.Random) -> tuple[str, str]:
    n = rng.randint(1, 99)
    return f"Is {n} even or odd?", f"{n} is {'even' if n % 2 == 0 else 'odd'}."


def _larger(rng: random.Random) -> tuple[str, str]:
    a, b = rng.sample(range(1, 100), 2)
    return f"Which is larger, {a} or {b}?", f"{max(a, b)} is larger than {min(a, b)}."


def _plural(rng: random.Random) -> tuple[str, str]:
    word = rng.choice(sorted(PLURALS))
    return f"What is the plural of '{word}'?", f"The plural of '{word}' is '{PLURALS[word]}'."


def _repeat(rng: random.Random) -> tuple[str, str]:
    word, n = rng.choice(WORDS), rng.choice(sorted(COUNT_WORDS))
    return f"Repeat the word '{word}' {COUNT_WORDS[n]} times.", " ".join([word] * n) + "."


def _capitals(rng: random.Random) -> tuple[str, str]:
    a, b = rng.sample(WORDS, 2)
    return f"Write '{a} {b}' in capital letters.", f"{a.upper()} {b.upper()}."


TASKS: list[Callable[[random.Random], tuple[str, str]]] = [
    _addition, _subtraction, _reverse, _weekday, _units, _parity, _larger, _plural, _repeat, _capitals]


def make_pairs(count: int = 400, seed: int = 0) -> list[dict[str, str]]:
    """`count` distinct prompt/response pairs in rm-static's shape, cycling through the task templates."""
    rng = random.Random(seed)
    seen: set[str] = set()
    pairs = []
    tasks = list(TASKS)
    turn = 0
    while len(pairs) < count and tasks:
        task = tasks[turn % len(tasks)]
        for _ in range(100):  # a task with few distinct questions (weekdays) runs dry and leaves the rotation
            question, answer = task(rng)
            if question not in seen:
                break
        else:
            tasks.remove(task)
            continue
        turn += 1
        seen.add(question)
        pairs.append({"prompt": f"\n\nHuman: {question}\n\nAssistant:", "response": f" {answer}"})
    return pairs


def train_tokenizer(texts: list[str], vocab_size: int) -> object:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    return tok


def write_bundled(count: int, vocab_size: int) -> None:
    pairs = make_pairs(count)
    DATA.parent.mkdir(parents=True, exist_ok=True)
    DATA.write_text("".join(json.dumps(p) + "\n" for p in pairs))
    tok = train_tokenizer([p["prompt"] + p["response"] for p in pairs], vocab_size)
    MODEL_DIR.mkdir(parents=True, exist_ok=True)
    tok.save(str(MODEL_DIR / "tokenizer.json"))
    tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
                        "pad_token": "<pad>", "add_bos_token": False, "model_max_length": 256,
                        "chat_template": CHAT_TEMPLATE, "clean_up_tokenization_spaces": False}
    (MODEL_DIR / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": tok.get_vocab_size(),
              "hidden_size": 128, "intermediate_size": 352, "num_hidden_layers": 4, "num_attention_heads": 4,
              "num_key_value_heads": 2, "max_position_embeddings": 256, "rms_norm_eps": 1e-5,
              "rope_theta": 10000.0, "tie_word_embeddings": False, "pad_token_id": SPECIAL.index("<pad>"),
              "bos_token_id": SPECIAL.index("<s>"), "eos_token_id": SPECIAL.index("</s>"),
              "hidden_act": "silu", "initializer_range": 0.02, "torch_dtype": "float32"}
    (MODEL_DIR / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    print(f"wrote {len(pairs)} pairs to {DATA} and a {tok.get_vocab_size()}-token tokenizer + config to {MODEL_DIR}")


def write_base(out: Path, seed: int, pretrain_steps: int) -> None:
    """A base model from `tiny_llama/`, briefly pretrained (plain next-token prediction, one process) on
    the public-domain King James text bundled with the demo, saved as a Hugging Face model directory.

    LoRA adapts what a model already computes; on a randomly initialised model it has little to adapt,
    so the demo's base has read some English first (~300 steps: a few tens of seconds on 2 cores).
    """
    import shutil

    import torch
    import transformers

    torch.manual_seed(seed)
    tokenizer = transformers.AutoTokenizer.from_pretrained(MODEL_DIR)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(MODEL_DIR))
    if pretrain_steps:
        text = (HERE.parent / "demo" / "data" / "kjv_genesis_to_2samuel.txt").read_text()
        ids = torch.tensor(tokenizer(text, add_special_tokens=False).input_ids)
        _pretrain(model, ids, pretrain_steps, seq_len=128, batch=16)
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(MODEL_DIR / name, out / name)
    print(f"wrote a {sum(p.numel() for p in model.parameters()):,}-parameter base model to {out}")


def _pretrain(model: object, ids: object, steps: int, seq_len: int, batch: int) -> None:
    import torch

    sys.path.insert(0, str(HERE.parents[1]))  # the repository root, for examples.step_bar
    from examples.step_bar import StepBar

    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 20) * (1 - 0.9 * s / steps))
    generator = torch.Generator().manual_seed(0)
    with StepBar(steps, description="pretraining the base on KJV text") as bar:
        for _ in range(steps):
            starts = torch.randint(0, ids.numel() - seq_len, (batch,), generator=generator)
            window = torch.stack([ids[i:i + seq_len] for i in starts.tolist()])
            loss = model(input_ids=window, labels=window).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad()
            bar.update(loss=f"{loss.item():.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", type=Path, help="also write a randomly initialised base model here")
    parser.add_argument("--seed", type=int, default=0, help="initialisation seed of the base model")
    parser.add_argument("--pretrain_steps", type=int, default=300, help="next-token steps on KJV text (0: random)")
    parser.add_argument("--count", type=int, default=400, help="prompt/response pairs to generate")
    parser.add_argument("--vocab_size", type=int, default=512, help="BPE vocabulary size")
    parser.add_argument("--skip_bundled", action="store_true", help="do not rewrite data/ and tiny_llama/")
    args = parser.parse_args()
    if not args.skip_bundled:
        write_bundled(args.count, args.vocab_size)
    if args.base:
        write_base(args.base, args.seed, args.pretrain_steps)


if __name__ == "__main__":
    main()
