"""Tensor-parallel pieces and plans without processes: take/assemble, TensorShard, resolve_plan."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch

from shardwise.tensor_parallel import TensorParallelError, TensorShard, assemble, resolve_plan, take

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("blocks", [1, 3])
@pytest.mark.parametrize("size", [1, 2, 4])
def test_take_then_assemble_is_the_whole(dim, blocks, size):
    shape = [12, 24]  # both dims divide by 3 blocks x 4 ranks
    full = torch.arange(12 * 24, dtype=torch.float32).view(shape)
    parts = [take(full, TensorShard(dim, rank, size, tuple(shape), blocks)) for rank in range(size)]
    local = list(shape)
    local[dim] //= size
    assert all(tuple(p.shape) == tuple(local) == TensorShard(dim, 0, size, tuple(shape), blocks).local_shape
               for p in parts)
    assert torch.equal(assemble(parts, dim, blocks), full)


def test_a_fused_projection_is_split_block_by_block():
    # GPT-2's c_attn: [in, 3 * out] with q, k, v side by side along dim 1; each rank keeps its heads of each.
    q, k, v = (torch.full((2, 4), float(i)) + torch.arange(4.0) for i in (10, 20, 30))
    fused = torch.cat([q, k, v], dim=1)
    rank1 = take(fused, TensorShard(1, 1, 2, (2, 12), blocks=3))
    assert torch.equal(rank1, torch.cat([q[:, 2:], k[:, 2:], v[:, 2:]], dim=1))
    rank1_plain = take(fused, TensorShard(1, 1, 2, (2, 12)))  # one block: the second half, k's tail and v
    assert torch.equal(rank1_plain, fused[:, 6:])


def test_take_of_a_bias_and_a_three_dim_tensor():
    bias = torch.arange(8.0)
    assert torch.equal(take(bias, TensorShard(0, 1, 4, (8,))), torch.tensor([2.0, 3.0]))
    full = torch.randn(2, 6, 4)
    parts = [take(full, TensorShard(1, r, 3, (2, 6, 4))) for r in range(3)]
    assert torch.equal(parts[2], full[:, 4:]) and torch.equal(assemble(parts, 1), full)


def test_tensor_shard_refuses_an_uneven_split():
    with pytest.raises(ValueError, match=re.escape(
            "a dim of 10 (x1 blocks) cannot be split evenly over 4 tensor-parallel ranks")):
        TensorShard(0, 0, 4, (10, 3))
    with pytest.raises(ValueError, match=re.escape(
            "a dim of 12 (x3 blocks) cannot be split evenly over 8 tensor-parallel ranks")):
        TensorShard(1, 0, 8, (4, 12), blocks=3)
    TensorShard(1, 0, 4, (4, 12), blocks=3)  # 3 blocks of 4 columns, 1 per rank


def test_tensor_shard_describes_itself_for_the_manifest():
    shard = TensorShard(1, 0, 2, (32, 96), 3)
    assert shard.describe() == {"dim": 1, "parts": 2, "blocks": 3}
    assert shard.local_shape == (32, 48)
    assert shard.with_rank(1) == TensorShard(1, 1, 2, (32, 96), 3)


# --- plans -------------------------------------------------------------------------------------------------


def _styles(model: torch.nn.Module, rules) -> dict[str, tuple[str, int]]:
    """Module name -> (style, blocks) of the first rule that matches it, as AutoTP applies them."""
    out = {}
    for name, _ in model.named_modules():
        rule = next((r for r in rules if name and r.matches(name)), None)
        if rule is not None:
            out[name] = (rule.style, rule.blocks)
    return out


def _small(**kw):
    return {"vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
            "max_position_embeddings": 32, **kw}


@pytest.fixture(scope="module")
def llama():
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(intermediate_size=64, num_key_value_heads=2,
                                                                  **_small()))


def test_llama_plan(llama):
    styles = _styles(llama, resolve_plan(llama))
    layer = {n.removeprefix("model.layers.0."): s for n, s in styles.items() if n.startswith("model.layers.0.")}
    assert layer == {"self_attn.q_proj": ("colwise", 1), "self_attn.k_proj": ("colwise", 1),
                     "self_attn.v_proj": ("colwise", 1), "self_attn.o_proj": ("rowwise", 1),
                     "mlp.gate_proj": ("colwise", 1), "mlp.up_proj": ("colwise", 1), "mlp.down_proj": ("rowwise", 1)}
    assert styles["model.embed_tokens"] == ("vocab_embedding", 1)
    assert styles["lm_head"] == ("colwise_gather", 1)
    assert len(styles) == 2 * 7 + 2  # norms, rotary embedding and the layers' containers stay whole


def test_gpt2_plan_splits_the_fused_qkv_in_three_blocks():
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=4,
                                                                 n_positions=32))
    styles = _styles(model, resolve_plan(model))
    assert styles == {"transformer.wte": ("vocab_embedding", 1), "transformer.h.0.attn.c_attn": ("colwise", 3),
                      "transformer.h.0.attn.c_proj": ("rowwise", 1), "transformer.h.0.mlp.c_fc": ("colwise", 1),
                      "transformer.h.0.mlp.c_proj": ("rowwise", 1), "lm_head": ("colwise_gather", 1)}


def test_opt_plan():
    model = transformers.OPTForCausalLM(transformers.OPTConfig(ffn_dim=64, word_embed_proj_dim=32,
                                                               **_small(num_hidden_layers=1)))
    styles = _styles(model, resolve_plan(model))
    layer = "model.decoder.layers.0."
    assert styles == {"model.decoder.embed_tokens": ("vocab_embedding", 1), **{
        layer + f"self_attn.{p}": ("colwise", 1) for p in ("q_proj", "k_proj", "v_proj")},
        layer + "self_attn.out_proj": ("rowwise", 1), layer + "fc1": ("colwise", 1), layer + "fc2": ("rowwise", 1),
        "lm_head": ("colwise_gather", 1)}  # the learned positions (embed_positions) stay whole


def test_bert_plan_tells_the_attention_output_from_the_layer_output():
    model = transformers.BertForMaskedLM(transformers.BertConfig(intermediate_size=64, **_small(num_hidden_layers=1)))
    styles = _styles(model, resolve_plan(model))
    layer = "bert.encoder.layer.0."
    assert styles == {"bert.embeddings.word_embeddings": ("vocab_embedding", 1), **{
        layer + f"attention.self.{p}": ("colwise", 1) for p in ("query", "key", "value")},
        layer + "attention.output.dense": ("rowwise", 1), layer + "intermediate.dense": ("colwise", 1),
        layer + "output.dense": ("rowwise", 1), "cls.predictions.decoder": ("colwise_gather", 1)}


def test_a_config_base_model_tp_plan_is_used_when_no_plan_is_built_in():
    model = transformers.GemmaForCausalLM(transformers.GemmaConfig(intermediate_size=64, num_key_value_heads=2,
                                                                   head_dim=8, **_small(num_hidden_layers=1)))
    assert model.config.model_type == "gemma"
    styles = _styles(model, resolve_plan(model))
    assert styles["model.layers.0.self_attn.k_proj"] == ("colwise", 1)
    assert styles["model.layers.0.mlp.down_proj"] == ("rowwise", 1)
    assert styles["model.embed_tokens"] == ("vocab_embedding", 1) and styles["lm_head"] == ("colwise_gather", 1)
    assert len(styles) == 7 + 2


def _custom(plan: dict | None, model_type: str = "mything") -> torch.nn.Module:
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([torch.nn.Module() for _ in range(2)])
    for layer in model.layers:
        layer.up, layer.down, layer.norm = torch.nn.Linear(4, 8), torch.nn.Linear(8, 4), torch.nn.LayerNorm(4)
    model.config = SimpleNamespace(model_type=model_type, base_model_tp_plan=plan)
    return model


def test_base_model_tp_plan_styles_map_to_shardwise_styles():
    plan = {"layers.*.up": "colwise_rep", "layers.*.down": "rowwise", "layers.*.norm": "replicated_with_grad_allreduce"}
    styles = _styles(_custom(plan), resolve_plan(_custom(plan), vocab_parallel=False))
    assert styles == {"layers.0.up": ("colwise", 1), "layers.0.down": ("rowwise", 1), "layers.0.norm": ("grad_sum", 1),
                      "layers.1.up": ("colwise", 1), "layers.1.down": ("rowwise", 1), "layers.1.norm": ("grad_sum", 1)}


def test_base_model_tp_plan_with_a_style_shardwise_does_not_split():
    plan = {"layers.*.up": "colwise_gather_output"}
    with pytest.raises(TensorParallelError, match=re.escape(
            "base_model_tp_plan: 'layers.*.up' asks for 'colwise_gather_output', which shardwise does not split")):
        resolve_plan(_custom(plan))


# DeepSpeed's partition_config names parameters; the rules name their modules.
SPECS = [{"patterns": [r".*\.o_proj\.weight$", r".*\.down_proj\.weight$"], "partition_type": "row"},
         {"patterns": [r".*\.[qkv]_proj\.weight$"], "partition_type": "column"},
         {"patterns": [r".*\.up_proj\.weight$"], "partition_type": "column", "shape": [2, -1]}]


def test_partition_config_without_default_specs_is_the_whole_plan(llama):
    rules = resolve_plan(llama, {"use_default_specs": False, "layer_specs": SPECS})
    styles = _styles(llama, rules)
    assert {n.removeprefix("model.layers.1."): s for n, s in styles.items() if n.startswith("model.layers.1.")} == {
        "self_attn.q_proj": ("colwise", 1), "self_attn.k_proj": ("colwise", 1), "self_attn.v_proj": ("colwise", 1),
        "self_attn.o_proj": ("rowwise", 1), "mlp.up_proj": ("colwise", 2), "mlp.down_proj": ("rowwise", 1)}
    assert "mlp.gate_proj" not in str(styles) and "embed_tokens" not in styles and "lm_head" not in styles


def test_partition_config_rules_come_before_the_defaults_and_skip_leaves_a_module_whole(llama):
    specs = [{"patterns": [r"model\.layers\.0\.mlp\.down_proj\.weight"], "partition_type": "skip"}]
    styles = _styles(llama, resolve_plan(llama, {"layer_specs": specs}))
    assert styles["model.layers.0.mlp.down_proj"] == ("skip", 1)
    assert styles["model.layers.1.mlp.down_proj"] == ("rowwise", 1)  # the built-in plan still applies
    assert styles["model.layers.0.mlp.up_proj"] == ("colwise", 1) and "lm_head" in styles


def test_partition_type_must_be_known(llama):
    with pytest.raises(TensorParallelError, match=re.escape(
            "tensor_parallel.partition_config.layer_specs: partition_type 'rows'; one of 'column', 'row', 'skip'.")):
        resolve_plan(llama, {"layer_specs": [{"patterns": ["x"], "partition_type": "rows"}]})


def test_preset_model_and_vocab_parallel_false(llama):
    model = _custom(None, model_type="mything")
    model.layers[0].self_attn = torch.nn.Module()
    model.layers[0].self_attn.q_proj = torch.nn.Linear(4, 4)
    styles = _styles(model, resolve_plan(model, preset="llama", vocab_parallel=False))
    assert styles == {"layers.0.self_attn.q_proj": ("colwise", 1)}
    assert "lm_head" not in _styles(llama, resolve_plan(llama, vocab_parallel=False))


def test_unknown_model_type_is_refused_with_the_way_out():
    with pytest.raises(TensorParallelError) as caught:
        resolve_plan(_custom(None, model_type="mything"))
    assert str(caught.value) == (
        "tensor_parallel: no AutoTP plan for model type 'mything' (Module); built in: bert, gpt2, llama, mistral, "
        "opt, qwen2, qwen3, roberta, or any transformers model whose config has a base_model_tp_plan. Give one with "
        "tensor_parallel.partition_config.layer_specs ({\"patterns\": [regex], \"partition_type\": "
        "\"column\"|\"row\"}).")


def test_a_model_of_megatron_style_layers_needs_no_plan():
    from tests.tensor_parallel_models import MegatronNet

    assert resolve_plan(MegatronNet()) == []  # its layers declare their styles; parallelize applies them


def test_partition_config_reads_deepspeeds_other_spec_keys(llama):
    specs = [{"patterns": [r".*\.lm_head\.weight$", r"lm_head\.weight"], "partition_type": "Column", "gather_output": True},
             {"patterns": [r".*\.input_layernorm\.weight$"], "partition_type": "skip", "grad_allreduce": True},
             {"patterns": [r".*\.o_proj\.weight$"], "partition_type": "row", "partition_dim": 1},
             {"patterns": [r".*\.up_proj\.weight$"], "shape": [2, -1], "partition_dim": 0},  # column by default
             {"patterns": [r".*\.down_proj\.weight$"], "partition_type": "row", "model_types": ["mistral"]}]
    styles = _styles(llama, resolve_plan(llama, {"use_default_specs": False, "layer_specs": specs}))
    assert styles == {"lm_head": ("colwise_gather", 1), "model.layers.0.input_layernorm": ("grad_sum", 1),
                      "model.layers.1.input_layernorm": ("grad_sum", 1), "model.layers.0.self_attn.o_proj": ("rowwise", 1),
                      "model.layers.1.self_attn.o_proj": ("rowwise", 1), "model.layers.0.mlp.up_proj": ("colwise", 2),
                      "model.layers.1.mlp.up_proj": ("colwise", 2)}  # the mistral-only spec does not apply to llama


@pytest.mark.parametrize("spec, message", [
    ({"patterns": ["x"], "partition_dim": 1},
     "tensor_parallel.partition_config.layer_specs[0]: a column split with partition_dim 1 and shape None is not "
     "supported; a column split cuts the output features (dim 0, or 1 of an [n, -1, in] shape), a row split the input "
     "features (dim 1) without shape. Drop partition_dim or the shape."),
    ({"patterns": ["x"], "partition_type": "row", "shape": [2, -1]},
     "tensor_parallel.partition_config.layer_specs[0]: a row split with partition_dim None and shape [2, -1] is not "
     "supported;"),
    ({"patterns": ["x"], "shape": [[32, 16, 16], -1]},
     "tensor_parallel.partition_config.layer_specs[0].shape: [[32, 16, 16], -1] packs sub-parameters of unequal sizes, "
     "which shardwise does not split; give equal ones ([n, -1]) or split the projection in the model."),
    ({"patterns": ["x"], "shape": [3, -1], "gather_output": True},
     "tensor_parallel.partition_config.layer_specs[0].gather_output: only a column split without shape gathers its "
     "output; got partition_type 'column', shape [3, -1]. Drop gather_output or the shape."),
    ({"patterns": ["x"], "partition_type": "row", "grad_allreduce": True},
     "tensor_parallel.partition_config.layer_specs[0].grad_allreduce: only a skip spec (a whole parameter whose "
     "gradient is partial on each rank) sums its gradient; got partition_type 'row'. Set partition_type \"skip\" or "
     "drop grad_allreduce."),
    ({"patterns": ["x"], "gather_outputs": True},
     "tensor_parallel.partition_config.layer_specs[0]: unknown keys ['gather_outputs']; a layer spec takes patterns, "
     "partition_type, shape, partition_dim, gather_output, grad_allreduce, model_types."),
])
def test_layer_specs_shardwise_cannot_honour_are_refused(llama, spec, message):
    with pytest.raises(TensorParallelError) as caught:
        resolve_plan(llama, {"layer_specs": [spec]})
    assert str(caught.value).startswith(message)


def test_partition_config_keys_shardwise_does_not_read_are_refused():
    with pytest.raises(TensorParallelError) as info:
        resolve_plan(torch.nn.Linear(2, 2), {"layer_spec": [{"patterns": ["x"]}], "lm_head_patterns": ["head"]})
    assert str(info.value) == (
        "tensor_parallel.partition_config: ['layer_spec', 'lm_head_patterns'] are not read by shardwise (it reads "
        "layer_specs, use_default_specs, tp_size, strict_mode); the embedding and LM head are split over the "
        "vocabulary (vocab_parallel_lm_head), other modules by layer_specs. Remove them.")
