"""Which module of a model is split how: a plan is a list of rules (a regex on module names and a style).

AutoTP's sources, first match wins:
1. the config's `tensor_parallel.partition_config.layer_specs` (DeepSpeed's keys: `patterns`, `partition_type`
   "column" | "row" | "skip", `shape` for fused projections, `gather_output`, `grad_allreduce`, `model_types`);
2. `tensor_parallel.preset_model`, or the model's own `config.model_type`, among the built-in plans below;
3. the Hugging Face model config's `base_model_tp_plan` (every architecture transformers can split itself).
Vocabulary-parallel embeddings and LM head are added to every Hugging Face plan unless
`vocab_parallel_lm_head` is false. A model written with shardwise.tensor_parallel.layers (modules that declare a
`tp_style`, a `PipelineModule` of them say) needs no plan: it has no Hugging Face config, so it gets no rules.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

from .styles import COLWISE, EMBEDDING, GRAD_SUM, LM_HEAD, ROWWISE, SEQ_ENTER, SEQ_GATHER, SEQ_SCATTER, TensorParallelError


@dataclass(frozen=True)
class Rule:
    pattern: str
    """A regex matched against the whole dotted module name (a match anywhere after a dot counts)."""
    style: str
    blocks: int = 1

    def matches(self, name: str) -> bool:
        return re.fullmatch(rf"(?:.*\.)?(?:{self.pattern})", name) is not None


def _attn_mlp(attn: str, cols: str, row: str, mlp_cols: str, mlp_row: str, blocks: int = 1) -> list[Rule]:
    return [Rule(rf"{attn}\.(?:{cols})", COLWISE, blocks), Rule(rf"{attn}\.{row}", ROWWISE),
            Rule(mlp_cols, COLWISE), Rule(mlp_row, ROWWISE)]


_LLAMA = _attn_mlp(r"layers\.\d+\.self_attn", "q_proj|k_proj|v_proj", "o_proj",
                   r"layers\.\d+\.mlp\.(?:gate_proj|up_proj)", r"layers\.\d+\.mlp\.down_proj")
BUILT_IN: dict[str, list[Rule]] = {
    "llama": _LLAMA, "qwen2": _LLAMA, "mistral": _LLAMA,
    "qwen3": _LLAMA + [Rule(r"layers\.\d+\.self_attn\.(?:q_norm|k_norm)", GRAD_SUM)],
    "gpt2": [Rule(r"h\.\d+\.attn\.c_attn", COLWISE, 3), Rule(r"h\.\d+\.attn\.c_proj", ROWWISE),
             Rule(r"h\.\d+\.mlp\.c_fc", COLWISE), Rule(r"h\.\d+\.mlp\.c_proj", ROWWISE)],
    "opt": _attn_mlp(r"layers\.\d+\.self_attn", "q_proj|k_proj|v_proj", "out_proj",
                     r"layers\.\d+\.fc1", r"layers\.\d+\.fc2"),
    "bert": [Rule(r"layer\.\d+\.attention\.self\.(?:query|key|value)", COLWISE),
             Rule(r"layer\.\d+\.attention\.output\.dense", ROWWISE),
             Rule(r"layer\.\d+\.intermediate\.dense", COLWISE), Rule(r"layer\.\d+\.output\.dense", ROWWISE)],
}
BUILT_IN["roberta"] = BUILT_IN["bert"]

SEQUENCE_PARALLEL: dict[str, list[Rule]] = dict.fromkeys(
    ("llama", "qwen2", "qwen3", "mistral"),
    [Rule(r"layers\.0", SEQ_SCATTER), Rule(r"layers\.\d+\.(?:self_attn|mlp)", SEQ_ENTER), Rule(r"norm", SEQ_GATHER),
     Rule(r"layers\.\d+\.(?:input_layernorm|post_attention_layernorm)", GRAD_SUM)])
"""Sequence parallelism: the decoder layers run on 1/size of the tokens between their split layers (the mask
and rotary embeddings are built whole before the first layer), and the final norm's output is made whole."""

VOCAB_RULES = [Rule(r"embed_tokens|wte|word_embeddings", EMBEDDING), Rule(r"lm_head|cls\.predictions\.decoder", LM_HEAD)]

HF_STYLES = {"colwise": (COLWISE, 1), "colwise_rep": (COLWISE, 1), "local_colwise": (COLWISE, 1),
             "rowwise": (ROWWISE, 1), "rowwise_rep": (ROWWISE, 1), "local_rowwise": (ROWWISE, 1),
             "packed_colwise": (COLWISE, 2), "replicated_with_grad_allreduce": (GRAD_SUM, 1)}
HEAD_COUNTS = ("num_heads", "split_size")
"""Attributes of an attention module that count its (now split) heads or channels: divided by the size."""


def hf_config(model: torch.nn.Module) -> Any:
    return getattr(model, "config", None)


def declares_styles(model: torch.nn.Module) -> bool:
    """Whether some module of `model` says how it is split (shardwise.tensor_parallel.layers)."""
    return any(getattr(m, "tp_style", None) is not None for m in model.modules())


def resolve_plan(model: torch.nn.Module, partition_config: dict | None = None, preset: str | None = None,
                 vocab_parallel: bool | None = None, required: bool = True,
                 sequence_parallel: bool = False) -> list[Rule]:
    """The rules AutoTP applies to `model` (see the module docstring); raises naming what is missing, unless the
    model's own modules declare their styles or not `required` (a pipeline stage: the stages decide together)."""
    config = hf_config(model)
    model_type = preset or getattr(config, "model_type", None)
    rules: list[Rule] = []
    if sequence_parallel:
        if model_type not in SEQUENCE_PARALLEL:
            raise TensorParallelError(f"tensor_parallel.sequence_parallel: built for {', '.join(SEQUENCE_PARALLEL)} "
                                      f"models; got model type {model_type!r}. Set it to false.")
        rules += SEQUENCE_PARALLEL[model_type]
    if partition_config:
        rules += _layer_spec_rules(partition_config, model_type)
        if not partition_config.get("use_default_specs", True):
            return rules
    if model_type in BUILT_IN:
        rules += BUILT_IN[model_type]
    elif getattr(config, "base_model_tp_plan", None):
        rules += _from_hf(config.base_model_tp_plan)
    elif not rules and required and not declares_styles(model):  # layers that declare their styles need no plan
        raise TensorParallelError(
            f"tensor_parallel: no AutoTP plan for model type {model_type!r} ({type(model).__name__}); built in: "
            f"{', '.join(sorted(BUILT_IN))}, or any transformers model whose config has a base_model_tp_plan. Give "
            "one with tensor_parallel.partition_config.layer_specs ({\"patterns\": [regex], \"partition_type\": "
            "\"column\"|\"row\"}).")
    if vocab_parallel is not False and config is not None:
        rules += VOCAB_RULES
    return rules


def _from_hf(plan: dict[str, str]) -> list[Rule]:
    rules = []
    for key, style in plan.items():
        if style not in HF_STYLES:
            raise TensorParallelError(f"base_model_tp_plan: {key!r} asks for {style!r}, which shardwise does not "
                                      f"split (it knows {', '.join(HF_STYLES)}); give a partition_config instead.")
        pattern = re.escape(key).replace(r"\*", r"\d+")
        rules.append(Rule(pattern, *HF_STYLES[style]))
    return rules


SPEC_KEYS = ("patterns", "partition_type", "shape", "partition_dim", "gather_output", "grad_allreduce", "model_types")


PARTITION_KEYS = ("layer_specs", "use_default_specs", "tp_size", "strict_mode")
"""DeepSpeed's partition_config keys shardwise reads (tp_size and strict_mode change nothing here: the size is
autotp_size, and a plan matching nothing is always refused). `embedding_partition_dim` and `lm_head_patterns`
would change what is split; they are refused rather than ignored."""


def _layer_spec_rules(partition_config: dict, model_type: str | None) -> list[Rule]:
    unknown = sorted(set(partition_config) - set(PARTITION_KEYS))
    if unknown:
        raise TensorParallelError(f"tensor_parallel.partition_config: {unknown} are not read by shardwise (it reads "
                                  f"{', '.join(PARTITION_KEYS)}); the embedding and LM head are split over the "
                                  "vocabulary (vocab_parallel_lm_head), other modules by layer_specs. Remove them.")
    rules = []
    for index, spec in enumerate(partition_config.get("layer_specs", [])):
        where = f"tensor_parallel.partition_config.layer_specs[{index}]"
        unknown = sorted(set(spec) - set(SPEC_KEYS))
        if unknown:
            raise TensorParallelError(f"{where}: unknown keys {unknown}; a layer spec takes {', '.join(SPEC_KEYS)}.")
        types = spec.get("model_types")
        if types and str(model_type).lower() not in [str(t).lower() for t in types]:
            continue  # DeepSpeed's model_types: the spec is for other architectures
        style, blocks = _spec_style(spec, where)
        for pattern in spec.get("patterns", []):
            # DeepSpeed's patterns name parameters ("...o_proj.weight"): a rule here names the module
            module_pattern = re.sub(r"\\?\.(?:weight|bias)\$?$", "", pattern).removeprefix(".*\\.").removeprefix("^")
            rules.append(Rule(module_pattern, style, blocks))
    return rules


def _spec_style(spec: dict, where: str) -> tuple[str, int]:
    """A layer spec's style and blocks, as DeepSpeed reads it (partition_type defaults to column); what shardwise
    does not split as DeepSpeed would is refused rather than split another way."""
    kind = str(spec.get("partition_type", "column")).lower()
    styles = {"column": COLWISE, "row": ROWWISE, "skip": "skip"}
    if kind not in styles:
        raise TensorParallelError(f"tensor_parallel.partition_config.layer_specs: partition_type "
                                  f"{spec.get('partition_type')!r}; one of 'column', 'row', 'skip'.")
    shape = spec.get("shape")
    if shape and not isinstance(shape[0], int):
        raise TensorParallelError(f"{where}.shape: {shape} packs sub-parameters of unequal sizes, which shardwise "
                                  "does not split; give equal ones ([n, -1]) or split the projection in the model.")
    blocks = shape[0] if shape and shape[0] != -1 else 1
    # the dim DeepSpeed splits: a column split's output features (dim 1 of its [n, -1, in] view of n stacked
    # blocks: the same cut as n blocks of dim 0), a row split's input features
    natural = {"column": 1 if shape and len(shape) >= 3 else 0, "row": 1}.get(kind)
    dim = spec.get("partition_dim")
    if (dim is not None and dim != natural) or (kind != "column" and blocks != 1):
        raise TensorParallelError(f"{where}: a {kind} split with partition_dim {dim} and shape {shape} is not "
                                  "supported; a column split cuts the output features (dim 0, or 1 of an [n, -1, in] "
                                  "shape), a row split the input features (dim 1) without shape. Drop partition_dim or "
                                  "the shape.")
    if spec.get("gather_output"):
        if kind != "column" or blocks != 1:
            raise TensorParallelError(f"{where}.gather_output: only a column split without shape gathers its output; "
                                      f"got partition_type {kind!r}, shape {shape}. Drop gather_output or the shape.")
        return LM_HEAD, 1
    if spec.get("grad_allreduce"):
        if kind != "skip":
            raise TensorParallelError(f"{where}.grad_allreduce: only a skip spec (a whole parameter whose gradient is "
                                      f"partial on each rank) sums its gradient; got partition_type {kind!r}. Set "
                                      "partition_type \"skip\" or drop grad_allreduce.")
        return GRAD_SUM, 1
    return styles[kind], blocks
