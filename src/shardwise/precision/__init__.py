"""Mixed precision: the dtype policy, the loss scalers and `torch_autocast` (`autocast.py`)."""

from .loss_scaler import DynamicLossScaler, LossScaler, NoLossScaler, StaticLossScaler, make_loss_scaler
from .policy import PrecisionPolicy

__all__ = ["DynamicLossScaler", "LossScaler", "NoLossScaler", "PrecisionPolicy", "StaticLossScaler", "make_loss_scaler"]
