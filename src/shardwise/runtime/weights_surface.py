"""Whole weights out of a sharded engine, under DeepSpeed's names (mixed into `Engine`): Hugging Face's Trainer
and accelerate call them at ZeRO-3 and with AutoTP; `save_16bit_model` writes a file `from_pretrained` reads."""

from __future__ import annotations

import torch


class ConsolidatedWeights:
    def save_fp16_model(self, save_dir: str, save_filename: str = "model.safetensors") -> str | None:
        """DeepSpeed's older name of `save_16bit_model`."""
        return self.save_16bit_model(save_dir, save_filename)

    def save_16bit_model(self, save_dir: str, save_filename: str = "model.safetensors",
                         exclude_frozen_parameters: bool = False) -> str | None:
        """Consolidated weights in the training dtype (safetensors), e.g. for `from_pretrained`; every rank calls it."""
        from ..checkpoint.weights import save_16bit_model

        return save_16bit_model(self, save_dir, save_filename, exclude_frozen_parameters)

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False) -> dict[str, torch.Tensor] | None:
        """ZeRO-3's whole weights on rank 0 (None on the other ranks); every rank must call it."""
        from ..checkpoint.weights import consolidated_state_dict

        return consolidated_state_dict(self, exclude_frozen_parameters)

    def _consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False) -> dict[str, torch.Tensor] | None:
        """The whole weights on rank 0 (None on the other ranks) under any layout, tensor-parallel included
        (accelerate calls it for AutoTP); every rank must call it."""
        from ..checkpoint.weights import whole_weights

        return whole_weights(self, exclude_frozen_parameters)

