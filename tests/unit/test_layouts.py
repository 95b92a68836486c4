"""Tier 1: checkpoint layouts written by their real writers (torch.save, safetensors,
huggingface_hub's sharded writer, DCP), Lightning-like dicts, DeepSpeed folders, trusted
pickles, lean loading and `rayeval inspect`."""

import argparse
import json

import pytest
import torch
from safetensors.torch import save_file

from rayeval.errors import CheckpointError
from rayeval.io.layouts import read
from rayeval.io.loading import CheckpointSpec, LeanLoader, describe, load_into
from support import build_model, lightning_ckpt, rayeval_main, write_model_module, write_sweep


def same(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k].float(), sb[k].float()) for k in sa)


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
    proc = rayeval_main("inspect", str(tmp_path / "ckpts" / "step_7.ckpt"), "--sweep", sweep,
                        "--format", "json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["fits"] and out["prefixes_stripped"] == ["model."]
    bigger = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    torch.save(bigger.state_dict(), tmp_path / "ckpts" / "wide.pt")
    proc = rayeval_main("inspect", str(tmp_path / "ckpts" / "wide.pt"), "--sweep", sweep)
    assert proc.returncode == 1 and "shape mismatch" in proc.stdout
    assert "0.weight" in proc.stdout
    table = rayeval_main("inspect", str(tmp_path / "ckpts" / "step_7.ckpt"))
    assert table.returncode == 0 and "lightning" in table.stdout and "1234 (from the file)" \
        in table.stdout
    missing = rayeval_main("inspect", str(tmp_path / "nothing.pt"))
    assert missing.returncode == 2 and missing.stderr.startswith("error: PATH: no checkpoint")


def inspect_in_process(monkeypatch, capsys, *args):
    """`rayeval inspect` through the console script's main(), in this process: it starts no
    Ray, and a subprocess would only add interpreter start-up."""
    import sys

    from rayeval.ui.cli import main

    monkeypatch.setattr(sys, "path", list(sys.path))          # the factory's folder is added
    sys.modules.pop("tiny_models", None)
    code = main(["inspect", *args])
    return code, capsys.readouterr().out


def table_row(out: str, name: str) -> str:
    """The value of one row of inspect's table (the first line of it)."""
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip("│ ").split("│")]
        if cells and cells[0] == name:
            return cells[1]
    raise AssertionError(f"no row {name!r} in:\n{out}")


@pytest.mark.parametrize("wrap,prefixes", [
    (lambda sd: {f"module.{k}": v for k, v in sd.items()}, ["module."]),
    (lambda sd: {f"module._orig_mod.{k}": v for k, v in sd.items()}, ["module.", "_orig_mod."]),
    (lambda sd: {"model": {f"_orig_mod.{k}": v for k, v in sd.items()}, "step": 3},
     ["_orig_mod."]),
    (lambda sd: sd, []),
])
def test_inspect_reports_the_same_prefixes_with_and_without_a_model(
        tmp_path, monkeypatch, capsys, wrap, prefixes):
    write_model_module(str(tmp_path))
    (tmp_path / "ckpts").mkdir()
    torch.save(wrap(build_model(seed=1).state_dict()), tmp_path / "ckpts" / "step_3.pt")
    path = str(tmp_path / "ckpts" / "step_3.pt")
    sweep = write_sweep(str(tmp_path))
    plain = describe(path)
    fitted = describe(path, build_model(), CheckpointSpec())
    assert plain["prefixes_stripped"] == fitted["prefixes_stripped"] == prefixes
    assert plain["wrapper"] == fitted["wrapper"] and fitted["fits"]
    code, alone = inspect_in_process(monkeypatch, capsys, path)
    assert code == 0
    code, with_model = inspect_in_process(monkeypatch, capsys, path, "--sweep", sweep)
    assert code == 0, with_model
    labels = {"module.": "module. (DDP)", "_orig_mod.": "_orig_mod. (torch.compile)"}
    shown = ", ".join(labels[p] for p in prefixes) or "none"
    assert table_row(alone, "prefixes") == table_row(with_model, "prefixes") == shown
    assert table_row(alone, "state dict under") == table_row(with_model, "state dict under")


def test_inspect_lists_a_files_own_name_and_a_folders_files_inside_it(
        tmp_path, monkeypatch, capsys):
    sd = build_model(seed=1).state_dict()
    save_file({k: v.contiguous() for k, v in sd.items()}, tmp_path / "epoch=3.safetensors")
    code, out = inspect_in_process(monkeypatch, capsys, str(tmp_path / "epoch=3.safetensors"))
    assert code == 0
    assert table_row(out, "files") == "epoch=3.safetensors"
    assert table_row(out, "step") == "-" and table_row(out, "epoch") == "3 (from the name)"
    folder = tmp_path / "ray_checkpoint"
    folder.mkdir()
    torch.save(sd, folder / "epoch=2-step=1200.pt")
    code, out = inspect_in_process(monkeypatch, capsys, str(folder))
    assert code == 0 and table_row(out, "files") == "epoch=2-step=1200.pt"
    info = describe(str(folder / "epoch=2-step=1200.pt"))
    assert (info["step"], info["epoch"]) == (1200, 2)
    code, out = inspect_in_process(monkeypatch, capsys, str(tmp_path / "epoch=3.safetensors"),
                                   "--format", "json")
    assert code == 0 and json.loads(out)["epoch"] == 3


def test_inspect_labels_the_lightning_attribute_it_strips(tmp_path, monkeypatch, capsys):
    write_model_module(str(tmp_path))
    (tmp_path / "ckpts").mkdir()
    lightning_ckpt(tmp_path / "ckpts" / "epoch=2-step=99.ckpt", build_model(seed=1).state_dict())
    path = str(tmp_path / "ckpts" / "epoch=2-step=99.ckpt")
    code, out = inspect_in_process(monkeypatch, capsys, path, "--sweep",
                                   write_sweep(str(tmp_path)))
    assert code == 0
    assert table_row(out, "prefixes").startswith("model. (shared by every key")
    assert table_row(out, "state dict under") == "state_dict"
    code, out = inspect_in_process(monkeypatch, capsys, path)      # no model: it cannot know
    assert table_row(out, "prefixes") == "none"
    assert table_row(out, "step") == "1234 (from the file)"
    assert table_row(out, "epoch") == "2 (from the name)"


def test_a_registered_detector_is_asked_before_the_built_in_layouts(tmp_path):
    # How a plugin adds a layout (docs/plugins.md): a detector naming its files, a reader.
    from rayeval.io import layouts
    from rayeval.io.layouts import from_tensors

    path = tmp_path / "weights.txt"
    path.write_text("w 1.5 2.5\n")
    saved = dict(layouts.DETECTORS._items), dict(layouts.READERS._items)
    try:
        layouts.DETECTORS.add("text", lambda p: "text" if p.endswith(".txt") else None)
        layouts.READERS.add("text", lambda src: from_tensors("text", src.path, {
            line.split()[0]: torch.tensor([float(v) for v in line.split()[1:]])
            for line in open(src.target)}))
        raw = layouts.read(str(path))
        assert raw.layout == "text" and raw.tensors["w"].tolist() == [1.5, 2.5]
        assert layouts.detect_format(str(path)) == "text"
    finally:
        layouts.DETECTORS._items, layouts.READERS._items = saved
    with pytest.raises(CheckpointError, match="not a checkpoint"):
        layouts.read(str(path))
