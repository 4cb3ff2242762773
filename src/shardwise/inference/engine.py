"""The inference engine `init_inference` returns: the (split, loaded, maybe quantized) model behind DeepSpeed's
`InferenceEngine` surface: `engine(...)` is the model's forward, `engine.generate(...)` Hugging Face's
`generate` with a static key/value cache, `engine.module` the model itself.

Every rank of a tensor-parallel group must make the same calls with the same inputs (each computes its share of
every layer); the engine checks that the inputs agree, and before each generation it gives the group rank 0's
random state, so every rank draws the same tokens.
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any

import torch

from ..config.inference import InferenceConfig
from ..tensor_parallel import TensorLink
from .kv_cache import StaticCaches, cache_keyword

logger = logging.getLogger(__name__)


class InferenceEngine(torch.nn.Module):
    def __init__(self, module: torch.nn.Module, config: InferenceConfig, link: TensorLink | None,
                 device: torch.device):
        super().__init__()
        self.module = module
        self._config = config
        self.link = link
        self.device_ = device
        self.caches = StaticCaches(config.max_out_tokens)

    @property
    def tp_size(self) -> int:
        return self.link.size if self.link is not None else 1

    @property
    def tp_rank(self) -> int:
        return self.link.rank if self.link is not None else 0

    @property
    def inference_config(self) -> InferenceConfig:
        return self._config

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._check_same_inputs(args, kwargs)
        with torch.no_grad():  # not inference_mode: collectives fill tensors from their own thread
            return self.module(*_to(args, self.device_), **_to(kwargs, self.device_))

    def generate(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """`module.generate(...)` (Hugging Face's keywords) with a static cache of `max_out_tokens` positions."""
        if not hasattr(self.module, "generate"):
            raise TypeError(f"generate: {type(self.module).__name__} has no generate(); call the engine's forward.")
        args, kwargs = _to(args, self.device_), _to(kwargs, self.device_)
        self._check_same_inputs(args, kwargs)
        ids = kwargs.get("input_ids", args[0] if args else None)
        given = {"cache", "past_key_values", "cache_implementation"} & set(kwargs)
        if isinstance(ids, torch.Tensor) and not given and self.caches.supports(self.module):
            self._check_length(ids, kwargs)
            kwargs[cache_keyword()] = self.caches.get(self.module, ids.shape[0])
        if self._config.enable_cuda_graph and self.device_.type == "cuda" and "compile_config" not in kwargs:
            from transformers import CompileConfig

            kwargs["compile_config"] = CompileConfig(mode="reduce-overhead")  # decoding steps replayed as CUDA graphs
        # before every call, not only those with do_sample=True: sampling may be asked for by a generation_config=
        # or a logits processor, and ranks drawing different tokens would each go on with another sequence
        self._share_random_state()
        with torch.no_grad():  # not inference_mode: collectives fill tensors from their own thread
            return self.module.generate(*args, **kwargs)

    def _check_length(self, ids: torch.Tensor, kwargs: dict) -> None:
        prompt = ids.shape[-1]
        total = _generated_length(prompt, kwargs, getattr(self.module, "generation_config", None))
        if total > self._config.max_out_tokens:
            raise ValueError(f"generate: {prompt} prompt tokens + {total - prompt} new ones = {total} "
                             f"exceeds max_out_tokens ({self._config.max_out_tokens}), the size of the key/value "
                             "cache; pass a larger max_out_tokens to init_inference or ask for fewer tokens.")

    def _check_same_inputs(self, args: tuple, kwargs: dict) -> None:
        """Ranks fed different prompts would each compute part of a different sequence and return garbage (or wait
        forever on a collective of another shape): refuse, on every rank."""
        if self.link is None or self.link.size == 1:
            return
        if not self.link.agrees(torch.tensor([_fingerprint(args, kwargs)], dtype=torch.int64, device=self.device_)):
            raise ValueError(f"inference: the {self.link.size} tensor-parallel ranks were called with different "
                             "inputs; every rank of the group must pass the same input_ids, attention_mask and "
                             "generation arguments (broadcast them from one rank).")

    def _share_random_state(self) -> None:
        """Rank 0's random state (CPU, and the device's generator on a GPU) on every rank of the group."""
        if self.link is None or self.link.size == 1:
            return
        pairs = [(torch.get_rng_state, torch.set_rng_state)]
        if self.device_.type == "cuda":
            pairs.append((lambda: torch.cuda.get_rng_state(self.device_),
                          lambda s: torch.cuda.set_rng_state(s, self.device_)))
        for get, put in pairs:
            state = get().to(self.device_, torch.int64)
            shared = self.link.all_reduce(state if self.link.rank == 0 else torch.zeros_like(state))  # rank 0's only
            put(shared.to("cpu", torch.uint8))

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["module"], name)  # config, device, can_generate, ... (HF pipelines read them)


DEFAULT_NEW_TOKENS = 20
"""What Hugging Face's generate makes when no length is set anywhere."""


def _generated_length(prompt: int, kwargs: dict, model_config: Any) -> int:
    """The sequence length generate runs to, as Hugging Face reads it: max_new_tokens past the prompt, else
    max_length, each from the call's keywords, else its generation_config=, else the model's generation config."""
    configs = (kwargs.get("generation_config"), model_config)

    def setting(key: str) -> int | None:
        if kwargs.get(key) is not None:
            return kwargs[key]
        return next((getattr(c, key) for c in configs if getattr(c, key, None) is not None), None)

    new, total = setting("max_new_tokens"), setting("max_length")
    if new is not None:
        return prompt + new
    return total if total is not None else prompt + DEFAULT_NEW_TOKENS


def _to(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, tuple):
        return tuple(_to(v, device) for v in value)
    if isinstance(value, list):
        return [_to(v, device) for v in value]
    if isinstance(value, dict):
        return {k: _to(v, device) for k, v in value.items()}
    return value


def _fingerprint(args: tuple, kwargs: dict) -> int:
    h = hashlib.blake2b(digest_size=7)
    for key, value in [*enumerate(args), *sorted(kwargs.items(), key=lambda kv: str(kv[0]))]:
        h.update(str(key).encode())
        if isinstance(value, torch.Tensor):
            h.update(str((value.shape, value.dtype)).encode())
            h.update(value.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(value, (int, float, str, bool, type(None))):
            h.update(repr(value).encode())
    return int.from_bytes(h.digest(), "little")
