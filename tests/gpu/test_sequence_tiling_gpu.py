"""ALST's memory tricks on CUDA, where what they save is device memory (tests/unit/test_sequence_tiling.py checks
their numbers and counts the saved bytes on the CPU): the checkpointed layers' inputs really leave the GPU for
page-locked host memory and come back, and the tiled MLP and the tiled loss lower the peak of allocated memory.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

import torch
import torch.nn.functional as F

from tests.gpu.device import needs_cuda

pytestmark = needs_cuda


def _peak(step: Callable[[], torch.Tensor]) -> int:
    """Peak allocated bytes over one forward and backward, above what was allocated before."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step().backward()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def test_offloaded_checkpoints_leave_the_gpu_pinned(monkeypatch) -> None:
    from shardwise.sequence_parallel import offload
    from tests.ulysses_models import build, sample

    held: list[tuple[str, str, bool]] = []

    class Recording(offload.HostStash):
        def _pack(self, tensor: torch.Tensor) -> Any:
            device, host = super()._pack(tensor)
            held.append((tensor.device.type, host.device.type, host.is_pinned()))
            return device, host

    def step(offloaded: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor], Any]:
        model = build().cuda().train()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        handle = offload.offload_checkpoints(model) if offloaded else None
        loss = model(**{k: v.cuda() for k, v in sample(3).items()}).loss
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in model.named_parameters()}, handle

    want_loss, want_grads, _ = step(False)
    monkeypatch.setattr(offload, "HostStash", Recording)
    loss, grads, handle = step(True)
    torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, want_grads[name], rtol=1e-6, atol=1e-6)
    assert held == [("cuda", "cpu", True)] * 2, held  # each decoder layer's input, off the GPU, page-locked
    assert handle.stash.host_bytes == 2 * 16 * 32 * 4


def test_tiled_mlp_and_loss_lower_the_gpu_peak() -> None:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    from shardwise.sequence_parallel.tiled import tiled_mlp
    from shardwise.sequence_parallel.tiled_loss import tiled_cross_entropy

    torch.manual_seed(0)
    seq, hidden, intermediate, vocab, tiles = 16384, 256, 1024, 32000, 8
    mlp = LlamaMLP(LlamaConfig(hidden_size=hidden, intermediate_size=intermediate, num_attention_heads=4,
                               num_key_value_heads=4)).cuda()
    x = torch.randn(1, seq, hidden, device="cuda", requires_grad=True)
    plain, tiled = _peak(lambda: mlp(x).sum()), _peak(lambda: tiled_mlp(mlp, x, tiles).sum())
    print(f"MLP peak: untiled {plain} B, {tiles} tiles {tiled} B")
    assert tiled < plain / 2, (plain, tiled)  # four [seq, intermediate] fp32 activations against a tile's

    head = torch.nn.Linear(hidden, vocab, bias=False).cuda()
    labels = torch.randint(0, vocab, (1, seq), device="cuda")
    plain = _peak(lambda: F.cross_entropy(head(x)[0], labels[0]))
    tiled = _peak(lambda: tiled_cross_entropy(x, head, labels, tiles))
    print(f"loss peak: untiled {plain} B, {tiles} tiles {tiled} B")
    assert plain > seq * vocab * 4 and tiled < plain / 3, (plain, tiled)  # the full fp32 logits: 2 GiB
