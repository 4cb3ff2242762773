"""A folder DeepSpeed wrote, pointed at where a shardwise checkpoint is expected: recognised by its file names
(never unpickled: the files here are not even pickles) and refused with what it is and what to do instead.

The names are those DeepSpeed 0.19.8 wrote for TinyNet at world size 2 (stages 0-3, bf16 at stage 1, and a
two-stage PipelineModule), listed from a run of the real DeepSpeed in .dsvenv.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from shardwise.checkpoint import CheckpointError
from shardwise.checkpoint.reader import CheckpointReader

ZERO2 = ["mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
         "zero_pp_rank_1_mp_rank_00_optim_states.pt"]
ZERO3 = ["zero_pp_rank_0_mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
         "zero_pp_rank_1_mp_rank_00_model_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"]
BF16 = ["bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt", "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt",
        "mp_rank_00_model_states.pt"]
STAGE0 = ["mp_rank_00_model_states.pt"]
PIPE = ["layer_00-model_states.pt", "layer_01-model_states.pt", "layer_02-model_states.pt",
        "layer_03-model_states.pt", "mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt"]
NOT_YET = "not a shardwise one; shardwise cannot read DeepSpeed checkpoints yet."


def deepspeed_folder(root: Path, names: list[str], tags=("global_step3", "global_step5"), latest="global_step5",
                     script: bool = True) -> Path:
    for tag in tags:
        (root / tag).mkdir(parents=True)
        for name in names:
            (root / tag / name).write_bytes(b"not a pickle")  # opening one would fail: names must suffice
    if latest is not None:
        (root / "latest").write_text(latest)
    if script:
        (root / "zero_to_fp32.py").write_text("# DeepSpeed's script\n")
    return root


def _refusal(load_dir: Path, tag: str | None = None) -> str:
    with pytest.raises(CheckpointError) as info:
        CheckpointReader(load_dir, tag)
    return str(info.value)


@pytest.mark.parametrize("names", [ZERO2, ZERO3, BF16], ids=["zero2", "zero3", "bf16"])
def test_a_zero_checkpoint_points_at_deepspeeds_zero_to_fp32(tmp_path, names):
    root = deepspeed_folder(tmp_path, names)
    message = _refusal(root)
    assert message.startswith(f"{root / 'global_step5'}: a DeepSpeed checkpoint (global_step5/ holds {names[0]}, ")
    assert NOT_YET in message and "manifest.json" not in message
    assert f"`python {root / 'zero_to_fp32.py'} {root} <output_dir> --safe_serialization`" in message
    assert "where DeepSpeed itself is installed" in message and "before shardwise.initialize" in message
    assert ("Or, without DeepSpeed, load the 'module' entry" in message) is (names is not ZERO3)  # whole below stage 3
    # A tag that `latest` does not name, asked for or pointed at: DeepSpeed's script needs it as --tag.
    for refused in (_refusal(root, "global_step3"), _refusal(root / "global_step3")):
        assert f"{root} <output_dir> --tag global_step3 --safe_serialization" in refused


def test_a_save_directory_without_latest_or_script(tmp_path):
    root = deepspeed_folder(tmp_path, ZERO2, tags=("global_step9", "global_step10"), latest=None, script=False)
    message = _refusal(root)
    assert message.startswith(f"{root}: a DeepSpeed checkpoint (global_step10/ holds mp_rank_00_model_states.pt, ")
    assert "`python DeepSpeed's deepspeed/utils/zero_to_fp32.py " in message and "--tag global_step10" in message


def test_stage0_and_pipeline_checkpoints_say_where_the_weights_are(tmp_path):
    stage0 = _refusal(deepspeed_folder(tmp_path / "s0", STAGE0, script=False))
    assert NOT_YET in stage0 and "zero_to_fp32" not in stage0
    assert f"load the 'module' entry of {tmp_path / 's0' / 'global_step5' / 'mp_rank_00_model_states.pt'}" in stage0
    pipe = _refusal(deepspeed_folder(tmp_path / "pipe", PIPE, script=False))
    assert ("(global_step5/ holds layer_00-model_states.pt, layer_01-model_states.pt, layer_02-model_states.pt, ...)"
            in pipe)
    assert "load each layer_XX-model_states.pt (the state dict of the PipelineModule's layer XX" in pipe


def test_other_folders_keep_their_messages(tmp_path):
    (tmp_path / "global_step1").mkdir()
    (tmp_path / "global_step1" / "model_states.pt").write_bytes(b"")  # not a name DeepSpeed writes
    (tmp_path / "latest").write_text("global_step1")
    assert _refusal(tmp_path).endswith("manifest.json: missing; "
                                       f"{tmp_path / 'global_step1'} is not a complete shardwise checkpoint.")
    (tmp_path / "latest").unlink()
    assert _refusal(tmp_path).startswith(f"{tmp_path / 'latest'}: no 'latest' file")
