"""Tier 1: checkpoint discovery, layouts and failures (DCP written by two gloo ranks is in
tests/integration/test_dist.py)."""

import os
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file

from rayeval.io.checkpoints import CheckpointRef, expand_checkpoints, parse_epoch, parse_step
from rayeval.io.layouts import detect_format
from rayeval.io.loading import load_into, strip_prefixes
from rayeval.errors import CheckpointError, SpecError
from support import build_model


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("name,step,epoch", [
    ("step_000100.pt", 100, None), ("step_000600", 600, None), ("checkpoint-500", 500, None),
    ("epoch=3-step=1200.ckpt", 1200, 3), ("model_iter_42.safetensors", 42, None),
    ("global_step7", 7, None), ("final.pt", None, None), ("ckpt_1000.pt", 1000, None),
    # an epoch is not a step: a name with an epoch and no step word has no step
    ("run2_epoch5.pt", None, 5), ("epoch_8.pt", None, 8), ("epoch=8.ckpt", None, 8),
    ("epoch-3", None, 3), ("epoch3.pth", None, 3), ("EPOCH_12.bin", None, 12),
    ("step=40-epoch=1.ckpt", 40, 1), ("epochs.pt", None, None),
])
def test_parse_step_and_epoch(name, step, epoch):
    assert parse_step(f"/x/{name}") == step
    assert parse_epoch(f"/x/{name}") == epoch


def test_strip_prefixes():
    assert strip_prefixes("module._orig_mod.fc.weight") == "fc.weight"
    assert strip_prefixes("_orig_mod.module.fc.weight") == "fc.weight"
    assert strip_prefixes("enc._orig_mod.fc.weight") == "enc.fc.weight"


def test_expand_sorts_by_step_and_dedups(tmp_path):
    for name in ["step_10.pt", "step_2.pt", "step_100.safetensors", "other.bin"]:
        (tmp_path / name).write_bytes(b"x")
    (tmp_path / "step_5").mkdir()
    refs = expand_checkpoints((str(tmp_path / "step_*"), str(tmp_path / "step_2.pt")))
    assert [os.path.basename(r.location) for r in refs] == [
        "step_2.pt", "step_5", "step_10.pt", "step_100.safetensors"]
    assert refs[0] == CheckpointRef(str(tmp_path / "step_2.pt"), 2)


def test_expand_gives_epochs_and_orders_epoch_only_names_by_epoch(tmp_path):
    for name in ["epoch_10.pt", "epoch_8.pt", "epoch=2-step=50.ckpt", "last.pt"]:
        (tmp_path / name).write_bytes(b"x")
    refs = expand_checkpoints((str(tmp_path / "*"),))
    assert [(os.path.basename(r.location), r.step, r.epoch) for r in refs] == [
        ("epoch=2-step=50.ckpt", 50, 2), ("epoch_8.pt", None, 8), ("epoch_10.pt", None, 10),
        ("last.pt", None, None)]


def test_glob_matching_nothing_is_named(tmp_path):
    with pytest.raises(SpecError, match=r"checkpoints\[1\]: glob '.*nothing_\*' matches no file"):
        expand_checkpoints((str(tmp_path), str(tmp_path / "nothing_*")))


LAYOUTS = {
    "bare": lambda sd: sd,
    "model": lambda sd: {"model": sd, "step": 3},
    "state_dict": lambda sd: {"state_dict": sd, "epoch": 1},
    "model_state_dict": lambda sd: {"model_state_dict": sd, "optimizer_state_dict": {}},
    "ddp": lambda sd: {f"module.{k}": v for k, v in sd.items()},
    "compiled": lambda sd: {f"_orig_mod.{k}": v for k, v in sd.items()},
    "ddp_compiled_wrapped": lambda sd: {"model": {f"module._orig_mod.{k}": v
                                                  for k, v in sd.items()}},
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_torch_save_layouts(tmp_path, layout):
    source = build_model(seed=1)
    path = tmp_path / "ckpt.pt"
    torch.save(LAYOUTS[layout](source.state_dict()), path)
    target = build_model(seed=2)
    assert not same_weights(source, target)
    assert load_into(target, str(path)) == "torch"
    assert same_weights(source, target)


def test_legacy_torch_save_format(tmp_path):
    source = build_model(seed=1)
    path = tmp_path / "legacy.pt"
    torch.save(source.state_dict(), path, _use_new_zipfile_serialization=False)
    target = build_model(seed=2)
    load_into(target, str(path))
    assert same_weights(source, target)


def test_safetensors_detected_from_bytes_not_name(tmp_path):
    source = build_model(seed=1)
    path = tmp_path / "weights.bin"           # a misleading name
    save_file(source.state_dict(), str(path))
    target = build_model(seed=2)
    assert load_into(target, str(path)) == "safetensors"
    assert same_weights(source, target)


def test_dcp_single_process_with_optimizer_state(tmp_path):
    source = build_model(seed=1)
    opt = torch.optim.Adam(source.parameters())
    source(torch.zeros(2, 8)).sum().backward()
    opt.step()
    dcp.save({"model": source.state_dict(), "optim": opt.state_dict()},
             checkpoint_id=str(tmp_path / "step_9"), no_dist=True)
    target = build_model(seed=2)
    assert load_into(target, str(tmp_path / "step_9")) == "dcp"
    assert same_weights(source, target)


def test_checkpoint_that_does_not_fit_names_keys(tmp_path):
    sd = build_model(seed=1).state_dict()
    sd["2.weight"] = torch.zeros(5, 16)       # wrong shape
    del sd["2.bias"]                           # missing
    sd["head.weight"] = torch.zeros(1)         # unexpected
    torch.save(sd, tmp_path / "bad.pt")
    with pytest.raises(CheckpointError) as info:
        load_into(build_model(), str(tmp_path / "bad.pt"))
    msg = str(info.value)
    assert "1 missing key(s): 2.bias" in msg
    assert "1 unexpected key(s): head.weight" in msg
    assert "2.weight [5, 16] vs model [4, 16]" in msg


def test_dcp_that_does_not_fit_names_keys(tmp_path):
    big = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    dcp.save({"model": big.state_dict()}, checkpoint_id=str(tmp_path / "d"), no_dist=True)
    with pytest.raises(CheckpointError, match=r"0\.weight \[32, 8\] vs model \[16, 8\]"):
        load_into(build_model(), str(tmp_path / "d"))


@pytest.mark.parametrize("content,match", [
    (b"", "empty file"),
    (b"\x80\x02" + bytes(range(7, 207)), "corrupt"),
    (b"\x80\x04]\x94(K\x01.", "corrupt|not a state dict|holds a list"),
    (b"hello, I am a text file\n", "not a checkpoint"),
    (b"\x00" * 64, "not a checkpoint"),
])
def test_not_a_checkpoint(tmp_path, content, match):
    (tmp_path / "c.pt").write_bytes(content)
    with pytest.raises(CheckpointError, match=match):
        load_into(build_model(), str(tmp_path / "c.pt"))


def test_truncated_torch_save(tmp_path):
    torch.save(build_model().state_dict(), tmp_path / "c.pt")
    data = (tmp_path / "c.pt").read_bytes()
    (tmp_path / "c.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        load_into(build_model(), str(tmp_path / "c.pt"))


def test_truncated_safetensors(tmp_path):
    save_file(build_model().state_dict(), str(tmp_path / "c.safetensors"))
    data = (tmp_path / "c.safetensors").read_bytes()
    (tmp_path / "c.safetensors").write_bytes(data[:-100])
    with pytest.raises(CheckpointError, match="corrupt safetensors|truncated"):
        load_into(build_model(), str(tmp_path / "c.safetensors"))


def test_dcp_missing_shard_file(tmp_path):
    dcp.save({"model": build_model().state_dict()}, checkpoint_id=str(tmp_path / "d"),
             no_dist=True)
    os.remove(tmp_path / "d" / "__0_0.distcp")
    with pytest.raises(CheckpointError, match="cannot read torch.distributed.checkpoint"):
        load_into(build_model(), str(tmp_path / "d"))


def test_folder_that_is_not_dcp(tmp_path):
    (tmp_path / "step_3").mkdir()
    with pytest.raises(CheckpointError, match="folder without .metadata"):
        load_into(build_model(), str(tmp_path / "step_3"))




def _malicious_pickle(marker: str) -> bytes:
    # GLOBAL builtins.exec with source that creates the marker file; weights_only must refuse.
    code = f"open({marker!r}, 'w').write('pwned')"

    class Evil:
        def __reduce__(self):
            return (exec, (code,))

    return pickle.dumps({"model": Evil()}, protocol=2)


def test_malicious_pickle_is_refused_and_never_runs(tmp_path):
    marker = tmp_path / "pwned"
    (tmp_path / "evil.pt").write_bytes(_malicious_pickle(str(marker)))
    with pytest.raises(CheckpointError, match="refused: this pickle needs more than "
                                              "weights_only=True.*exec"):
        load_into(build_model(), str(tmp_path / "evil.pt"))
    assert not marker.exists()


def test_malicious_dcp_metadata_is_refused_and_never_runs(tmp_path):
    dcp.save({"model": build_model().state_dict()}, checkpoint_id=str(tmp_path / "d"),
             no_dist=True)
    marker = tmp_path / "pwned"
    (tmp_path / "d" / ".metadata").write_bytes(_malicious_pickle(str(marker)))
    with pytest.raises(CheckpointError, match=r"refused: its \.metadata pickle references "
                                              r"(__)?builtins?(__)?\.exec"):
        load_into(build_model(), str(tmp_path / "d"))
    assert not marker.exists()


def test_pickled_module_is_refused(tmp_path):
    torch.save(build_model(), tmp_path / "whole_model.pt")   # the whole nn.Module, pickled
    with pytest.raises(CheckpointError, match="refused"):
        load_into(build_model(), str(tmp_path / "whole_model.pt"))


def test_detect_format(tmp_path):
    torch.save({}, tmp_path / "a")
    save_file({"w": torch.zeros(1)}, str(tmp_path / "b"))
    assert detect_format(str(tmp_path / "a")) == "torch"
    assert detect_format(str(tmp_path / "b")) == "safetensors"
