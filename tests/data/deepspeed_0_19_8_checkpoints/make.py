"""Write the DeepSpeed 0.19.8 checkpoints beside this file, which shardwise's own test suite reads without
DeepSpeed (tests/unit/test_checkpoint_deepspeed_files.py, tests/distributed/test_deepspeed_checkpoint_fixtures.py).

TinyNet (tests/parity.py) at world size 2, ZeRO 2 and ZeRO 3, fp32, AdamW + WarmupLR, 3 steps, then
`save_checkpoint(<stage dir>, client_state={"case": ...})`; then 3 more steps, whose losses go to
reference.json with DeepSpeed's own consolidation of the saved checkpoint (its
get_fp32_state_dict_from_zero_checkpoint) as `<stage dir>/fp32.safetensors`; and zero2_universal/, the ZeRO-2 one
converted by DeepSpeed's ds_to_universal.py. Run in .dsvenv, from the root:

    DS_ACCELERATOR=cpu PYTHONPATH=src:. .dsvenv/bin/python tests/data/deepspeed_0_19_8_checkpoints/make.py
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from tests.deepspeed_checkpoints import SAVED_AT, save_and_continue
from tests.harness import run_distributed

HERE = Path(__file__).parent
CASES = {"zero2": ({"stage": 2}, {}), "zero3": ({"stage": 3}, {})}


def main() -> None:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from safetensors.torch import save_file

    for case in CASES:
        shutil.rmtree(HERE / case, ignore_errors=True)
    after = run_distributed(save_and_continue, 2, "deepspeed", str(HERE), CASES, timeout=600)[0]
    for case in CASES:
        (HERE / case / "zero_to_fp32.py").unlink(missing_ok=True)  # DeepSpeed's script: not ours to ship
        (HERE / case / "zero_to_torch.py").unlink(missing_ok=True)
        weights = get_fp32_state_dict_from_zero_checkpoint(str(HERE / case))
        save_file({k: v.contiguous() for k, v in weights.items()}, str(HERE / case / "fp32.safetensors"))
    # DeepSpeed's universal form of the ZeRO-2 one, as its ds_to_universal.py writes it
    shutil.rmtree(HERE / "zero2_universal", ignore_errors=True)
    subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--inject_missing_state",
                    "--input_folder", str(HERE / "zero2" / f"global_step{SAVED_AT}"),
                    "--output_folder", str(HERE / "zero2_universal" / f"global_step{SAVED_AT}_universal")], check=True)
    (HERE / "reference.json").write_text(json.dumps({"deepspeed": "0.19.8", "world_size": 2, "saved_at": SAVED_AT,
                                                     "losses_after": after}, indent=1) + "\n")


if __name__ == "__main__":
    main()
