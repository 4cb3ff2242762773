"""flex_attention's gradients (CUDA only: torch 2.13 has no CPU backward for it) and the block gather's
on CUDA equal the SDPA path's, for the dense and sparse layouts, with padding; skipped without a GPU."""

from __future__ import annotations

import pytest
import torch

from shardwise.sparse_attention import BigBirdSparsityConfig, DenseSparsityConfig, FixedSparsityConfig, SparseSelfAttention

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("config", [
    DenseSparsityConfig(4, block=64, attention="unidirectional"),
    FixedSparsityConfig(4, block=16, num_local_blocks=4, attention="unidirectional"),
    BigBirdSparsityConfig(4, block=64, num_random_blocks=1),
])
def test_flex_and_blocks_forward_and_gradients_equal_sdpa_on_cuda(config):
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(2, 4, 512, 32, device="cuda", generator=g, requires_grad=True) for _ in range(3))
    padding = torch.ones(2, 512, device="cuda")
    padding[1, 300:] = 0
    outs, grads = [], []
    for backend in ("sdpa", "flex", "blocks"):
        module = SparseSelfAttention(config, key_padding_mask_mode="mul", max_seq_length=512, backend=backend).cuda()
        out = module(q, k, v, key_padding_mask=padding)
        outs.append(out)
        grads.append(torch.autograd.grad(out.square().sum(), (q, k, v)))
    for out, grad in zip(outs[1:], grads[1:]):
        torch.testing.assert_close(out, outs[0], atol=2e-5, rtol=2e-5)
        for a, b in zip(grad, grads[0]):
            torch.testing.assert_close(a, b, atol=2e-4, rtol=2e-4)
