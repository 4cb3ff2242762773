"""Tensor-parallel traffic: Megatron's count of activation all-reduces, and gradients still the whole model's.

Column-parallel layers that read the same tensor (LLaMA's q/k/v, gate/up) share one `copy_in`, so a decoder
layer costs 2 all-reduces forward (o_proj, down_proj) and 2 backward (the attention and MLP inputs), not 2 + 5.
"""

from __future__ import annotations

import gc
import weakref

import torch

from shardwise.distributed.topology import Group
from shardwise.tensor_parallel import TensorLink
from shardwise.tensor_parallel.comm import SharedCopyIn
from shardwise.tensor_parallel.shard import take
from tests.harness import run_distributed

LAYERS, VOCAB = 2, 64


def _llama() -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    return transformers.LlamaForCausalLM(cfg)


def _ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (4, 12), generator=torch.Generator().manual_seed(1))


def _rank_run() -> dict:
    import shardwise

    config = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "SGD", "params": {"lr": 1.0}},
              "gradient_clipping": 0.0,  # DeepSpeed's default clips at 1.0: the step must be the gradient
              "tensor_parallel": {"autotp_size": 2}}
    engine, *_ = shardwise.initialize(model=_llama(), config=config)
    engine.comm.stats.reset()
    head_input: list[weakref.ref] = []
    engine.module.lm_head.register_forward_pre_hook(lambda _, args: head_input.append(weakref.ref(args[0])))
    before = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    loss = engine(input_ids=_ids(), labels=_ids()).loss
    engine.backward(loss)
    gc.collect()
    out = {"loss": loss.item(), "all_reduce": engine.comm.stats.calls("all_reduce", "tensor"),
           "all_gather": engine.comm.stats.calls("all_gather", "tensor"),
           "head_input_alive": head_input[0]() is not None, "shards": engine.tensor_shards}
    engine.step()  # SGD at lr 1: each parameter moves by minus its gradient
    return {**out, "grads": {n: before[n] - p.detach() for n, p in engine.module.named_parameters()}}


def test_llama_at_tp2_all_reduces_as_megatron_counts_and_gradients_match_the_whole_model() -> None:
    ranks = run_distributed(_rank_run, 2)
    model = _llama()
    loss = model(input_ids=_ids(), labels=_ids()).loss
    loss.backward()
    for r in ranks:
        # 4 per layer, the vocab-parallel embedding's forward sum, the LM head input's backward sum
        assert r["all_reduce"] == 4 * LAYERS + 2
        assert r["all_gather"] == 1  # the logits
        assert not r["head_input_alive"]  # the shared copy is not held past its block
        assert abs(r["loss"] - loss.item()) <= 1e-5 * abs(loss.item())
        for name, param in model.named_parameters():
            whole = param.grad if name not in r["shards"] else take(param.grad, r["shards"][name])
            torch.testing.assert_close(r["grads"][name], whole, rtol=1e-5, atol=1e-7, msg=name)


def _shared() -> SharedCopyIn:
    return SharedCopyIn(TensorLink(comm=None, group=Group("tensor", None, 2, 0)))  # forward needs no peer


def test_shared_copy_in_reuses_the_copy_only_for_the_same_unmodified_tensor_in_the_same_grad_mode() -> None:
    shared = _shared()
    x = torch.randn(3, 4, requires_grad=True) * 1.0
    first = shared(x)
    assert shared(x) is first
    assert shared(x.clone()) is not first
    y = torch.randn(3, 4) * 1.0
    copied = shared(y)
    y.add_(1.0)  # modified in place: the old copy's gradient would flow to a stale version
    assert shared(y) is not copied
    z = torch.randn(3, 4, requires_grad=True) * 1.0
    with torch.no_grad():
        detached = shared(z)
    assert detached.grad_fn is None
    assert shared(z).grad_fn is not None  # a copy from no_grad has no backward all-reduce: never reused
