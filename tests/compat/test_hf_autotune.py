"""`deepspeed --autotuning tune` on a Hugging Face Trainer script, as DeepSpeed's autotuning README shows it: the
config keeps Hugging Face's "auto" values, lists the space, and maps the micro-batch and accumulation keys to the
script's own flags (`arg_mappings`); each experiment stops inside `trainer.train()` after its timed steps."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.compat.run import ROOT, SCRIPTS
from tests.rank_zygote import HF_PRELOAD, routing


def test_the_deepspeed_command_tunes_a_trainer_script(tmp_path: Path) -> None:
    config = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": [2], "gradient_accumulation_steps": "auto",
              "gradient_clipping": "auto", "fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"},
              "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": "auto",
                                    "stage3_param_persistence_threshold": "auto", "reduce_bucket_size": "auto",
                                    "offload_optimizer": {"device": "none"}, "offload_param": {"device": "none"}},
              "autotuning": {"enabled": True, "start_profile_step": 2, "end_profile_step": 3, "arg_mappings": {
                  "train_micro_batch_size_per_gpu": "--per_device_train_batch_size",
                  "gradient_accumulation_steps": "--gradient_accumulation_steps"}}}
    (tmp_path / "ds.json").write_text(json.dumps(config))
    deepspeed = [sys.executable, "-c", "import sys; from shardwise.cli import deepspeed_main; "
                 "sys.exit(deepspeed_main())"]
    command = [*deepspeed, "--autotuning", "tune", "--num_gpus", "1", str(SCRIPTS / "hf_trainer.py"), "--deepspeed",
               "ds.json", "--out", str(tmp_path / "out"), "--base", str(tmp_path / "base"), "--steps", "20",
               "--per_device_train_batch_size", "1", "--gradient_accumulation_steps", "1"]
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}:{ROOT}", "OMP_NUM_THREADS": "1", **routing(HF_PRELOAD)}
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    results = json.loads((tmp_path / "autotuning_results" / "results.json").read_text())
    ok = {e["name"]: e for e in results["experiments"] if e["status"] == "ok"}
    assert "z3_tmbspg2_gas1" in ok and ok["z3_tmbspg2_gas1"]["figures"]["timed_steps"] == 2
    command_txt = (tmp_path / "autotuning_results" / "z3_tmbspg2_gas1" / "cmd.txt").read_text()
    assert "--per_device_train_batch_size 2 --gradient_accumulation_steps 1" in command_txt
    for name in ok:  # each stopped inside trainer.train(), before the script's end
        assert "RESULT" not in (tmp_path / "autotuning_results" / name / "stdout.log").read_text()
    optimal = json.loads((tmp_path / "autotuning_results" / "ds_config_optimal.json").read_text())
    assert optimal["bf16"] == {"enabled": "auto"} and optimal["train_micro_batch_size_per_gpu"] == 2
