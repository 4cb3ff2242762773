"""`deepspeed.utils.zero_to_fp32`: full fp32 weights from a (shardwise) checkpoint; also a script:
`python -m deepspeed.utils.zero_to_fp32 CHECKPOINT_DIR OUTPUT_DIR`."""

import sys

from shardwise.checkpoint.fp32 import (
    convert_zero_checkpoint_to_fp32_state_dict,
    convert_zero_checkpoint_to_state_dict,
    get_fp32_state_dict_from_zero_checkpoint,
    load_state_dict_from_zero_checkpoint,
    main,
)

__all__ = ["convert_zero_checkpoint_to_fp32_state_dict", "convert_zero_checkpoint_to_state_dict",
           "get_fp32_state_dict_from_zero_checkpoint", "load_state_dict_from_zero_checkpoint"]

if __name__ == "__main__":
    sys.exit(main())
