"""Tier 1: checkpoint layouts written by their real writers (torch.save, safetensors,
huggingface_hub's sharded writer, DCP), Lightning-like dicts, DeepSpeed folders, trusted
pickles, lean loading and `rayeval inspect`."""

import argparse
import json
import os

import pytest
import torch
from safetensors.torch import save_file

from rayeval.errors import CheckpointError
from rayeval.layouts import read
from rayeval.loading import CheckpointSpec, LeanLoader, describe, load_into
from support import build_model, rayeval_cli, write_model_module, write_sweep


def same(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k].float(), sb[k].float()) for k in sa)


def lightning_ckpt(path, sd, attr="model", step=1234):
    """What Lightning's trainer.save_checkpoint writes, for a LightningModule holding the
    network as ``self.<attr>``."""
    torch.save({"epoch": 2, "global_step": step, "pytorch-lightning_version": "2.4.0",
                "state_dict": {f"{attr}.{k}": v for k, v in sd.items()},
                "loops": {}, "callbacks": {},
                "optimizer_states": [{"state": {}, "param_groups": [{"lr": 0.1}]}],
                "lr_schedulers": []}, path)


def test_lightning_checkpoint_gives_its_global_step(tmp_path):
    src = build_model(seed=1)
    lightning_ckpt(tmp_path / "epoch=2-step=99.ckpt", src.state_dict())
    raw = read(str(tmp_path / "epoch=2-step=99.ckpt"))
    assert raw.layout == "lightning" and raw.step == 1234
    target = build_model(seed=2)
    load_into(target, str(tmp_path / "epoch=2-step=99.ckpt"))
    assert same(src, target)


@pytest.mark.parametrize("attr", ["net", "model"])
def test_lightning_attribute_prefix_combined_with_compile_and_ddp(tmp_path, attr):
    src = build_model(seed=1)
    sd = {f"module._orig_mod.{k}": v for k, v in src.state_dict().items()}
    lightning_ckpt(tmp_path / "c.ckpt", sd, attr=attr)
    target = build_model(seed=2)
    load_into(target, str(tmp_path / "c.ckpt"))
    assert same(src, target)


def test_explicit_strip_prefix(tmp_path):
    src = build_model(seed=1)
    torch.save({f"encoder.backbone.{k}": v for k, v in src.state_dict().items()},
               tmp_path / "c.pt")
    target = build_model(seed=2)
    load_into(target, str(tmp_path / "c.pt"), CheckpointSpec(strip_prefix="encoder.backbone."))
    assert same(src, target)


def test_ema_and_key_path(tmp_path):
    plain, ema = build_model(seed=1), build_model(seed=3)
    torch.save({"model": plain.state_dict(), "ema": ema.state_dict()}, tmp_path / "c.pt")
    target = build_model(seed=2)
    load_into(target, str(tmp_path / "c.pt"))
    assert same(plain, target)                              # default: "model" first
    load_into(target, str(tmp_path / "c.pt"), CheckpointSpec(key="ema"))
    assert same(ema, target)
    torch.save({"trainer": {"averaged": ema.state_dict()}}, tmp_path / "d.pt")
    load_into(target, str(tmp_path / "d.pt"), CheckpointSpec(key="trainer.averaged"))
    assert same(ema, target)
    with pytest.raises(CheckpointError, match="checkpoint.key: nothing under 'nope'"):
        load_into(target, str(tmp_path / "d.pt"), CheckpointSpec(key="nope"))
    torch.save({"module": ema.state_dict()}, tmp_path / "e.pt")
    load_into(target, str(tmp_path / "e.pt"))
    assert same(ema, target)


@pytest.mark.parametrize("safe", [True, False], ids=["safetensors", "pytorch_model.bin"])
def test_hugging_face_sharded_folders(tmp_path, safe):
    from huggingface_hub import save_torch_state_dict

    src = build_model(seed=1, hidden=64)
    save_torch_state_dict(src.state_dict(), tmp_path, max_shard_size=1500,
                          safe_serialization=safe)
    index = "model.safetensors.index.json" if safe else "pytorch_model.bin.index.json"
    assert (tmp_path / index).exists()
    assert len(json.loads((tmp_path / index).read_text())["weight_map"]) == 4
    raw = read(str(tmp_path))
    assert raw.layout == ("safetensors-sharded" if safe else "torch-sharded")
    assert len(raw.files) >= 3                                # the index and 2+ shards
    target = build_model(seed=2, hidden=64)
    load_into(target, str(tmp_path))
    assert same(src, target)


def test_single_pytorch_model_bin_folder_and_ray_like_folder(tmp_path):
    src = build_model(seed=1)
    (tmp_path / "hf").mkdir()
    torch.save(src.state_dict(), tmp_path / "hf" / "pytorch_model.bin")
    (tmp_path / "hf" / "config.json").write_text("{}")
    target = build_model(seed=2)
    assert load_into(target, str(tmp_path / "hf")) == "torch"
    assert same(src, target)
    (tmp_path / "two").mkdir()
    torch.save(src.state_dict(), tmp_path / "two" / "a.pt")
    torch.save(src.state_dict(), tmp_path / "two" / "b.pt")
    with pytest.raises(CheckpointError, match=r"holds several checkpoints \(a.pt, b.pt\)"):
        load_into(target, str(tmp_path / "two"))


def test_deepspeed_zero_folder_is_refused_with_the_conversion(tmp_path):
    # The files DeepSpeed's ZeRO stage 2/3 engine.save_checkpoint writes (DeepSpeed itself
    # does not install here).
    step = tmp_path / "global_step100"
    step.mkdir()
    torch.save({}, step / "mp_rank_00_model_states.pt")
    torch.save({}, step / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    (tmp_path / "latest").write_text("global_step100")
    (tmp_path / "zero_to_fp32.py").write_text("# DeepSpeed's conversion script\n")
    with pytest.raises(CheckpointError, match="DeepSpeed ZeRO checkpoint .* zero_to_fp32.py"):
        load_into(build_model(), str(tmp_path))
    with pytest.raises(CheckpointError, match="DeepSpeed ZeRO"):
        load_into(build_model(), str(step))


def test_trust_pickle_loads_a_pickle_that_needs_more_with_a_warning(tmp_path, caplog):
    src = build_model(seed=1)
    torch.save({"model": src.state_dict(), "args": argparse.Namespace(lr=0.1)},
               tmp_path / "c.pt")
    with pytest.raises(CheckpointError, match=r"refused: .*argparse.Namespace.*"
                                              r"checkpoint.trust_pickle: true"):
        load_into(build_model(), str(tmp_path / "c.pt"))
    target = build_model(seed=2)
    with pytest.warns(UserWarning, match="trusting the pickle"):
        load_into(target, str(tmp_path / "c.pt"), CheckpointSpec(trust_pickle=True))
    assert same(src, target)
    assert "checkpoint.trust_pickle: loading" in caplog.text


@pytest.mark.parametrize("fmt", ["pt", "safetensors"])
def test_lean_loader_assigns_the_mapped_tensors_without_a_copy(tmp_path, fmt):
    src = build_model(seed=1)
    path = str(tmp_path / f"c.{fmt}")
    if fmt == "pt":
        torch.save(src.state_dict(), path)
    else:
        save_file(src.state_dict(), path)
    loader = LeanLoader(lambda: build_model(seed=5), torch.device("cpu"))
    model, raw = loader.load(path)
    assert same(src, model)
    for k, v in model.state_dict().items():
        assert v.data_ptr() == raw.tensors[k].data_ptr(), k     # the checkpoint's memory


class WithBuffer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 4)
        self.register_buffer("scale", torch.full((4,), 3.0), persistent=False)

    def forward(self, x):
        return self.fc(x) * self.scale


def test_lean_loader_keeps_non_persistent_buffers_and_casts_dtypes(tmp_path):
    src = WithBuffer()
    torch.save({k: v.to(torch.bfloat16) for k, v in src.state_dict().items()}, tmp_path / "c.pt")
    model, _ = LeanLoader(WithBuffer, torch.device("cpu")).load(str(tmp_path / "c.pt"))
    assert model.fc.weight.dtype == torch.float32              # the model's own dtype
    assert torch.equal(model.scale, torch.full((4,), 3.0))
    model16, _ = LeanLoader(WithBuffer, torch.device("cpu"), torch.bfloat16).load(
        str(tmp_path / "c.pt"))
    assert model16.fc.weight.dtype == torch.bfloat16
    assert model16(torch.ones(2, 8, dtype=torch.bfloat16)).shape == (2, 4)


def test_describe_and_inspect_command(tmp_path):
    write_model_module(str(tmp_path))
    (tmp_path / "ckpts").mkdir()
    sd = build_model(seed=1).state_dict()
    lightning_ckpt(tmp_path / "ckpts" / "step_7.ckpt", sd)
    info = describe(str(tmp_path / "ckpts" / "step_7.ckpt"))
    assert info["layout"] == "lightning" and info["step"] == 1234 and info["tensors"] == 4
    assert info["parameters"] == sum(v.numel() for v in sd.values())
    assert info["dtypes"] == {"float32": info["parameters"]}
    sweep = write_sweep(str(tmp_path), checkpoints=["ckpts/*"])
    proc = rayeval_cli("inspect", str(tmp_path / "ckpts" / "step_7.ckpt"), "--sweep", sweep,
                       "--format", "json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["fits"] and out["prefixes_stripped"] == ["model."]
    bigger = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    torch.save(bigger.state_dict(), tmp_path / "ckpts" / "wide.pt")
    proc = rayeval_cli("inspect", str(tmp_path / "ckpts" / "wide.pt"), "--sweep", sweep)
    assert proc.returncode == 1 and "shape mismatch" in proc.stdout
    assert "0.weight" in proc.stdout
    table = rayeval_cli("inspect", str(tmp_path / "ckpts" / "step_7.ckpt"))
    assert table.returncode == 0 and "lightning" in table.stdout and "1234 (from the file)" \
        in table.stdout
    missing = rayeval_cli("inspect", str(tmp_path / "nothing.pt"))
    assert missing.returncode == 2 and missing.stderr.startswith("error: PATH: no checkpoint")
