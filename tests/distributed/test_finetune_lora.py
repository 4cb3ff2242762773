"""LoRA fine-tuning (examples/finetune_llm) under ZeRO-3 at world size 2 against a single-process oracle.

The oracle is `peft` on the same tiny model in one process with plain PyTorch AdamW: each step one
forward over the whole global batch, loss = mean response-token cross-entropy. The distributed run is
the example script's own pieces (`build_model`: zero.Init + streamed safetensors + peft; `train_step`;
`train` with checkpoints; the adapter / merged exports), each rank feeding its slice of the batch.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.harness import run_distributed
from tests.parity import full_state_dict

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from examples.finetune_llm import data as sft  # noqa: E402
from examples.finetune_llm import model_io, train  # noqa: E402

WORLD, MICRO, STEPS, SEED = 2, 2, 10, 7
CLIP = 1.0  # DeepSpeed's default global-norm clip, written out on both sides
# SGD runs beside AdamW ones: Adam normalises away a wrongly scaled gradient, SGD does not.
OPTIMIZERS = {"adamw": ("AdamW", {"lr": 1e-2}), "sgd": ("SGD", {"lr": 0.2, "momentum": 0.9})}
BUNDLED = REPO_ROOT / "examples" / "finetune_llm"
TARGETS = {"llama": "q_proj,v_proj,down_proj", "opt": "q_proj,v_proj,out_proj,fc1", "qwen2": "q_proj,k_proj,up_proj"}


def _tiny_config(kind: str, vocab: int, pad: int):
    common = dict(vocab_size=vocab, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, pad_token_id=pad)
    if kind == "llama":
        return transformers.LlamaConfig(intermediate_size=64, num_key_value_heads=2, max_position_embeddings=64, **common)
    if kind == "qwen2":
        return transformers.Qwen2Config(intermediate_size=64, num_key_value_heads=2, max_position_embeddings=64, **common)
    # OPT: tied input/output embeddings, learned positions, LayerNorm, biases everywhere.
    return transformers.OPTConfig(ffn_dim=64, max_position_embeddings=64, word_embed_proj_dim=32, dropout=0.0,
                                  attention_dropout=0.0, **common)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """A saved tiny model of each kind, with the bundled tokenizer (what from_pretrained would find)."""
    root = tmp_path_factory.mktemp("tiny_models")
    tokenizer = transformers.AutoTokenizer.from_pretrained(BUNDLED / "tiny_llama")
    dirs = {}
    for kind in TARGETS:
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(_tiny_config(kind, len(tokenizer), tokenizer.pad_token_id))
        dirs[kind] = root / kind
        model.save_pretrained(dirs[kind])
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(BUNDLED / "tiny_llama" / name, dirs[kind] / name)
    return dirs


def _examples(model_dir: Path, count: int) -> list[sft.Example]:
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    pairs = sft.load_pairs(BUNDLED / "data" / "pairs.jsonl")[:count]
    return sft.encode_all(tokenizer, pairs, "chat", 48)


def _global_batch(examples, step: int) -> list[sft.Example]:
    n = WORLD * MICRO
    return examples[(step * n) % len(examples):][:n]


def _args(model_dir: Path, kind: str, tmp: Path, **overrides) -> argparse.Namespace:
    argv = ["--model", str(model_dir), "--lora_r", "4", "--lora_alpha", "8", "--lora_dropout", "0.0",
            "--lora_target_modules", TARGETS[kind], "--seed", str(SEED), "--save_dir", str(tmp / "ckpt"),
            "--output_dir", str(tmp / "out"), "--eval_interval", "0", "--template", "chat"]
    args = train.parse_args(argv)
    for key, value in overrides.items():
        setattr(args, key, value)
    return args


def _config(optimizer: str = "adamw", **extra) -> dict:
    name, params = OPTIMIZERS[optimizer]
    return {"train_micro_batch_size_per_gpu": MICRO, "optimizer": {"type": name, "params": params},
            "gradient_clipping": CLIP, "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}, **extra}


def _oracle(model_dir: Path, kind: str, steps: int, optimizer: str = "adamw", full: bool = False,
            reset_lora: bool = False):
    torch.manual_seed(SEED)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, **model_io.fp32())
    if not full:
        model = model_io.add_lora(model, 4, 8, 0.0, TARGETS[kind].split(","))
        if reset_lora:  # what model_io.reset_lora does on rank 0 after LoRA was built inside zero.Init
            torch.manual_seed(SEED + 1)
            for _, layer in model_io.lora_layers(model):
                layer.reset_lora_parameters("default", True)
    name, hyper = OPTIMIZERS[optimizer]
    if name == "AdamW":  # the config's AdamW has DeepSpeed's default weight decay, 0 (torch's default is 0.01)
        hyper = {"weight_decay": 0.0, **hyper}
    optimizer = getattr(torch.optim, name)([p for p in model.parameters() if p.requires_grad], **hyper)
    collate = sft.PadCollator(0)
    examples, losses = _examples(model_dir, 64), []
    for step in range(steps):
        batch = collate(_global_batch(examples, step))
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        loss = sft.token_loss_sum(logits, batch["labels"]) / sft.target_count(batch["labels"])
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], CLIP)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    # Only the trained parameters: the frozen ones are checked against the saved files instead.
    return losses, {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def _rank_batches(examples, step: int) -> list[dict]:
    rank = dist.get_rank()
    mine = _global_batch(examples, step)[rank * MICRO:(rank + 1) * MICRO]
    return [sft.PadCollator(0)(mine)]


def _lora_run(model_dir: Path, kind: str, tmp: Path, optimizer: str, zero: dict | None):
    """Train STEPS steps with the script's pieces; report what the parity test checks."""
    args = _args(model_dir, kind, tmp)
    model = train.build_model(args, zero_stage=3)
    base_sizes = [p.numel() for n, p in model.named_parameters() if not p.requires_grad]
    lora_numel = {n: p.numel() for n, p in model.named_parameters() if p.requires_grad}
    engine, *_ = shardwise_initialize(model, optimizer, **({"zero_optimization": zero} if zero else {}))
    examples = _examples(model_dir, 64)
    probe = _rank_batches(examples, 0)
    before, _ = train.evaluate(engine, probe)
    losses = [train.train_step(engine, _rank_batches(examples, s))[0] for s in range(STEPS)]
    after, _ = train.evaluate(engine, probe)
    states = list(engine.optimizer.state.values())
    frozen_grads = [p.grad for p in engine.module.parameters() if not p.requires_grad]
    return {
        "losses": losses, "probe": (before, after), "base_sizes": base_sizes, "lora_numel": lora_numel,
        "params": full_state_dict(engine),
        "state_entries": len(states),
        "state_numel": {key: sum(s[key].numel() for s in states) for key in states[0] if key != "step"},
        "frozen_grads_none": all(g is None for g in frozen_grads),
    }


def shardwise_initialize(model: torch.nn.Module, optimizer: str = "adamw", **extra):
    import shardwise

    return shardwise.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                                config=_config(optimizer, **extra))


def _peft_name(name: str) -> str:
    return f"base_model.model.{name}"


@pytest.mark.parametrize("kind,optimizer,offload", [("llama", "adamw", "none"), ("llama", "sgd", "none"),
                                                    ("opt", "sgd", "none"), ("llama", "adamw", "cpu-optimizer-and-params")])
def test_lora_zero3_matches_single_process_peft(kind, optimizer, offload, model_dirs, tmp_path):
    from tests.distributed.test_finetune_full import zero_section

    zero = zero_section(offload, tmp_path) if offload != "none" else None
    ref_losses, ref_params = _oracle(model_dirs[kind], kind, STEPS, optimizer)
    out = run_distributed(_lora_run, WORLD, model_dirs[kind], kind, tmp_path, optimizer, zero, timeout=240)[0]
    # Relative 1e-5: the ranks' forwards see half the batch each (different padding widths and matmul shapes).
    for step, (a, b) in enumerate(zip(out["losses"], ref_losses)):
        assert abs(a - b) <= 1e-5 * b, (step, a, b)
    assert out["probe"][1] < out["probe"][0] - 0.05, out["probe"]  # the loss on a fixed batch went down
    trained = ref_params
    # SGD and AdamW alike: the same fp32 arithmetic up to the order of the gradient reduction (measured: at most
    # 1.4e-7 apart after 10 AdamW steps). Adam could amplify that order noise only where a gradient element is
    # ~eps (1e-8) in size, and then by at most lr per step; atol 1e-6 would show a real difference such as a
    # wrong weight decay (torch's AdamW default 0.01 instead of DeepSpeed's 0 moves these weights by ~2e-4).
    for name, ref in trained.items():
        torch.testing.assert_close(out["params"][name], ref, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
    # Frozen base weights: bit for bit what was loaded (the oracle never changes them either).
    original = transformers.AutoModelForCausalLM.from_pretrained(model_dirs[kind]).state_dict()
    for name, value in original.items():
        key = _peft_name(name)
        if key in out["params"]:
            assert torch.equal(out["params"][key], value), name
    # Loaded straight into partitions: no rank ever held a whole base parameter.
    assert all(size == 0 for size in out["base_sizes"])
    # Optimizer state only for LoRA, each rank 1/N of it (each LoRA matrix padded to a multiple of N).
    assert set(trained) == set(out["lora_numel"])
    assert out["state_entries"] == len(trained)
    expected = sum(-(-n // WORLD) for n in out["lora_numel"].values())
    kinds = {"adamw": {"exp_avg", "exp_avg_sq"}, "sgd": {"momentum_buffer"}}[optimizer]
    assert out["state_numel"] == {key: expected for key in kinds}
    assert out["frozen_grads_none"]


def _resume_run(model_dir: Path, kind: str, tmp: Path):
    """6 steps saving at 3, then a fresh engine resumes at 3; both through the script's `train` loop."""
    import shardwise

    examples = _examples(model_dir, 40)
    eval_batches = [sft.PadCollator(0)(examples[:4])]

    def run(resume: bool):
        args = _args(model_dir, kind, tmp, steps=6, save_interval=3, lora_dropout=0.1)
        model = train.build_model(args, zero_stage=3)
        engine, _, loader, _ = shardwise.initialize(
            model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
            training_data=sft.SFTDataset(examples), collate_fn=sft.PadCollator(0), config=_config(seed=SEED))
        if resume:
            engine.load_checkpoint(args.save_dir, tag="global_step3")
        return train.train(args, engine, loader, eval_batches), engine

    first, engine = run(False)
    first_params = model_io.trainable_state_dict(engine.module)
    resumed, engine = run(True)
    second_params = model_io.trainable_state_dict(engine.module)
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    model_io.save_adapter(engine.module, tmp / "adapter", base_model=str(model_dir), tokenizer=tokenizer)
    model_io.save_merged(engine.module, tmp / "merged", tokenizer=tokenizer)
    prompts = [sft.load_pairs(BUNDLED / "data" / "pairs.jsonl")[i]["prompt"] for i in (1, 2)]
    engine.module.config.use_cache = True
    tokens = model_io.greedy_completions(engine.module, tokenizer, prompts, "chat", 8)
    probe = torch.tensor([sft.prompt_ids(tokenizer, prompts[0], "chat")])
    engine.eval()
    with torch.no_grad():
        logits = engine.module(input_ids=probe).logits
    return {"first": first, "resumed": resumed, "first_params": first_params, "second_params": second_params,
            "tokens": tokens, "prompts": prompts, "logits": logits}


def test_resume_export_and_generate(model_dirs, tmp_path):
    kind = "llama"
    out = run_distributed(_resume_run, WORLD, model_dirs[kind], kind, tmp_path, timeout=240)[0]
    # Resumed at step 3 (weights, Adam state, scheduler, RNG for LoRA dropout, data position): identical.
    assert out["resumed"] == out["first"][3:], (out["first"], out["resumed"])
    for name, value in out["first_params"].items():
        assert torch.equal(out["second_params"][name], value), name

    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "adapter")
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dirs[kind])
    with torch.no_grad():
        base_logits = base(input_ids=torch.tensor([sft.prompt_ids(tokenizer, out["prompts"][0], "chat")])).logits
    adapted = peft.PeftModel.from_pretrained(base, tmp_path / "adapter")
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    for model in (adapted, merged):
        assert model_io.greedy_completions(model, tokenizer, out["prompts"], "chat", 8) == out["tokens"]
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([sft.prompt_ids(tokenizer, out["prompts"][0], "chat")])).logits
        torch.testing.assert_close(logits, out["logits"], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(base_logits, out["logits"], atol=1e-4)  # the adapter does change the model


def _inside_init_run(model_dir: Path, kind: str, tmp: Path):
    """LoRA modules created inside zero.Init (then re-initialised by reset_lora), with HF gradient
    checkpointing on: the recomputed forward must gather the partitioned parameters again."""
    import shardwise

    args = _args(model_dir, kind, tmp)
    base = model_io.load_model(model_dir, 3)
    with shardwise.zero.Init():
        model = model_io.add_lora(base, 4, 8, 0.0, TARGETS[kind].split(","))
    torch.manual_seed(SEED + 1)
    model_io.reset_lora(model)
    train.enable_gradient_checkpointing(model)
    calls = []
    model.get_base_model().model.layers[0].mlp.register_forward_pre_hook(lambda *_: calls.append(1))
    engine, *_ = shardwise_initialize(model, "sgd")
    examples = _examples(model_dir, 64)
    losses = [train.train_step(engine, _rank_batches(examples, s))[0] for s in range(4)]
    return losses, model_io.trainable_state_dict(engine.module), len(calls), args.seed


def test_lora_built_inside_zero_init_with_gradient_checkpointing(model_dirs, tmp_path):
    kind = "qwen2"
    ref_losses, ref_params = _oracle(model_dirs[kind], kind, 4, "sgd", reset_lora=True)
    losses, params, calls, _ = run_distributed(_inside_init_run, WORLD, model_dirs[kind], kind, tmp_path, timeout=240)[0]
    assert calls == 2 * 4  # each step: the forward, and its recomputation inside backward
    for a, b in zip(losses, ref_losses):
        assert abs(a - b) <= 1e-5 * b, (losses, ref_losses)
    for name, value in params.items():
        torch.testing.assert_close(value, ref_params[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def _non_reentrant_run(model_dir: Path, kind: str, tmp: Path, steps: int):
    model = train.build_model(_args(model_dir, kind, tmp), zero_stage=3)
    model.activation_checkpointing_enable({"use_reentrant": False, "determinism_check": "none"})
    calls = []
    model.get_base_model().model.layers[0].mlp.register_forward_pre_hook(lambda *_: calls.append(1))
    engine, *_ = shardwise_initialize(model, "sgd")
    examples = _examples(model_dir, 64)
    losses = [train.train_step(engine, _rank_batches(examples, s))[0] for s in range(steps)]
    return losses, model_io.trainable_state_dict(engine.module), len(calls)


def test_non_reentrant_checkpointing_under_zero3(model_dirs, tmp_path):
    # The forward that non-reentrant checkpointing recomputes inside backward must not release the
    # parameters its saved tensors view (ZeRO-3 holds them until their gradients are complete), and the
    # gradients it produces are the oracle's: losses and trained LoRA weights match the single process.
    steps = 3
    ref_losses, ref_params = _oracle(model_dirs["llama"], "llama", steps, "sgd")
    losses, params, calls = run_distributed(_non_reentrant_run, WORLD, model_dirs["llama"], "llama", tmp_path, steps,
                                            timeout=180)[0]
    assert calls == 2 * steps  # each step: the forward, and its recomputation inside backward
    for a, b in zip(losses, ref_losses):
        assert abs(a - b) <= 1e-5 * b, (losses, ref_losses)
    assert set(params) == set(ref_params)
    for name, value in params.items():
        torch.testing.assert_close(value, ref_params[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
