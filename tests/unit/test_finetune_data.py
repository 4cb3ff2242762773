"""The fine-tuning example's data path and config handling, without processes: formatting, response-only
labels, truncation, packing, padding, the token loss, and the bundled assets."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

transformers = pytest.importorskip("transformers")

from examples.finetune_llm import data as sft  # noqa: E402
from examples.finetune_llm import make_assets  # noqa: E402

BUNDLED = REPO_ROOT / "examples" / "finetune_llm"


@pytest.fixture(scope="module")
def tokenizer():
    return transformers.AutoTokenizer.from_pretrained(BUNDLED / "tiny_llama")


# --- response-only loss on a hand-made batch -------------------------------------------------------
def test_loss_covers_exactly_the_response_tokens():
    # Two rows, vocabulary 5. Row 0: prompt [1, 2], response [3, 4]. Row 1: prompt [1], response [2], pad.
    labels = torch.tensor([[-100, -100, 3, 4], [-100, 2, -100, -100]])
    logits = torch.randn(2, 4, 5, generator=torch.Generator().manual_seed(0), requires_grad=True)
    total = sft.token_loss_sum(logits, labels)
    # By hand: logits at t predict the label at t+1; only labels 3, 4 (row 0) and 2 (row 1) count.
    expected = (F.cross_entropy(logits[0, 1:2], torch.tensor([3]), reduction="sum")
                + F.cross_entropy(logits[0, 2:3], torch.tensor([4]), reduction="sum")
                + F.cross_entropy(logits[1, 0:1], torch.tensor([2]), reduction="sum"))
    torch.testing.assert_close(total, expected)
    assert sft.target_count(labels) == 3
    total.backward()
    # No gradient reaches the positions whose next token is prompt or padding.
    touched = logits.grad.abs().sum(-1) > 0
    assert touched.tolist() == [[False, True, True, False], [True, False, False, False]]


def test_chat_pair_masks_the_prompt_and_ends_with_eos(tokenizer):
    ex = sft.encode_pair(tokenizer, "\n\nHuman: What is 2 plus 3?\n\nAssistant:", " 2 plus 3 is 5.", "chat", 128)
    head = sft.prompt_ids(tokenizer, "\n\nHuman: What is 2 plus 3?\n\nAssistant:", "chat")
    assert ex.input_ids[:len(head)] == head
    assert ex.labels[:len(head)] == [sft.IGNORE] * len(head)
    answer = ex.input_ids[len(head):]
    assert ex.labels[len(head):] == answer
    assert answer[-1] == tokenizer.eos_token_id
    assert tokenizer.decode(answer[:-1]) == "2 plus 3 is 5."
    text = tokenizer.decode(head)
    assert text == "<|user|>\nWhat is 2 plus 3?<|end|>\n<|assistant|>\n"


def test_plain_pair_is_the_concatenation(tokenizer):
    prompt, response = "\n\nHuman: Hi\n\nAssistant:", " Hello."
    ex = sft.encode_pair(tokenizer, prompt, response, "plain", 128)
    assert ex.input_ids[0] == tokenizer.bos_token_id and ex.input_ids[-1] == tokenizer.eos_token_id
    assert tokenizer.decode(ex.input_ids[1:-1]) == prompt + response
    n_prompt = sum(1 for label in ex.labels if label == sft.IGNORE)
    assert tokenizer.decode(ex.input_ids[1:n_prompt]) == prompt


def test_truncation_keeps_the_response_and_cuts_the_prompt_from_the_left(tokenizer):
    prompt = "\n\nHuman: " + "word " * 100 + "\n\nAssistant:"
    ex = sft.encode_pair(tokenizer, prompt, " Short answer.", "chat", 32)
    assert len(ex.input_ids) == len(ex.labels) == 32
    kept = [t for t, label in zip(ex.input_ids, ex.labels) if label != sft.IGNORE]
    assert tokenizer.decode(kept[:-1]) == "Short answer."
    assert tokenizer.decode(ex.input_ids[:32 - len(kept)]).endswith("<|assistant|>\n")
    long = sft.encode_pair(tokenizer, "Q", " " + "answer " * 100, "chat", 16)  # the response alone is too long
    assert len(long.input_ids) == 16 and long.labels[0] == sft.IGNORE and long.labels[-1] != sft.IGNORE


def test_rm_static_turns_become_messages():
    prompt = "\n\nHuman: Hi there\n\nAssistant: Hello!\n\nHuman: What is 2 plus 2?\n\nAssistant:"
    assert sft.to_messages(prompt) == [{"role": "user", "content": "Hi there"},
                                       {"role": "assistant", "content": "Hello!"},
                                       {"role": "user", "content": "What is 2 plus 2?"}]
    assert sft.to_messages("  just a question ") == [{"role": "user", "content": "just a question"}]


# --- batching ---------------------------------------------------------------------------------------
def test_padding_collator():
    batch = sft.PadCollator(pad_id=0)([sft.Example([5, 6, 7], [-100, 6, 7]), sft.Example([8], [-100])])
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["labels"].tolist() == [[-100, 6, 7], [-100, -100, -100]]


def test_packing_fills_rows_and_keeps_labels():
    examples = [sft.Example([1, 2, 3], [-100, 2, 3]), sft.Example([4, 5], [-100, 5]), sft.Example([6, 7, 8], [-100, 7, 8])]
    rows = sft.pack(examples, 4)
    assert [r.input_ids for r in rows] == [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert [r.labels for r in rows] == [[-100, 2, 3, -100], [5, -100, 7, 8]]


def test_split_is_seeded_and_disjoint():
    pairs = [{"prompt": str(i), "response": str(i)} for i in range(50)]
    train, held = sft.split_pairs(pairs, 0.1, seed=3)
    assert len(held) == 5 and len(train) == 45
    assert {p["prompt"] for p in train}.isdisjoint({p["prompt"] for p in held})
    assert sft.split_pairs(pairs, 0.1, seed=3) == (train, held)
    assert sft.split_pairs(pairs, 0.0, seed=3)[1] == []


def test_jsonl_errors_name_the_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "a", "response": "b"}\n{"prompt": "a"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: needs string fields 'prompt' and 'response'"):
        sft.load_pairs(path)
    path.write_text('{"prompt": "a", \n')
    with pytest.raises(ValueError, match=r"bad.jsonl:1: not valid JSON"):
        sft.load_pairs(path)


# --- bundled assets and config ------------------------------------------------------------------------
def test_bundled_pairs_are_what_make_assets_generates():
    pairs = sft.load_pairs(BUNDLED / "data" / "pairs.jsonl")
    assert pairs == make_assets.make_pairs(len(pairs))
    assert 300 <= len(pairs) <= 1000
    assert len({p["prompt"] for p in pairs}) == len(pairs)
    assert all(p["prompt"].startswith("\n\nHuman: ") and p["prompt"].endswith("\n\nAssistant:") for p in pairs)


def test_bundled_config_matches_the_tokenizer(tokenizer):
    config = transformers.AutoConfig.from_pretrained(BUNDLED / "tiny_llama")
    assert config.model_type == "llama" and config.vocab_size == len(tokenizer)
    assert (config.pad_token_id, config.eos_token_id) == (tokenizer.pad_token_id, tokenizer.eos_token_id)
    lengths = [len(ex.input_ids) for ex in sft.encode_all(tokenizer, sft.load_pairs(BUNDLED / "data" / "pairs.jsonl"), "chat", 1000)]
    assert max(lengths) <= 128  # the script's default --max_seq_len truncates nothing


def test_script_config_overrides_pass_offload_through(tmp_path):
    from examples.finetune_llm import train
    from shardwise.config import parse_config

    args = train.parse_args(["--model", "m", "--offload", "nvme", "--nvme_path", str(tmp_path), "--zero_stage", "3",
                             "--bf16", "--lr", "5e-4", "--steps", "77"])
    cfg = train.load_config(args)
    zero = cfg["zero_optimization"]
    assert zero["offload_optimizer"] == zero["offload_param"] == {"device": "nvme", "nvme_path": str(tmp_path)}
    assert cfg["bf16"] == {"enabled": True} and cfg["optimizer"]["params"]["lr"] == 5e-4
    assert cfg["scheduler"]["params"]["total_num_steps"] == 77 and cfg["scheduler"]["params"]["warmup_max_lr"] == 5e-4
    bundled = parse_config(json.loads((BUNDLED / "ds_config.json").read_text()), dp_size=2)
    assert bundled.zero_optimization.stage == 3
    parsed = parse_config(cfg, dp_size=2).zero_optimization  # the script's config is one shardwise trains with
    assert (parsed.stage, parsed.offload_optimizer.device, parsed.offload_param.device) == (3, "nvme", "nvme")
    assert parsed.offload_optimizer.nvme_path == parsed.offload_param.nvme_path == str(tmp_path)


def test_perplexity_is_exp_of_the_token_mean():
    logits = torch.zeros(1, 3, 4)  # uniform over 4 tokens: loss ln 4 per token, perplexity 4
    labels = torch.tensor([[-100, 1, 2]])
    mean = sft.token_loss_sum(logits, labels).item() / sft.target_count(labels)
    assert math.isclose(math.exp(mean), 4.0, rel_tol=1e-6)
