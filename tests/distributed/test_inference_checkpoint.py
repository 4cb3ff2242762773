"""`init_inference` from a shardwise training checkpoint: the tiny LLaMA trained a few steps at world 2 (ZeRO-3,
and separately AutoTP at tp 2) and saved, then served at tp 1 and tp 2 from that directory, scores and decodes as
the trained weights (gathered whole) do in one Hugging Face model. A model of another shape is refused rather than
filled with the first elements of each saved tensor."""

from __future__ import annotations

import pytest
import torch

from tests import inference_models as im
from tests import tensor_parallel_models as tp_models
from tests.harness import run_distributed

transformers = pytest.importorskip("transformers")

LAYOUTS = {"zero3": (1, 3), "autotp2": (2, 1)}
"""name -> (autotp_size, ZeRO stage) of the training run at world 2."""
STEPS = 3


def _wider():
    config = im.hf_config("llama")
    config.intermediate_size = 96  # another model: its MLP weights have another shape than the checkpoint's
    return config


def _serve(root: str, tp: int, config=None):
    import shardwise

    return shardwise.init_inference(im.empty_model(config=config or im.hf_config("llama")), checkpoint=root,
                                    tensor_parallel={"tp_size": tp}, max_out_tokens=64)


def _train_save_serve(root: str) -> dict:
    import shardwise
    from shardwise.checkpoint.errors import CheckpointError

    out = {}
    for name, (tp, stage) in LAYOUTS.items():
        engine, *_ = shardwise.initialize(model=im.build("llama"), config=tp_models.config(tp, 2 // tp, stage))
        losses = tp_models.train(engine, STEPS)["losses"]
        engine.save_checkpoint(f"{root}/{name}")
        served = _serve(f"{root}/{name}", 2)
        out[name] = {"losses": losses, "params": tp_models.whole_params(engine), "logits": im.engine_logits(served),
                     "greedy": served.generate(**im.prompts(), **im.greedy_kwargs())}
        try:
            _serve(f"{root}/{name}", 2, _wider())
            out[name]["wider"] = "loaded"
        except CheckpointError as e:  # raised alike on both ranks, before any collective of the load
            out[name]["wider"] = str(e)
    return out


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("inference_from_training")
    return root, run_distributed(_train_save_serve, 2, str(root), timeout=180)


def _oracle(params: dict) -> tuple[torch.Tensor, torch.Tensor]:
    model = im.build("llama")
    model.load_state_dict(params)
    return im.oracle_logits(model), im.oracle_generate(model, **im.greedy_kwargs())


@pytest.mark.parametrize("name", LAYOUTS)
def test_a_training_checkpoint_serves_at_tp1_and_tp2(name, trained):
    root, results = trained
    params = results[0][name]["params"]
    assert results[0][name]["losses"][-1] < results[0][name]["losses"][0]  # it trained: the weights moved
    logits, greedy = _oracle(params)
    assert not torch.allclose(logits, im.oracle_logits(im.build("llama")))
    one = _serve(str(root / name), 1)
    im.assert_close_logits(im.engine_logits(one), logits, label=f"{name} at tp 1")
    assert torch.equal(one.generate(**im.prompts(), **im.greedy_kwargs()), greedy)
    for rank, result in enumerate(results):
        im.assert_close_logits(result[name]["logits"], logits, label=f"{name} at tp 2, rank {rank}")
        assert torch.equal(result[name]["greedy"], greedy), (name, rank)


@pytest.mark.parametrize("name", LAYOUTS)
def test_a_model_of_another_shape_is_refused(name, trained):
    root, results = trained
    for result in results:
        assert result[name]["wider"] == (
            f"init_inference: {str(root / name)!r} holds 'model.layers.0.mlp.gate_proj.weight' with shape (128, 64); "
            "the model's parameter has shape (96, 64). The checkpoint is not this model's (check the model config).")
