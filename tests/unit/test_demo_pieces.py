"""The demo's model, data and tokenizer on their own: no process group, no engine."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from examples.demo.data import DEFAULT_TEXT, TextDataset  # noqa: E402
from examples.demo.model import GPT, PRESETS, GPTConfig, preset  # noqa: E402
from examples.demo.tokenizer import ByteTokenizer  # noqa: E402


# --- tokenizer -----------------------------------------------------------------------------------
def test_tokenizer_round_trip_ascii_and_non_ascii():
    tok = ByteTokenizer()
    for text in ["And God said, Let there be light.", "naïve café — λόγος, 天地, 🙂", ""]:
        ids = tok.encode(text)
        assert ids == list(text.encode("utf-8"))
        assert all(0 <= i < tok.vocab_size for i in ids)
        assert tok.decode(ids) == text
    assert tok.vocab_size == 256


def test_tokenizer_decode_replaces_invalid_utf8():
    tok = ByteTokenizer()
    half_of_e_acute = tok.encode("é")[:1]
    assert tok.decode(tok.encode("ab") + half_of_e_acute) == "ab\ufffd"


# --- dataset -------------------------------------------------------------------------------------
@pytest.fixture
def small_text(tmp_path: Path) -> Path:
    path = tmp_path / "text.txt"
    path.write_text("".join(chr(ord("a") + i % 26) for i in range(1000)), encoding="utf-8")
    return path


def test_windows_are_inputs_and_labels_shifted_by_one(small_text: Path):
    ds = TextDataset(small_text, seq_len=16)
    assert len(ds.tokens) == 950  # 5% of 1000 bytes held out
    assert len(ds) == (950 - 17) // 16 + 1
    for i in (0, 1, len(ds) - 1):
        x, y = ds[i]
        assert x.shape == y.shape == (16,) and x.dtype == y.dtype == torch.int64
        assert torch.equal(x, ds.tokens[i * 16 : i * 16 + 16].long())
        assert torch.equal(x[1:], y[:-1])
        assert y[-1].item() == ds.tokens[i * 16 + 16].item()
    assert torch.equal(ds[1][0][0:1], ds[0][1][-1:])  # non-overlapping: window 1 starts where 0's labels end
    with pytest.raises(IndexError):
        ds[len(ds)]


def test_strided_windows_and_determinism(small_text: Path):
    ds = TextDataset(small_text, seq_len=16, stride=4)
    assert len(ds) == (950 - 17) // 4 + 1
    assert torch.equal(ds[3][0], ds.tokens[12:28].long())
    again = TextDataset(small_text, seq_len=16, stride=4)
    assert all(torch.equal(ds[i][0], again[i][0]) for i in range(len(ds)))


def test_val_split_is_the_disjoint_tail(small_text: Path):
    train = TextDataset(small_text, seq_len=16, split="train")
    val = TextDataset(small_text, seq_len=16, split="val")
    assert train.start == 0 and val.start == len(train.tokens) == 950
    whole = torch.tensor(list(small_text.read_bytes()), dtype=torch.uint8)
    assert torch.equal(torch.cat([train.tokens, val.tokens]), whole)
    assert len(val) == (50 - 17) // 16 + 1


def test_dataset_rejects_bad_arguments(small_text: Path):
    with pytest.raises(ValueError, match="split"):
        TextDataset(small_text, seq_len=16, split="test")
    with pytest.raises(ValueError, match="seq_len"):
        TextDataset(small_text, seq_len=100, split="val")  # 50 validation bytes


def test_bundled_text_gives_enough_windows():
    train = TextDataset(DEFAULT_TEXT, seq_len=128)
    val = TextDataset(DEFAULT_TEXT, seq_len=128, split="val")
    assert len(train) > 9000 and 400 < len(val) < 600


# --- model ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("name, low, high", [
    ("demo", 1.0e6, 3.0e6),
    ("bench33m", 33.4e6, 34.0e6),
    ("bench100m", 99.0e6, 101.5e6),
])
def test_preset_parameter_counts(name: str, low: float, high: float):
    with torch.device("meta"):  # no memory for the large presets
        model = GPT(PRESETS[name])
    assert low <= model.num_parameters() <= high


def test_head_is_tied_and_counted_once():
    model = GPT(preset("demo"))
    assert model.lm_head.weight is model.tok_emb.weight
    unique = {id(p): p.numel() for p in model.parameters()}
    assert model.num_parameters() == sum(unique.values())
    groups = model.param_groups()
    assert sum(len(g["params"]) for g in groups) == len(list(model.parameters()))
    assert groups[1]["weight_decay"] == 0.0 and all(p.dim() < 2 for p in groups[1]["params"])


def test_init_is_deterministic_and_gpt2_scaled():
    cfg = preset("demo")
    torch.manual_seed(0)
    a = GPT(cfg)
    torch.manual_seed(0)
    b = GPT(cfg)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    residual_std = a.blocks[0].mlp.proj.weight.std().item()
    assert residual_std == pytest.approx(0.02 / math.sqrt(2 * cfg.n_layer), rel=0.05)
    assert a.blocks[0].mlp.fc.weight.std().item() == pytest.approx(0.02, rel=0.05)


def _batch(seq_len: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    ds = TextDataset(DEFAULT_TEXT, seq_len=seq_len)
    windows = [ds[i * 37] for i in range(batch_size)]
    return torch.stack([x for x, _ in windows]), torch.stack([y for _, y in windows])


def test_loss_at_init_is_near_uniform():
    torch.manual_seed(0)
    model = GPT(preset("demo"))
    x, y = _batch(128, 4)
    logits = model(x)
    assert logits.shape == (4, 128, 256)
    assert abs(model(x, y).item() - math.log(256)) < 0.3


def test_forward_rejects_sequences_longer_than_the_position_table():
    model = GPT(GPTConfig(seq_len=8, n_layer=1, n_head=2, d_model=16))
    with pytest.raises(ValueError, match="seq_len"):
        model(torch.zeros(1, 9, dtype=torch.long))


def test_generate_appends_greedy_tokens_past_the_context():
    torch.manual_seed(0)
    model = GPT(GPTConfig(seq_len=8, n_layer=1, n_head=2, d_model=16)).eval()
    prompt = torch.tensor([[1, 2, 3]])
    out = model.generate(prompt, 10)  # longer than seq_len: the context is cropped
    assert out.shape == (1, 13) and torch.equal(out[:, :3], prompt)
    assert out[0, 3].item() == model(prompt)[0, -1].argmax().item()


def test_adamw_lowers_the_loss_on_a_fixed_batch():
    torch.manual_seed(0)
    model = GPT(preset("demo", seq_len=64))
    x, y = _batch(64, 8)
    optimizer = torch.optim.AdamW(model.param_groups(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    first = model(x, y).item()
    for _ in range(30):
        loss = model(x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    assert loss.item() < first - 2.0, (first, loss.item())
