"""random-LTD on one process: the kept tokens against a hand-written oracle (loss and gradients), the schedule
over steps, eval untouched, names unchanged, and the errors a user sees."""

from __future__ import annotations

import pytest
import torch

from shardwise.config import ConfigError, parse_config
from shardwise.config.data_efficiency import RandomLTDConfig
from shardwise.data_efficiency.random_ltd import RandomLTDError, RandomLTDScheduler, attach_random_ltd
from tests.random_ltd_models import SEQ, batch, ltd_section, oracle_loss, tiny

transformers = pytest.importorskip("transformers")


def _scheduler(model, layer_ids, min_value, max_value, dp_rank=0, **extra) -> RandomLTDScheduler:
    section = ltd_section(layer_ids, min_value, max_value, **extra)["data_routing"]["random_ltd"]
    scheduler = RandomLTDScheduler(RandomLTDConfig.model_validate(section), seed=1234, dp_rank=dp_rank,
                                   global_batch_size=4)
    scheduler.convert(model)
    return scheduler


def _kept(scheduler: RandomLTDScheduler, batch_size: int) -> dict[int, torch.Tensor]:
    k = scheduler.get_current_seq()
    return {layer.layer_index: layer.draw(batch_size, SEQ, k, torch.device("cpu")) for layer in scheduler.layers}


@pytest.mark.parametrize("kind,attn", [("gpt2", "sdpa"), ("llama", "sdpa"), ("llama", "eager"), ("gpt2", "eager")])
def test_dropping_matches_the_oracle(kind, attn):
    model, reference = tiny(kind, attn), tiny(kind, attn)
    scheduler = _scheduler(model, [1, 2], min_value=4, max_value=SEQ)
    scheduler.update_seq(2, 1)  # step 2: 4 + 2/4 * 8 = 8 tokens kept
    assert scheduler.get_current_seq() == 8
    ids = batch(0, 3)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    expected = oracle_loss(kind, reference, ids, _kept(scheduler, 3))
    expected.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    reference_grads = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, reference_grads[name].grad, rtol=1e-5, atol=1e-6, msg=name)
    plain = tiny(kind, attn)(input_ids=ids, labels=ids).loss  # and dropping did change something
    assert abs(plain.item() - loss.item()) > 1e-4


def test_dropped_positions_bypass_the_layer():
    model = tiny("llama")
    scheduler = _scheduler(model, [1], min_value=4, max_value=SEQ)
    scheduler.update_seq(0)
    seen = {}
    layer = model.model.layers[1]
    layer.register_forward_pre_hook(lambda m, a, kw: seen.update(x=a[0] if a else kw["hidden_states"]), with_kwargs=True)
    layer.register_forward_hook(lambda m, a, kw, out: seen.update(y=out), with_kwargs=True)
    ids = batch(1, 2)
    model(input_ids=ids)
    kept = _kept(scheduler, 2)[1]
    assert seen["x"].shape == seen["y"].shape == (2, SEQ, 32)  # hooks outside the layer see whole sequences
    for b in range(2):
        dropped = [p for p in range(SEQ) if p not in kept[b].tolist()]
        assert len(dropped) == SEQ - 4
        torch.testing.assert_close(seen["y"][b, dropped], seen["x"][b, dropped], rtol=0, atol=0)
        assert not torch.allclose(seen["y"][b, kept[b]], seen["x"][b, kept[b]])


def test_kept_count_follows_the_schedule_and_eval_sees_everything():
    model = tiny("gpt2")
    scheduler = _scheduler(model, [0, 3], min_value=4, max_value=SEQ, require_steps=4, seq_per_step=2)
    lengths = []
    model.transformer.h[3].attn.register_forward_hook(lambda m, a, kw, out: lengths.append(out[0].shape[1]),
                                                      with_kwargs=True)
    ids = batch(0, 2)
    for step in range(6):
        scheduler.update_seq(step)
        model(input_ids=ids)
    assert lengths == [4, 6, 8, 10, 12, 12]
    model.eval()
    scheduler.update_seq(0)
    model(input_ids=ids)
    assert lengths[-1] == SEQ


def test_same_step_same_tokens_other_rank_other_tokens():
    model = tiny("gpt2")
    first = _scheduler(model, [1], 4, SEQ)
    first.update_seq(3, 0)
    again = first.layers[0].draw(2, SEQ, 6, torch.device("cpu"))
    assert torch.equal(again, first.layers[0].draw(2, SEQ, 6, torch.device("cpu")))
    assert all(torch.equal(row, row.sort().values) for row in again)
    other_rank = _scheduler(tiny("gpt2"), [1], 4, SEQ, dp_rank=1)
    other_rank.update_seq(3, 0)
    assert not torch.equal(again, other_rank.layers[0].draw(2, SEQ, 6, torch.device("cpu")))
    first.update_seq(3, 1)  # the next micro-step
    assert not torch.equal(again, first.layers[0].draw(2, SEQ, 6, torch.device("cpu")))


def test_global_rng_untouched():
    model = tiny("gpt2")
    _scheduler(model, [1, 2], 4, SEQ).update_seq(0)
    torch.manual_seed(7)
    model(input_ids=batch(0, 2))  # dropout is 0: the forward itself draws nothing from the global RNG
    after = torch.rand(3)
    torch.manual_seed(7)
    assert torch.equal(after, torch.rand(3))


def test_state_dict_keys_unchanged_and_detach_restores():
    model, plain = tiny("llama"), tiny("llama")
    scheduler = _scheduler(model, [0, 2], 4, SEQ)
    assert list(model.state_dict()) == list(plain.state_dict())
    assert [n for n, _ in model.named_modules()] == [n for n, _ in plain.named_modules()]
    scheduler.detach()
    assert "forward" not in model.model.layers[0].__dict__


def test_bert_encoder_drops_with_a_padding_mask():
    model = tiny("bert")
    scheduler = _scheduler(model, [1], 4, SEQ, model_type="encoder")
    scheduler.update_seq(0)
    ids = batch(0, 2)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    out = model(input_ids=ids, attention_mask=mask, labels=ids).loss
    out.backward()
    assert torch.isfinite(out)
    scheduler.update_seq(100)  # everything kept: exactly the plain model
    torch.testing.assert_close(model(input_ids=ids, attention_mask=mask).logits,
                               tiny("bert")(input_ids=ids, attention_mask=mask).logits, rtol=0, atol=0)


def test_consumed_layer_tokens_as_deepspeed_counts():
    model = tiny("gpt2")
    scheduler = _scheduler(model, [1, 2], min_value=4, max_value=SEQ, require_steps=4, seq_per_step=2)
    for step in range(7):
        scheduler.update_seq(step)
    # DeepSpeed adds global_batch × (kept × 2 random-LTD layers + max × 2 other layers) at each step's forward
    kept = [4, 6, 8, 10, 12, 12, 12]
    assert scheduler.consumed_layer_tokens == sum(4 * (k * 2 + SEQ * 2) for k in kept)
    assert scheduler.state_dict() == {"consumed_layer_tokens": scheduler.consumed_layer_tokens, "current_steps": 6,
                                      "current_value": SEQ, "min_value": 4, "max_value": SEQ}
    assert scheduler.get_total_layer_tokens(3) == sum(4 * (k * 2 + SEQ * 2) for k in kept[:3])


# --- errors ---------------------------------------------------------------------------------------
def _config(**extra):
    return parse_config({"train_batch_size": 2, "data_efficiency": ltd_section([1, 2], 4, SEQ, **extra)}, dp_size=1)


def test_layer_id_out_of_range():
    with pytest.raises(RandomLTDError, match=r"random_ltd_layer_id: indices into the 4 layers of GPT2LMHeadModel "
                                             r"\(0 to 3\) are required; got \[1, 4\]\. Drop \[4\]"):
        _scheduler(tiny("gpt2"), [1, 4], 4, SEQ)


def test_total_layer_num_mismatch():
    with pytest.raises(RandomLTDError, match=r"total_layer_num: must equal the number of layers of LlamaForCausalLM "
                                             r"\(4, LlamaDecoderLayer\); got 6\. Set it to 4"):
        attach_random_ltd(tiny("llama"), _config(total_layer_num=6), dp_rank=0)


class _NoLayers(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.b(self.a(x))


def test_model_without_a_layer_list_fails_at_the_first_training_forward():
    scheduler = attach_random_ltd(_NoLayers(), _config(), dp_rank=0)
    with pytest.raises(RandomLTDError, match=r"random_ltd_layer_id: indexes the model's list of transformer layers.*"
                                             r"found none\. Call .*convert_to_random_ltd\(engine, LayerClass\)"):
        scheduler.update_seq(0)


def test_unknown_tensor_argument_is_refused():
    model = tiny("gpt2")
    _scheduler(model, [1], 4, SEQ).update_seq(0)
    with pytest.raises(TypeError, match=r"layer 1, GPT2Block\): argument 'encoder_hidden_states': random-LTD does "
                                        r"not know how to cut it"):
        model.transformer.h[1](torch.zeros(2, SEQ, 32), None, None, torch.zeros(2, 3, 32))


def test_cache_with_past_tokens_is_refused():
    model = tiny("llama")
    _scheduler(model, [0], 4, SEQ).update_seq(0)
    cache = transformers.DynamicCache(config=model.config)
    model(input_ids=batch(0, 1), past_key_values=cache, use_cache=True)
    with pytest.raises(ValueError, match=r"argument 'cache': a key/value cache with past tokens in training"):
        model(input_ids=batch(1, 1), past_key_values=cache, use_cache=True)


def test_mask_name_must_be_an_argument():
    class Plain(torch.nn.Module):
        def forward(self, x, mask=None):
            return x

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList([Plain(), Plain(), Plain()])

    with pytest.raises(ValueError, match=r"random_ltd.model_mask_name: must name an argument of Plain.forward \(x, "
                                         r"mask\); got 'attention'"):
        attach_random_ltd(Net(), _config(model_mask_name="attention"), dp_rank=0)


def test_min_value_below_seq_per_step_is_refused():
    with pytest.raises(ConfigError, match=r"random_ltd_schedule.min_value: at least schedule_config.seq_per_step "
                                          r"\(16\) is required"):
        _config(seq_per_step=16)


def test_activation_checkpointing_recomputes_the_same_tokens():
    grads = []
    for checkpointing in (False, True):
        model = tiny("llama")
        if checkpointing:
            model.gradient_checkpointing_enable()
        _scheduler(model, [1, 2], 4, SEQ).update_seq(1, 0)
        ids = batch(0, 2)
        model(input_ids=ids, labels=ids).loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, rtol=1e-6, atol=1e-7, msg=name)
