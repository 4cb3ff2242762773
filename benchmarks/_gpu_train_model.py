"""What benchmarks/gpu_train.py's parent and children share: the LLaMA shapes, the configs, the flops formula.

Imported by every child, the DeepSpeed ones too, so it imports neither shardwise nor deepspeed (a DeepSpeed
child must not see shardwise's source, and the parent imports torch only where it plans).
"""

from __future__ import annotations

import contextlib
from dataclasses import asdict, dataclass
from typing import Any, Iterator

ADAMW = {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}
CLIP = 1.0  # the same for every config, the floor included (DeepSpeed's default too)
DEEPSPEED_VERSION = "0.19.8"  # the peer: what tools/fetch_device_wheels.sh puts into .whl/peer/

FLOPS_FORMULA = ("model flops per token = 6 * N_matmul + 12 * layers * hidden * seq (PaLM's appendix B: forward + "
                 "backward of every weight matrix, plus QK^T and AV counted without the causal half); N_matmul is "
                 "every parameter but the input embedding, whose lookup multiplies nothing; recomputation under "
                 "activation checkpointing is not counted")

# Dense bf16 tensor-core peaks from NVIDIA's spec sheets (the sparsity-doubled figures halved), by name part.
SPEC_BF16_TFLOPS = (("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.0), ("H200", 989.0), ("A100", 312.0))

CONFIGS = ("floor", "shardwise-0", "deepspeed-0", "shardwise-1", "deepspeed-1", "shardwise-2", "deepspeed-2",
           "shardwise-3", "deepspeed-3", "shardwise-3-offload", "deepspeed-3-offload")
"""Pairs in turn, the offloaded (slowest) last: a run cut short by its budget loses whole
pairs from the end."""


@dataclass(frozen=True)
class Shape:
    """A LLaMA-shaped decoder: untied head, no grouped-query attention, SwiGLU MLP."""

    name: str
    hidden: int
    layers: int
    heads: int
    intermediate: int
    vocab: int = 32000

    @property
    def parameters(self) -> int:
        per_layer = 4 * self.hidden ** 2 + 3 * self.hidden * self.intermediate + 2 * self.hidden  # + 2 RMSNorms
        return self.layers * per_layer + 2 * self.vocab * self.hidden + self.hidden

    @property
    def matmul_parameters(self) -> int:
        return self.parameters - self.vocab * self.hidden

    def flops_per_token(self, seq: int) -> float:
        return 6.0 * self.matmul_parameters + 12.0 * self.layers * self.hidden * seq

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "parameters": self.parameters, "matmul_parameters": self.matmul_parameters}


DEFAULT = Shape("1.3b", 2048, 24, 16, 5504)
TINY = Shape("tiny", 64, 2, 4, 172, vocab=256)

# --largest: widths as LLaMA/OPT use them, then depth at width 4096, so that neighbouring rungs differ by
# ~1.7B parameters near what 128 GiB of host memory holds at ~14-18 bytes per parameter.
LADDER = (DEFAULT, Shape("2.7b", 2560, 32, 20, 6912), Shape("3.5b", 4096, 16, 32, 11008),
          Shape("5.1b", 4096, 24, 32, 11008), Shape("6.7b", 4096, 32, 32, 11008), Shape("8.4b", 4096, 40, 32, 11008),
          Shape("10b", 4096, 48, 32, 11008), Shape("13b", 5120, 40, 40, 13824))
TINY_LADDER = (TINY, Shape("tiny-w256", 256, 4, 4, 688, 256), Shape("tiny-w512", 512, 4, 8, 1376, 256),
               Shape("tiny-w512-8l", 512, 8, 8, 1376, 256), Shape("tiny-w768", 768, 8, 12, 2064, 256))
"""--tiny --largest: 0.1M to 57M parameters, large enough that the model states, not a process's fixed
overhead, decide what fits under the pretend capacities (_gpu_train_largest.TINY_CAPACITY)."""


def shape_from_json(data: dict[str, Any]) -> Shape:
    return Shape(**{k: data[k] for k in ("name", "hidden", "layers", "heads", "intermediate", "vocab")})


def spec_tflops(device_name: str) -> float | None:
    return next((peak for part, peak in SPEC_BF16_TFLOPS if part in device_name), None)


def library_config(name: str, micro: int, bf16: bool, deepspeed_optimizer: str = "torch") -> dict[str, Any] | None:
    """The ds_config of a library config ("shardwise-3-offload", ...); None for the floor.

    Both libraries get the same keys: their defaults everywhere else, which both spell the same. DeepSpeed
    with `deepspeed_optimizer="torch"` runs torch.optim.AdamW(fused=True) (its `torch_adam` key, with `fused`
    passed through to torch), the kernel the floor and shardwise run; "fused" leaves its default FusedAdam
    (a CUDA op built on first use). Offloaded, DeepSpeed always runs DeepSpeedCPUAdam (a C++ op built on
    first use) and shardwise torch's fused CPU Adam."""
    if name == "floor":
        return None
    library, stage, *offload = name.split("-")
    zero: dict[str, Any] = {"stage": int(stage)}
    if offload:
        pinned = {"device": "cpu", "pin_memory": True}
        zero.update(offload_optimizer=dict(pinned), offload_param=dict(pinned))
    params: dict[str, Any] = dict(ADAMW)
    if library == "deepspeed" and not offload and deepspeed_optimizer == "torch":
        params.update(torch_adam=True, fused=True)
    return {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1, "gradient_clipping": CLIP,
            "steps_per_print": 10**9, "wall_clock_breakdown": False, "bf16": {"enabled": bf16},
            "optimizer": {"type": "AdamW", "params": params}, "zero_optimization": zero}


@contextlib.contextmanager
def default_dtype(dtype: Any) -> Iterator[None]:
    """Build parameters in `dtype` (restored after, even on error)."""
    import torch

    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def hf_config(shape: Shape, seq: int) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=shape.hidden, num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                       num_key_value_heads=shape.heads, intermediate_size=shape.intermediate, vocab_size=shape.vocab,
                       max_position_embeddings=max(seq, 128), tie_word_embeddings=False, use_cache=False,
                       attn_implementation="sdpa")


def build_llama(shape: Shape, seq: int, device: Any, dtype: Any) -> Any:
    """transformers' LlamaForCausalLM of `shape`, initialised where it will run (a GPU initialises 1.3B
    parameters in well under a second, the CPU in tens of seconds)."""
    import torch
    from transformers import LlamaForCausalLM

    with torch.device(device), default_dtype(dtype):
        return LlamaForCausalLM(hf_config(shape, seq))
