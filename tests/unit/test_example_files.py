"""scripts/example_files.py, what the make_*_example.py scripts write checkpoints with: a
checkpoint is whole or absent. An exception mid-write leaves nothing; a process killed
mid-write (SIGKILL: no clean-up runs) leaves only a hidden ``.NAME.partial`` folder that
rayeval's checkpoint globs skip, and the next run clears it and writes the checkpoint (issue
47: an interrupted scripts/make_vlm_example.py left partial checkpoints its glob matched)."""

import os
import signal
import subprocess
import sys

import pytest

from rayeval.io.checkpoints import expand_checkpoints
from support import script

example_files = script("example_files")
SCRIPTS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "scripts")


def save(folder: str, text: str) -> None:
    """A checkpoint folder of two files, as save_pretrained writes one."""
    os.makedirs(folder, exist_ok=True)
    for name in ("config.json", "model.safetensors"):
        with open(os.path.join(folder, name), "w") as f:
            f.write(text)


def matched(ckpts) -> list[str]:
    return [r.location for r in expand_checkpoints((f"{ckpts}/checkpoint-*",), allow_empty=True)]


def test_a_folder_is_renamed_into_place_whole(tmp_path):
    target = tmp_path / "ckpts" / "checkpoint-5"
    with example_files.whole(str(target)) as partial:
        save(partial, "new")
        assert partial == str(tmp_path / "ckpts" / ".checkpoint-5.partial" / "checkpoint-5")
        assert not target.exists() and matched(tmp_path / "ckpts") == []
    assert sorted(os.listdir(target)) == ["config.json", "model.safetensors"]
    assert os.listdir(tmp_path / "ckpts") == ["checkpoint-5"]


def test_an_earlier_checkpoint_of_the_name_is_replaced(tmp_path):
    target = tmp_path / "checkpoint-5"
    save(str(target), "old")
    (target / "stale.bin").write_text("from the earlier run")
    with example_files.whole(str(target)) as partial:
        save(partial, "new")
    assert sorted(os.listdir(target)) == ["config.json", "model.safetensors"]
    assert (target / "config.json").read_text() == "new"


def test_a_file_is_replaced_by_one_rename(tmp_path):
    target = tmp_path / "step_000010.pt"
    target.write_text("old")
    with example_files.whole(str(target)) as partial:
        with open(partial, "w") as f:
            f.write("new")
    assert target.read_text() == "new" and os.listdir(tmp_path) == ["step_000010.pt"]


def test_a_torch_save_is_the_bytes_of_a_direct_one(tmp_path):
    """torch.save names its archive's records after the file: the partial has the same name."""
    import torch

    state = {"w": torch.arange(6.0).reshape(2, 3)}
    torch.save(state, tmp_path / "direct.pt")
    os.mkdir(tmp_path / "ckpts")
    with example_files.whole(str(tmp_path / "ckpts" / "direct.pt")) as partial:
        torch.save(state, partial)
    assert (tmp_path / "ckpts" / "direct.pt").read_bytes() == (tmp_path / "direct.pt").read_bytes()


def test_an_exception_mid_write_leaves_nothing(tmp_path):
    target = tmp_path / "checkpoint-5"
    with pytest.raises(KeyboardInterrupt):
        with example_files.whole(str(target)) as partial:
            save(partial, "half")
            raise KeyboardInterrupt
    assert os.listdir(tmp_path) == []


KILLED_MID_WRITE = """
import os, sys, time
sys.path.insert(0, {scripts!r})
import example_files
with example_files.whole({target!r}) as partial:
    os.makedirs(partial)
    with open(os.path.join(partial, "config.json"), "w") as f:
        f.write("half")
    print("writing", flush=True)
    time.sleep(60)
"""


def test_a_run_killed_mid_write_leaves_no_checkpoint_and_a_rerun_writes_it(tmp_path):
    ckpts = tmp_path / "ckpts"
    target = str(ckpts / "checkpoint-5")
    proc = subprocess.Popen([sys.executable, "-c", KILLED_MID_WRITE.format(
        scripts=SCRIPTS, target=target)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "writing"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    assert os.listdir(ckpts) == [".checkpoint-5.partial"]       # hidden: not a checkpoint
    assert matched(ckpts) == [], "the glob skips what is still being written"
    with example_files.whole(target) as partial:          # the re-run
        save(partial, "whole")
    assert os.listdir(ckpts) == ["checkpoint-5"] and matched(ckpts) == [target]
    assert open(os.path.join(target, "config.json")).read() == "whole"


def test_clear_empties_the_checkpoint_folder(tmp_path):
    ckpts = tmp_path / "ckpts"
    save(str(ckpts / "checkpoint-120"), "from a run with other --steps")
    save(str(ckpts / ".checkpoint-660.partial"), "killed")
    example_files.clear(str(ckpts))
    assert os.listdir(ckpts) == []
