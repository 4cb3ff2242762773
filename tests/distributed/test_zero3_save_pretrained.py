"""Hugging Face's `save_pretrained` of a ZeRO-3 model: called on rank 0 alone, outside any gather, it must
refuse (each rank holds only slices, so the file would hold empty placeholders) and write no weights;
the ways that gather first (DeepSpeed-Chat's `save_zero_three_model`, `save_pretrained` inside
`GatheredParameters` entered on every rank, the consolidated state dict) write the whole trained weights.
The same for a PEFT model, whose Trainer save (a consolidated state dict) reads the keys of its
`modules_to_save` parts from their partitioned `state_dict()` and must still work."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.harness import run_distributed

transformers = pytest.importorskip("transformers")

VOCAB, LR = 64, 0.5


def _llama() -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=False))


def _ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (4, 12), generator=torch.Generator().manual_seed(0))


def _oracle() -> dict[str, torch.Tensor]:
    """One SGD step of a plain model on the whole batch: the weights every save below must hold."""
    model = _llama()
    model(input_ids=_ids(), labels=_ids()).loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= LR * p.grad
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _engine(model: torch.nn.Module):
    import deepspeed  # the compatibility package: what HF and DeepSpeed-Chat scripts import

    return deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                                config={"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0,
                                        "optimizer": {"type": "SGD", "params": {"lr": LR}},
                                        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}})[0]


def _saves(out: str) -> tuple[str | None, dict[str, torch.Tensor] | None, str | None, dict[str, torch.Tensor] | None]:
    import deepspeed
    import peft
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    engine = _engine(_llama())
    rank = dist.get_rank()
    ids = _ids()[rank * 2 : rank * 2 + 2]
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    model, root = engine.module, Path(out)

    error = None
    if rank == 0:  # rank 0 alone, outside any gather: a gather here would hang, so it must refuse
        try:
            model.save_pretrained(root / "alone")
        except RuntimeError as e:
            error = str(e)

    whole = {}  # DeepSpeed-Chat's save_zero_three_model: every rank gathers each parameter, rank 0 writes
    for name, p in model.named_parameters():
        fetch = [p] if hasattr(p, "ds_id") and p.ds_status == ZeroParamStatus.NOT_AVAILABLE else []
        with deepspeed.zero.GatheredParameters(fetch, enabled=True):
            value = p.data.cpu()
        if rank == 0:
            whole[name] = value
    if rank == 0:
        torch.save(whole, root / "chat.bin")

    with deepspeed.zero.GatheredParameters(list(model.parameters())):  # entered on every rank
        if rank == 0:
            model.save_pretrained(root / "gathered")
    state = engine._zero3_consolidated_16bit_state_dict()  # every rank; rank 0 receives it
    if rank == 0:
        model.save_pretrained(root / "consolidated", state_dict=state)

    lora = peft.get_peft_model(_llama(), peft.LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["lm_head"]))
    engine = _engine(lora)
    peft_error = None
    if rank == 0:
        try:
            lora.save_pretrained(root / "peft_alone")
        except RuntimeError as e:
            peft_error = str(e)
    peft_state = engine._zero3_consolidated_16bit_state_dict()
    if rank == 0:  # as Trainer._save does at ZeRO-3
        lora.save_pretrained(root / "peft_trainer", state_dict=peft_state)
    dist.barrier()
    return error, state, peft_error, peft_state


def test_save_pretrained_on_one_rank_refuses_and_gathered_saves_hold_the_weights(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    (error, _, peft_error, peft_state), rank1 = run_distributed(_saves, 2, str(tmp_path), timeout=180)
    assert rank1 == (None,) * 4
    assert error is not None, "save_pretrained on rank 0 alone wrote partitioned placeholders without an error"
    assert error.startswith("save_pretrained: 21 parameters of this ZeRO-3 model are partitioned "
                            "(model.embed_tokens.weight, "), error
    for fix in ("GatheredParameters(list(model.parameters()))", "_zero3_consolidated_16bit_state_dict()",
                "save_16bit_model", "save_checkpoint", "to-fp32", "No weights were written"):
        assert fix in error, (fix, error)
    assert peft_error is not None and peft_error.startswith("save_pretrained: 26 parameters of this ZeRO-3 model are "
                                                           "partitioned (base_model.model.model.embed_tokens.weight, ")
    for folder in ("alone", "peft_alone"):
        weights = [p.name for p in (tmp_path / folder).glob("*") if p.suffix in (".safetensors", ".bin")]
        assert weights == [], f"{folder}: a weights file was left: {weights}"
    adapter = load_file(tmp_path / "peft_trainer" / "adapter_model.safetensors")
    head = "base_model.model.lm_head.modules_to_save.default.weight"
    assert len(adapter) == 5 and adapter["base_model.model.lm_head.weight"].shape == (VOCAB, 32)
    torch.testing.assert_close(adapter["base_model.model.lm_head.weight"], peft_state[head])

    oracle = _oracle()
    chat = torch.load(tmp_path / "chat.bin")
    assert set(chat) == set(oracle)
    for folder in ("gathered", "consolidated"):
        assert set(load_file(tmp_path / folder / "model.safetensors")) == set(oracle), folder
        reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / folder).state_dict()
        for name, ref in oracle.items():
            torch.testing.assert_close(reloaded[name], ref, rtol=1e-5, atol=1e-5, msg=lambda m: f"{folder} {name}: {m}")
            torch.testing.assert_close(chat[name], ref, rtol=1e-5, atol=1e-5, msg=lambda m: f"chat.bin {name}: {m}")
