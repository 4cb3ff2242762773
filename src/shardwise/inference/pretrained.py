"""Serve a Hugging Face causal LM from its folder: built on the meta device from its config (SDPA attention), weights
read shard by shard from the folder's safetensors or from a shardwise training checkpoint, with a PEFT adapter's
LoRA layers when one is named (its `adapter_config.json` says where they go; its weights are read unless the
checkpoint has them)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from .build import init_inference
from .empty_weights import empty_weights
from .engine import InferenceEngine
from .sources import Chain, SafetensorsFolder, WeightSource, open_source


def load_pretrained(model: str | Path, checkpoint: str | Path | None = None, adapter: str | Path | None = None,
                    config: str | Path | Mapping[str, Any] | None = None, **kwargs: Any) -> InferenceEngine:
    import transformers

    hf_config = transformers.AutoConfig.from_pretrained(model)
    with empty_weights():
        network = transformers.AutoModelForCausalLM.from_config(hf_config, attn_implementation="sdpa")
        if adapter is not None:
            import peft

            network = peft.get_peft_model(network, peft.PeftConfig.from_pretrained(str(adapter)))
    return init_inference(network, config, checkpoint=_source(model, checkpoint, adapter), **kwargs)


def _source(model: str | Path, checkpoint: str | Path | None, adapter: str | Path | None) -> WeightSource:
    if checkpoint is not None:
        return open_source(str(checkpoint))
    base = SafetensorsFolder.at(model)
    return Chain(base, SafetensorsFolder.at(adapter)) if adapter is not None else base
