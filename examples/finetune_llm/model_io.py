"""Getting a Hugging Face causal LM into a (possibly ZeRO-3 partitioned) engine and the results back out.

* `load_model`: at ZeRO stage 3 the model is built under `shardwise.zero.Init` (each rank keeps 1/N of
  every parameter as it is constructed) and its safetensors are streamed in one tensor at a time with
  `shardwise.zero.load_state_dict_partitioned`, so no rank ever holds the whole model. Below stage 3 it
  is plain `from_pretrained`.
* `add_lora`: `peft` LoRA on the loaded model (after loading: peft adds modules). `reset_lora` redoes
  peft's initialisation when the LoRA modules were created inside `zero.Init`, where peft's in-place
  init cannot reach the already partitioned (empty) tensors.
* `save_adapter` / `save_merged`: gathered on every rank (collectives), written by global rank 0: the
  adapter with peft's `save_pretrained`, the merged model as Hugging Face safetensors shards that
  `from_pretrained` loads, one module gathered at a time.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file

import shardwise

from .data import prompt_ids

DEFAULT_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def weight_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of a Hugging Face model directory (one file, or the shards of an index)."""
    root = Path(model_dir)
    index = root / "model.safetensors.index.json"
    if index.is_file():
        return [root / name for name in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    if (root / "model.safetensors").is_file():
        return [root / "model.safetensors"]
    raise FileNotFoundError(
        f"{root}: no model.safetensors or model.safetensors.index.json. Save the model with save_pretrained "
        "(safetensors); pickled .bin weights are not read, since loading them can run code.")


def stored_numel(model_dir: str | Path) -> int:
    """Elements stored in a model directory's safetensors (read from the file headers only)."""
    total = 0
    for path in weight_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                total += math.prod(f.get_slice(key).get_shape())
    return total


class _SafetensorsFile(Mapping):
    """A safetensors file as a read-on-access mapping: only the tensor being copied is in memory."""

    def __init__(self, path: Path):
        self._file = safe_open(str(path), framework="pt")
        self._keys = list(self._file.keys())
        self._key_set = set(self._keys)

    def __getitem__(self, key: str) -> torch.Tensor:
        return self._file.get_tensor(key)

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __contains__(self, key: object) -> bool:
        return key in self._key_set

    def __len__(self) -> int:
        return len(self._keys)


def load_model(model_dir: str | Path, zero_stage: int) -> torch.nn.Module:
    """A causal LM from a local directory; partitioned while built and streamed in at stage 3."""
    import transformers

    if zero_stage < 3:
        return transformers.AutoModelForCausalLM.from_pretrained(model_dir, **fp32())
    config = transformers.AutoConfig.from_pretrained(model_dir)
    # Skip Hugging Face's weight init: the weights are streamed in next, and its init indexes into
    # parameters (an embedding's padding row) that zero.Init has already emptied.
    with _no_init_weights(), shardwise.zero.Init():
        model = transformers.AutoModelForCausalLM.from_config(config, **fp32())
    model.tie_weights()  # skipped with the init above; ties are by parameter object, partitioned or not
    expected = {n for n, _ in model.named_parameters()}
    buffers = {n for n, _ in model.named_buffers()}
    seen: set[str] = set()
    for path in weight_files(model_dir):
        tensors = _SafetensorsFile(path)
        unexpected = sorted(set(tensors) - expected - buffers)
        if unexpected:
            raise KeyError(f"{path}: tensors the model does not have: {unexpected[:10]}.")
        shardwise.zero.load_state_dict_partitioned(model, tensors, strict=False)
        seen |= set(tensors)
    missing = sorted(expected - seen)
    if missing:
        raise KeyError(f"{model_dir}: weights missing for {missing[:10]}; is this the model's own directory?")
    model.train()
    return model


def fp32() -> dict[str, torch.dtype]:
    """fp32 weights whatever dtype the checkpoint was saved in (the engine's precision policy casts);
    the keyword is `dtype` from transformers 4.56, `torch_dtype` before."""
    import transformers

    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    return {"dtype" if (major, minor) >= (4, 56) else "torch_dtype": torch.float32}


def _no_init_weights() -> contextlib.AbstractContextManager:
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # transformers 4.x
        from transformers.modeling_utils import no_init_weights
    return no_init_weights()


def add_lora(model: torch.nn.Module, r: int, alpha: float, dropout: float,
             target_modules: Sequence[str] | str = tuple(DEFAULT_TARGETS)) -> torch.nn.Module:
    import peft

    targets = target_modules if isinstance(target_modules, str) else list(target_modules)
    config = peft.LoraConfig(task_type="CAUSAL_LM", r=r, lora_alpha=alpha, lora_dropout=dropout,
                             target_modules=targets)
    return peft.get_peft_model(model, config)


def lora_layers(model: torch.nn.Module) -> list[tuple[str, Any]]:
    from peft.tuners.lora import LoraLayer

    return [(name, m) for name, m in model.named_modules() if isinstance(m, LoraLayer)]


def reset_lora(model: torch.nn.Module) -> None:
    """peft's default LoRA init (A: Kaiming-uniform, B: zeros) on rank 0, broadcast into the partitions."""
    for _, layer in lora_layers(model):
        for adapter in list(layer.lora_A):
            params = [*layer.lora_A[adapter].parameters(), *layer.lora_B[adapter].parameters()]
            with shardwise.zero.GatheredParameters(params, modifier_rank=0):
                if _rank() == 0:
                    layer.reset_lora_parameters(adapter, True)


def trainable_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Whole copies of the trainable parameters (a collective at ZeRO-3: call it on every rank)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    with shardwise.zero.GatheredParameters([p for _, p in named]):
        return {n: p.detach().to("cpu", copy=True) for n, p in named}


def save_adapter(model: torch.nn.Module, out_dir: str | Path, base_model: str | None = None,
                 tokenizer: Any = None) -> None:
    """The LoRA adapter as peft writes it (adapter_config.json + adapter_model.safetensors)."""
    state = trainable_state_dict(model)
    if base_model is not None:
        for config in model.peft_config.values():
            config.base_model_name_or_path = str(base_model)
    model.save_pretrained(str(out_dir), state_dict=state, is_main_process=_rank() == 0)
    if tokenizer is not None and _rank() == 0:
        tokenizer.save_pretrained(str(out_dir))
    if dist.is_initialized():
        dist.barrier()


def merged_tensors(model: torch.nn.Module, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, merged tensor) for every parameter and persistent buffer, one module at a time.

    A LoRA layer yields its base weight plus every active adapter's delta under the base layer's name;
    a tied parameter is yielded once, under its first name (as `save_pretrained` does).
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    layers = dict(lora_layers(base))
    done: set[int] = set()
    for name, module in base.named_modules():
        prefix = f"{name}." if name else ""
        if any(name.startswith(f"{lora}.") for lora in layers):
            continue  # the base layer and adapters inside a LoRA layer: handled with the layer
        if name in layers:
            params = list(module.parameters())
            with shardwise.zero.GatheredParameters(params):
                out = _merge_layer(module, prefix, dtype)
            done.update(id(p) for p in params)
        else:
            named = [(n, p) for n, p in module.named_parameters(recurse=False) if id(p) not in done]
            with shardwise.zero.GatheredParameters([p for _, p in named]):
                out = [(prefix + n, p.detach().to("cpu", dtype, copy=True)) for n, p in named]
            done.update(id(p) for _, p in named)
            out += [(prefix + n, b.detach().to("cpu", copy=True)) for n, b in module.named_buffers(recurse=False)
                    if n not in module._non_persistent_buffers_set]
        yield from out


def _merge_layer(layer: Any, prefix: str, dtype: torch.dtype) -> list[tuple[str, torch.Tensor]]:
    base_layer = layer.get_base_layer()
    weight = base_layer.weight.detach().to("cpu", torch.float32, copy=True)
    for adapter in layer.active_adapters:
        if adapter in layer.lora_A:
            weight += layer.get_delta_weight(adapter).to("cpu", torch.float32)
    out = [(prefix + "weight", weight.to(dtype))]
    if getattr(base_layer, "bias", None) is not None:
        out.append((prefix + "bias", base_layer.bias.detach().to("cpu", dtype, copy=True)))
    return out


def save_merged(model: torch.nn.Module, out_dir: str | Path, dtype: torch.dtype = torch.float32,
                max_shard_bytes: int = 2 << 30, tokenizer: Any = None) -> None:
    """Merged full weights in the Hugging Face layout (`from_pretrained` loads them); rank 0 writes,
    holding at most one shard (`max_shard_bytes`) at a time."""
    out = Path(out_dir)
    writer = _ShardWriter(out, max_shard_bytes) if _rank() == 0 else None
    for name, tensor in merged_tensors(model, dtype):
        if writer is not None:
            writer.add(name, tensor)
    if writer is not None:
        writer.finish()
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        base.config.save_pretrained(str(out))
        if tokenizer is not None:
            tokenizer.save_pretrained(str(out))
    if dist.is_initialized():
        dist.barrier()


class _ShardWriter:
    """safetensors shards named as Hugging Face names them, with an index when there is more than one."""

    def __init__(self, out: Path, max_shard_bytes: int):
        self.out, self.max_bytes = out, max_shard_bytes
        out.mkdir(parents=True, exist_ok=True)
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.parts: list[tuple[Path, list[str]]] = []
        self.total = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + size > self.max_bytes:
            self._flush()
        self.pending[name] = tensor.contiguous()
        self.pending_bytes += size
        self.total += size

    def _flush(self) -> None:
        path = self.out / f".part-{len(self.parts):05d}.safetensors"
        save_file(self.pending, str(path), metadata={"format": "pt"})
        self.parts.append((path, list(self.pending)))
        self.pending, self.pending_bytes = {}, 0

    def finish(self) -> None:
        if self.pending or not self.parts:
            self._flush()
        if len(self.parts) == 1:
            self.parts[0][0].replace(self.out / "model.safetensors")
            return
        weight_map = {}
        for i, (path, names) in enumerate(self.parts, 1):
            final = f"model-{i:05d}-of-{len(self.parts):05d}.safetensors"
            path.replace(self.out / final)
            weight_map.update({n: final for n in names})
        index = {"metadata": {"total_size": self.total}, "weight_map": weight_map}
        (self.out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


@torch.no_grad()
def greedy_completions(model: torch.nn.Module, tokenizer: Any, prompts: Sequence[str], template: str,
                       max_new_tokens: int) -> list[list[int]]:
    """New token ids (greedy) after each prompt. At ZeRO-3 run it on every rank with the same prompts:
    every rank then runs the same forwards, so the gathers line up."""
    was_training = model.training
    model.eval()
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    out = []
    for prompt in prompts:
        ids = torch.tensor([prompt_ids(tokenizer, prompt, template)], device=device)
        tokens = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                do_sample=False, pad_token_id=tokenizer.pad_token_id,
                                eos_token_id=tokenizer.eos_token_id)
        out.append(tokens[0, ids.shape[1]:].tolist())
    model.train(was_training)
    return out
