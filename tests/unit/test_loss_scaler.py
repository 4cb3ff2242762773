"""Dynamic loss scaling follows DeepSpeed's hysteresis and window rules."""

from __future__ import annotations

from shardwise.config import FP16Config
from shardwise.precision import DynamicLossScaler, NoLossScaler, StaticLossScaler, make_loss_scaler


def test_hysteresis_delays_the_first_halving():
    s = DynamicLossScaler(FP16Config(enabled=True, initial_scale_power=4, hysteresis=2))
    s.update(True)
    assert s.scale == 16  # first overflow is absorbed by hysteresis
    s.update(True)
    assert s.scale == 8
    s.update(True)
    assert s.scale == 4  # the budget is not refilled by halving


def test_window_doubles_after_clean_steps_and_refills_hysteresis():
    s = DynamicLossScaler(FP16Config(enabled=True, initial_scale_power=4, loss_scale_window=3, hysteresis=2))
    s.update(True)  # iteration 0 overflows (absorbed)
    scales = []
    for _ in range(6):
        s.update(False)
        scales.append(s.scale)
    assert scales == [16, 16, 32, 32, 32, 64]
    assert s.hysteresis_left == 2


def test_never_below_min_scale():
    s = DynamicLossScaler(FP16Config(enabled=True, initial_scale_power=1, hysteresis=1, min_loss_scale=1))
    for _ in range(5):
        s.update(True)
    assert s.scale == 1


def test_state_round_trip_and_factory():
    s = DynamicLossScaler(FP16Config(enabled=True))
    s.update(True)
    t = DynamicLossScaler(FP16Config(enabled=True))
    t.load_state_dict(s.state_dict())
    assert t.state_dict() == s.state_dict()
    assert isinstance(make_loss_scaler(FP16Config()), NoLossScaler)
    assert make_loss_scaler(FP16Config(enabled=True, loss_scale=128)).scale == 128
    assert isinstance(make_loss_scaler(FP16Config(enabled=True, loss_scale=128)), StaticLossScaler)
