from shardwise.config import ConfigError as DeepSpeedConfigError
from shardwise.config import parse_config as DeepSpeedConfig

# The `optimizer.type` names the engine builds itself (lower case); scripts compare `engine.optimizer_name()`
# with them. DeepSpeed 0.19.8 dropped the 1-bit optimizers and their three names; shardwise builds them (docs/guides/
# compressed-optimizers.md), so the names older scripts (DeepSpeedExamples' bing_bert) use are here.
ADAGRAD_OPTIMIZER = "adagrad"
ADAM_OPTIMIZER = "adam"
ADAMW_OPTIMIZER = "adamw"
LAMB_OPTIMIZER = "lamb"
ONEBIT_ADAM_OPTIMIZER = "onebitadam"
ZERO_ONE_ADAM_OPTIMIZER = "zerooneadam"
ONEBIT_LAMB_OPTIMIZER = "onebitlamb"
MUADAM_OPTIMIZER = "muadam"
MUADAMW_OPTIMIZER = "muadamw"
MUSGD_OPTIMIZER = "musgd"
LION_OPTIMIZER = "lion"
MUON_OPTIMIZER = "muon"
DEEPSPEED_OPTIMIZERS = [ADAGRAD_OPTIMIZER, ADAM_OPTIMIZER, ADAMW_OPTIMIZER, LAMB_OPTIMIZER, ONEBIT_ADAM_OPTIMIZER,
                        ONEBIT_LAMB_OPTIMIZER, ZERO_ONE_ADAM_OPTIMIZER, MUADAM_OPTIMIZER, MUADAMW_OPTIMIZER,
                        MUSGD_OPTIMIZER, LION_OPTIMIZER, MUON_OPTIMIZER]

__all__ = ["ADAGRAD_OPTIMIZER", "ADAMW_OPTIMIZER", "ADAM_OPTIMIZER", "DEEPSPEED_OPTIMIZERS", "DeepSpeedConfig",
           "DeepSpeedConfigError", "LAMB_OPTIMIZER", "LION_OPTIMIZER", "MUADAMW_OPTIMIZER", "MUADAM_OPTIMIZER",
           "MUON_OPTIMIZER", "MUSGD_OPTIMIZER", "ONEBIT_ADAM_OPTIMIZER", "ONEBIT_LAMB_OPTIMIZER",
           "ZERO_ONE_ADAM_OPTIMIZER"]
