"""ZeRO-3 as scripts written for DeepSpeed use it: the `ds_*` parameter attributes, DeepSpeed-Chat's save helper,
the consolidated 16-bit state dict Hugging Face and accelerate ask for, parameters read outside their module's
forward (nn.MultiheadAttention), leaf modules, and transformers 5's own ZeRO-3 build path; each against an
unsharded torch oracle."""

from __future__ import annotations

import copy
import io
import logging
import pickle

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import shardwise
from shardwise.zero import ZeroParamStatus
from tests.harness import run_distributed

transformers = pytest.importorskip("transformers")
from transformers import initialization as hf_init  # noqa: E402

VOCAB, STEPS, LR = 64, 4, 0.5


def _llama_config(tie: bool, dtype: torch.dtype = torch.float32):
    return transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                    tie_word_embeddings=tie, pad_token_id=3, dtype=dtype)


def _llama(tie: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(_llama_config(tie))


def _config(**zero):
    return {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": LR}},
            "gradient_clipping": 0.0,
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, **zero}}


def _ids(step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (4, 12), generator=torch.Generator().manual_seed(step))


def _train_llama(engine) -> list[float]:
    rank, losses = dist.get_rank(), []
    for step in range(STEPS):
        ids = _ids(step)[rank * 2 : rank * 2 + 2]
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / 2)
    return losses


def _oracle_llama(model: torch.nn.Module) -> tuple[list[float], dict[str, torch.Tensor]]:
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        loss = model(input_ids=_ids(step), labels=_ids(step)).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _assert_same_run(run, oracle):
    losses, state = run
    ref_losses, ref_state = oracle
    for a, b in zip(losses, ref_losses):
        assert abs(a - b) <= 1e-5 * b, (losses, ref_losses)
    assert list(state) == list(ref_state)
    for name, ref in ref_state.items():
        torch.testing.assert_close(state[name], ref, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")


# --- 1. ds_* attributes -----------------------------------------------------------------------------------
def _attributes():
    out = {}
    with shardwise.zero.Init():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.LayerNorm(7), torch.nn.Linear(7, 3))
    weight = model[0].weight
    out["init"] = (weight.ds_id, weight.ds_status, weight.ds_shape, weight.ds_numel, weight.ds_tensor.numel(),
                   tuple(weight.shape))
    out["ids_unique"] = len({p.ds_id for p in model.parameters()}) == 6
    with shardwise.zero.GatheredParameters([weight]):
        out["init_gathered"] = weight.ds_status
        whole = weight.detach().clone()
    out["init_after"] = weight.ds_status
    pieces = [torch.empty_like(weight.ds_tensor) for _ in range(2)]
    dist.all_gather(pieces, weight.ds_tensor)
    out["init_partition_ok"] = torch.equal(torch.cat(pieces)[:35].view(7, 5), whole)
    out["init_id_kept"] = weight.ds_id

    engine, *_ = shardwise.initialize(model=model, config=_config(stage3_param_persistence_threshold=15))
    norm, unit = model[1].weight, shardwise.zero.stage3.registry.UNIT_OF[weight]
    out["engine"] = (weight.ds_id, weight.ds_status, norm.ds_status, weight.ds_shape, weight.ds_numel)
    statuses = []
    model[2].register_forward_pre_hook(lambda m, a: statuses.append(model[2].weight.ds_status))
    engine(torch.randn(2, 5)).sum()
    unit.gather_async()
    statuses.append(weight.ds_status)
    unit.wait()
    statuses.append(weight.ds_status)
    unit.release()
    statuses.append(weight.ds_status)
    out["transitions"] = list(statuses)
    with shardwise.zero.GatheredParameters([weight]):
        whole = weight.detach().clone()
    out["engine_partition"] = (weight.ds_tensor.clone(), whole)

    # Copies are plain parameters; the attributes survive model.to() and do not get in the way of pickling.
    copied = pickle.loads(pickle.dumps(weight))
    buffer = io.BytesIO()
    torch.save({"w": weight}, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer)  # weights_only=True, torch's default
    deep = copy.deepcopy(weight)
    out["copies"] = [(type(t) is torch.nn.Parameter, hasattr(t, "ds_id")) for t in (copied, loaded["w"], deep)]
    engine.module.to(torch.float32)
    out["after_to"] = (weight.ds_id, weight.ds_status, hasattr(torch.nn.Parameter(torch.zeros(1)), "ds_id"))
    engine(torch.randn(2, 5)).sum()  # still runs
    return out


def test_partitioned_parameters_carry_deepspeed_attributes():
    results = run_distributed(_attributes, 2)
    for rank, out in enumerate(results):
        ds_id, status, shape, numel, local, data_shape = out["init"]
        assert isinstance(ds_id, int) and out["ids_unique"]
        assert (status, shape, numel, local, data_shape) == (ZeroParamStatus.NOT_AVAILABLE, (7, 5), 35, 18, (0,))
        assert out["init_gathered"] is ZeroParamStatus.AVAILABLE and out["init_after"] is ZeroParamStatus.NOT_AVAILABLE
        assert out["init_partition_ok"]  # ds_tensor is this rank's ceil(35 / 2) elements, zero-padded
        # The engine keeps zero.Init's ds_id; the persistent LayerNorm stays whole.
        assert out["engine"] == (out["init_id_kept"], ZeroParamStatus.NOT_AVAILABLE, ZeroParamStatus.AVAILABLE,
                                 (7, 5), 35)
        assert out["transitions"] == [ZeroParamStatus.AVAILABLE, ZeroParamStatus.INFLIGHT,
                                      ZeroParamStatus.AVAILABLE, ZeroParamStatus.NOT_AVAILABLE]
        assert out["copies"] == [(True, False)] * 3
        assert out["after_to"] == (out["init_id_kept"], ZeroParamStatus.NOT_AVAILABLE, False)
    # Each rank's ds_tensor is its piece of the flattened weight, in rank order.
    pieces = [out["engine_partition"][0] for out in results]
    torch.testing.assert_close(torch.cat(pieces), results[0]["engine_partition"][1].reshape(-1))


# --- 2-3. saving the DeepSpeed way; the consolidated state dict -----------------------------------------------
def _deepspeed_chat_save(tie: bool, path: str):
    """DeepSpeed-Chat's save: `save_hf_format` on rank 0 alone (a local state_dict()), then `save_zero_three_model`
    on every rank, reading parameters through ds_id / ds_status / GatheredParameters."""
    engine, *_ = shardwise.initialize(model=_llama(tie), config=_config(stage3_gather_16bit_weights_on_model_save=True))
    losses = _train_llama(engine)
    rank, warnings = dist.get_rank(), []
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("shardwise.zero.stage3.state_dict").addHandler(handler)
    if rank == 0:  # save_hf_format: rank 0 only; must neither hang nor pass the placeholders silently
        torch.save(engine.module.state_dict(), path)
    out = {}
    for k, v in engine.module.named_parameters():
        if hasattr(v, "ds_id"):
            fetch = [p for p in [v] if hasattr(p, "ds_id") and p.ds_status == ZeroParamStatus.NOT_AVAILABLE]
            with shardwise.zero.GatheredParameters(fetch, enabled=True):
                v_p = v.data.cpu()  # on CPU the gathered tensor itself: it must outlive the block
        else:
            v_p = v.cpu()
        if rank == 0:
            out[k] = v_p
    if rank == 0:
        torch.save(out, path)
    consolidated = engine._zero3_consolidated_16bit_state_dict()
    flag = engine.zero_gather_16bit_weights_on_model_save()
    saved16 = engine.save_16bit_model(path + ".16bit", "model.safetensors")
    with shardwise.zero.GatheredParameters(list(engine.module.parameters())):
        inside = engine.module.state_dict()  # whole, and still valid after the block
    return losses, consolidated, warnings, flag, saved16, inside


@pytest.mark.parametrize("tie", [True, False])
def test_deepspeed_chat_save_and_consolidated_state_dict(tie, tmp_path):
    from safetensors.torch import load_file

    results = run_distributed(_deepspeed_chat_save, 2, tie, str(tmp_path / "pytorch_model.bin"), timeout=180)
    losses, consolidated, warnings, flag, saved16, inside = results[0]
    oracle = _oracle_llama(_llama(tie))
    _assert_same_run((losses, consolidated), oracle)  # the keys of state_dict(), DeepSpeed's 21 for both ties
    assert flag is True
    assert results[1][1] is None  # DeepSpeed returns the consolidated dict on rank 0 and None elsewhere
    if tie:  # one tensor under both names, as DeepSpeed's
        assert consolidated["lm_head.weight"] is consolidated["model.embed_tokens.weight"]
    assert len(warnings) == 1 and "model.embed_tokens.weight" in warnings[0] and "placeholders" in warnings[0]
    saved = torch.load(tmp_path / "pytorch_model.bin")
    names = [n for n, _ in _llama(tie).named_parameters()]
    assert list(saved) == names  # tied: embed_tokens only, as named_parameters() yields it
    for name in names:
        torch.testing.assert_close(saved[name], oracle[1][name], rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")
    file16 = load_file(saved16)
    assert set(file16) == set(oracle[1])
    for name, ref in oracle[1].items():
        torch.testing.assert_close(file16[name], ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(inside[name], ref, rtol=1e-5, atol=1e-5)


def _frozen_and_bf16():
    model = _llama(False)
    model.model.embed_tokens.weight.requires_grad_(False)
    engine, *_ = shardwise.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                                      config={**_config(), "bf16": {"enabled": True}})
    state = engine._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters=True)
    placeholder_error = None
    if dist.get_rank() == 0:
        from shardwise.checkpoint.errors import CheckpointError
        from shardwise.checkpoint.weights import refuse_placeholders

        try:
            refuse_placeholders(engine.module.state_dict(), engine.module)
        except CheckpointError as e:
            placeholder_error = str(e)
    return state, engine.zero_gather_16bit_weights_on_model_save(), placeholder_error


def test_consolidated_state_dict_excludes_frozen_in_16_bits_and_saves_refuse_placeholders():
    state, flag, error = run_distributed(_frozen_and_bf16, 2)[0]
    assert "model.embed_tokens.weight" not in state and "lm_head.weight" in state
    assert {v.dtype for v in state.values() if v.is_floating_point()} == {torch.bfloat16}
    assert flag is False
    assert error.startswith("save: 21 tensors are ZeRO-3 placeholders of partitioned parameters (model.embed_tokens")


# --- 4. parameters read outside their module's forward; leaf modules ----------------------------------------
class Attention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(16, 8)
        self.attn = torch.nn.MultiheadAttention(8, 2, batch_first=True)  # reads out_proj.weight without calling it
        self.head = torch.nn.Linear(8, 16)

    def forward(self, x, y):
        h = self.embed(x)
        h, _ = self.attn(h, h, h)
        return F.cross_entropy(self.head(h).reshape(-1, 16), y.reshape(-1))


def _attention_batch(step: int):
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, 16, (4, 5), generator=g), torch.randint(0, 16, (4, 5), generator=g)


GRANULARITY = 112
"""Attention's elements per layer (560 over embed, out_proj, attn, head and itself): the smallest in the model, so
stage3_module_granularity_threshold at this value makes the whole model one leaf (DeepSpeed's rule, root first)."""


def _attention_run(leaf: bool | str):
    torch.manual_seed(0)
    model = Attention()
    if leaf is True:
        marked = shardwise.zero.set_z3_leaf_modules(model, [torch.nn.MultiheadAttention])
        assert marked == [model.attn] == shardwise.zero.get_z3_leaf_modules(model)
        assert shardwise.zero.z3_leaf_module(model.attn) and not shardwise.zero.z3_leaf_module(model.head)
    zero = {"stage3_module_granularity_threshold": GRANULARITY} if leaf == "granularity" else {}
    engine, *_ = shardwise.initialize(model=model, config=_config(**zero))
    rank, losses = dist.get_rank(), []
    for step in range(STEPS):
        x, y = _attention_batch(step)
        loss = engine(x[rank * 2 : rank * 2 + 2], y[rank * 2 : rank * 2 + 2])
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / 2)
    hooked = {type(m).__name__: len(units) for m, units in engine.strategy.hooks.units_of.items()}
    return losses, engine._zero3_consolidated_16bit_state_dict(), hooked


@pytest.mark.parametrize("leaf", [False, True, "granularity"])
def test_multihead_attention_trains_like_the_oracle(leaf):
    # DeepSpeed 0.19.8 trains this model at stage 3 without leaf modules (it gathers a parameter when a forward
    # reads it); shardwise did not: "mat2 must be a matrix, got 1-D tensor".
    losses, state, hooked = run_distributed(_attention_run, 2, leaf)[0]
    torch.manual_seed(0)
    model = Attention()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    ref_losses = []
    for step in range(STEPS):
        loss = model(*_attention_batch(step))
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_losses.append(loss.item())
    _assert_same_run((losses, state), (ref_losses, {k: v.detach() for k, v in model.state_dict().items()}))
    if leaf == "granularity":  # the root is the one leaf: its hooks gather every unit, and nothing else is hooked
        assert hooked == {"Attention": 4}
        return
    # Either way the attention's forward and backward gather out_proj's unit with its own; as a leaf, out_proj
    # has no hooks of its own.
    assert hooked["MultiheadAttention"] == 2
    assert ("NonDynamicallyQuantizableLinear" in hooked) is not leaf


class ReadsThroughAList(torch.nn.Module):
    def __init__(self, bug: str):
        super().__init__()
        self.embed = torch.nn.Embedding(16, 8)
        self.proj = torch.nn.Linear(8, 8)
        self.kept = [self.embed.weight]  # a plain list: not a module attribute read, so not seen
        self.bug = bug

    def forward(self, x):
        h = self.proj(self.embed(x))
        if self.bug == "shape":
            return h.view(-1, 7)  # an ordinary bug, nothing to do with ZeRO-3
        (weight,) = self.kept
        return F.linear(h, weight)


def _read_error(bug: str):
    torch.manual_seed(0)
    engine, *_ = shardwise.initialize(model=ReadsThroughAList(bug), config=_config())
    with pytest.raises(RuntimeError) as caught:
        engine(torch.randint(0, 16, (2, 5)))
    return str(caught.value)


def test_a_parameter_read_while_partitioned_is_explained_and_only_then():
    message = run_distributed(_read_error, 2, "partitioned")[0]
    assert "ZeRO-3: the forward of '<root>' used embed.weight while partitioned" in message
    assert "register_external_parameter(reading_module, parameter)" in message
    # A shape error that no partitioned parameter caused gets no ZeRO-3 story (it used to, from the word "shape").
    message = run_distributed(_read_error, 2, "shape")[0]
    assert "shape '[-1, 7]' is invalid" in message and "ZeRO-3" not in message


def test_leaf_module_classes_are_checked():
    model = Attention()
    with pytest.raises(ValueError, match=r"leaf_module_classes: no module of \[<class 'torch.nn.modules.rnn.GRU'>\]"):
        shardwise.zero.set_z3_leaf_modules(model, [torch.nn.GRU])
    assert shardwise.zero.set_z3_leaf_modules(model, ["MultiheadAttention"]) == [model.attn]
    assert shardwise.zero.unset_z3_leaf_modules(model, ["torch.nn.modules.activation.MultiheadAttention"]) == [model.attn]
    assert shardwise.zero.get_z3_leaf_modules(model) == []


# --- 5. transformers 5's own ZeRO-3 path, through shardwise.zero ----------------------------------------------
def _transformers_zero3_path(tie: bool, dtype: torch.dtype):
    """What `from_pretrained` / `_from_config` do under an HfDeepSpeedConfig with stage 3 (modeling_utils and
    integrations/deepspeed.py in transformers 5.24), with shardwise.zero in place of deepspeed.zero."""
    from transformers.modeling_utils import PreTrainedModel, local_torch_dtype

    rank = dist.get_rank() if dist.is_initialized() else 0
    torch.manual_seed(0)
    with local_torch_dtype(dtype), hf_init.no_init_weights(), shardwise.zero.Init():
        model = transformers.LlamaForCausalLM(_llama_config(tie, dtype))
    dtypes = {p.dtype for p in model.parameters()}

    def init_zero3(module, fn):  # initialize_weights_zero3: one module at a time, rank 0 initialises
        for child in module.children():
            init_zero3(child, child._initialize_weights if isinstance(child, PreTrainedModel) else fn)
        params = list(module.parameters(recurse=False))
        params += [p for c in module.children() if not isinstance(c, PreTrainedModel) for p in c.parameters(recurse=False)]
        with shardwise.zero.GatheredParameters(params, modifier_rank=0):
            if rank == 0:
                fn(module, False)

    with torch.no_grad(), hf_init.guard_torch_init_functions():
        init_zero3(model, model._initialize_weights)
    model.tie_weights()
    with shardwise.zero.GatheredParameters(list(model.parameters())):
        initialised = {k: v.detach().clone() for k, v in model.state_dict().items()}
    dtypes |= {p.dtype for p in model.parameters()}

    # _load_state_dict_into_zero3_model: rank 0 holds the values, the other ranks meta tensors of the same shapes
    torch.manual_seed(1)
    with local_torch_dtype(dtype):
        checkpoint = transformers.LlamaForCausalLM(_llama_config(tie, dtype)).state_dict()
    if rank != 0:
        checkpoint = {k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in checkpoint.items()}

    def load(module, prefix=""):
        named = dict(module.named_parameters(prefix=prefix[:-1], recurse=False))
        params = [p for k, p in named.items() if k in checkpoint]
        with shardwise.zero.GatheredParameters(params, modifier_rank=0):
            if rank == 0 and params:
                module._load_from_state_dict(checkpoint, prefix, {}, True, [], [], [])
        for name, child in module._modules.items():
            load(child, prefix + name + ".")

    load(model)
    dtypes |= {p.dtype for p in model.parameters()}
    with shardwise.zero.GatheredParameters(list(model.parameters())):
        loaded = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if dtype != torch.float32:
        return initialised, loaded, dtypes, None
    engine, *_ = shardwise.initialize(model=model, config=_config())
    return initialised, loaded, dtypes, (_train_llama(engine), engine._zero3_consolidated_16bit_state_dict())


@pytest.mark.parametrize("tie,dtype", [(True, torch.float32), (False, torch.float32), (True, torch.bfloat16)])
def test_transformers_zero3_build_path(tie, dtype):
    from transformers.modeling_utils import local_torch_dtype

    results = run_distributed(_transformers_zero3_path, 2, tie, dtype, timeout=180)
    # The oracle: the same model built whole, initialised by transformers' own initialize_weights.
    torch.manual_seed(0)
    with local_torch_dtype(dtype), hf_init.no_init_weights():
        plain = transformers.LlamaForCausalLM(_llama_config(tie, dtype))
    plain.initialize_weights()
    plain.tie_weights()
    torch.manual_seed(1)
    with local_torch_dtype(dtype):
        checkpoint = transformers.LlamaForCausalLM(_llama_config(tie, dtype)).state_dict()
    for initialised, loaded, dtypes, _ in results:
        assert dtypes == {dtype}  # gathering never changes a parameter's dtype
        assert list(initialised) == list(plain.state_dict())
        for name, ref in plain.state_dict().items():
            assert torch.equal(initialised[name], ref), name
            assert torch.equal(loaded[name], checkpoint[name]), name
    if dtype == torch.float32:
        plain.load_state_dict(checkpoint)
        _assert_same_run(results[0][3], _oracle_llama(plain))


def _drop_unmodified():
    with shardwise.zero.Init():
        torch.manual_seed(0)
        layer = torch.nn.Linear(4, 4)
    with shardwise.zero.GatheredParameters([layer.weight]):
        before = layer.weight.detach().clone()
        if dist.get_rank() == 1:
            layer.weight.data.zero_()  # no modifier_rank: dropped, as in DeepSpeed
    with shardwise.zero.GatheredParameters([layer.weight]):
        return torch.equal(layer.weight, before)


def test_gathered_parameters_without_modifier_rank_drop_changes():
    assert run_distributed(_drop_unmodified, 2) == [True, True]
