"""The shipped examples. The vision example (scripts/make_vision_example.py, written into a
temporary folder) evaluated on a real local Ray equals a single-process reference computed here
with PIL and torch; a broken dataset.transform is a one-line error before any cluster starts;
the digits suite names files that exist."""

import glob
import importlib.util
import io
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
import yaml
from PIL import Image

from rayeval.execution.driver import run_sweep
from rayeval.plan.preflight import prepare
from rayeval.errors import RayevalError
from rayeval.ranking import latest_rows
from rayeval.plan.loader import load_sweep
from rayeval.io.store import ResultStore
from support import rayeval_cli

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DIGITS = os.path.join(REPO, "configs", "digits")


@pytest.fixture(scope="module")
def vision(tmp_path_factory):
    """The vision example as the script writes it, in a temporary folder."""
    out = tmp_path_factory.mktemp("vision")
    proc = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "make_vision_example.py"),
                           "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    return out


# --- the single-process reference: PNG bytes decoded with PIL, each checkpoint run in torch ---

def load_module(path, name):
    """A module from a file under its own name: the driver's import of `models` (sys.modules)
    must not be what the reference runs."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def decode_pngs(values) -> torch.Tensor:
    pixels = np.stack([np.array(Image.open(io.BytesIO(v)).convert("RGB")) for v in values])
    assert pixels.shape[1:] == (16, 16, 3) and pixels.dtype == np.uint8
    return torch.from_numpy(pixels.astype(np.float32) / 255).permute(0, 3, 1, 2)


def state_dict(path):
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        return load_file(path)
    return torch.load(path, weights_only=True)["model"]


def reference(folder, checkpoint, parquet, keywords):
    """accuracy (correct, rows) and nll of one checkpoint on one data set, in one batch."""
    table = pq.read_table(parquet)
    build = load_module(str(folder / "models.py"), "vision_models_reference").build_cnn
    model = build(channels=8).eval()
    model.load_state_dict(state_dict(checkpoint))
    image = decode_pngs(table.column("image").to_pylist())
    y = torch.tensor(table.column("label").to_pylist())
    with torch.no_grad():
        if keywords:
            brightness = torch.tensor(table.column("brightness").to_pylist(), dtype=torch.float32)
            logits = model(image=image, brightness=brightness)
        else:
            logits = model(image)
    nll = -torch.log_softmax(logits.double(), 1).gather(1, y.view(-1, 1)).mean().item()
    return int((logits.argmax(1) == y).sum()), len(y), nll


@pytest.mark.ray
def test_vision_example_on_two_workers_equals_a_single_process_reference(vision, ray_cluster):
    sweep = load_sweep(str(vision / "sweep.yaml"))
    assert sweep.workers == 2 and [e.name for e in sweep.evals] == ["shapes", "dim"]
    assert [e.dataset.transform for e in sweep.evals] == ["transforms:decode",
                                                          "transforms:decode_with_brightness"]
    report = run_sweep(sweep)
    assert len(report.outcomes) == 6 and not report.failures, report.failures
    rows = {(os.path.basename(r["checkpoint"]), r["evaluation"], r["metric"]): r
            for r in latest_rows(ResultStore(sweep.output).read())}
    checkpoints = sorted(glob.glob(str(vision / "ckpts" / "step_*")))
    assert [os.path.basename(c) for c in checkpoints] == [
        "step_000010.pt", "step_000040.pt", "step_000300.safetensors"]
    accuracies = []
    for evaluation, parquet, keywords in (("shapes", "shapes.parquet", False),
                                          ("dim", "dim.parquet", True)):
        for checkpoint in checkpoints:
            correct, n, nll = reference(vision, checkpoint, str(vision / "data" / parquet),
                                        keywords)
            name = os.path.basename(checkpoint)
            acc = rows[(name, evaluation, "accuracy")]
            assert acc["num_samples"] == n and acc["world_size"] == 2
            assert acc["value"] == correct / n, (name, evaluation)
            assert rows[(name, evaluation, "nll")]["value"] == pytest.approx(nll, rel=1e-6)
            accuracies.append(correct / n)
    assert accuracies[2] > 0.95 and accuracies[5] > 0.95, "the last checkpoint has learnt"
    assert accuracies[0] < 0.6, "the first has not: the example ranks something"


# --- a broken transform: one line naming evals[i].dataset.transform, before any cluster ---

BROKEN = '''
import torch
from transforms import decode


def explode(table):
    raise ValueError("cannot decode these bytes")


def one_row_short(table):
    return decode(table)[1:]


def scalar(table):
    return torch.tensor(1.0)


def short_keyword(table):
    return {"image": decode(table), "brightness": torch.ones(1)}
'''


def broken_sweep(vision, tmp_path, index, transform):
    """The vision example's sweep in tmp_path (data and checkpoints where the script wrote
    them), with evaluation ``index`` decoded by ``broken_transforms:<transform>``."""
    for name in ("models.py", "transforms.py"):
        shutil.copy(vision / name, tmp_path)
    (tmp_path / "broken_transforms.py").write_text(BROKEN)
    raw = yaml.safe_load((vision / "sweep.yaml").read_text())
    raw["checkpoints"] = [str(vision / "ckpts" / "step_*")]
    for e in raw["evals"]:
        e["dataset"]["path"] = str(vision / e["dataset"]["path"])
    raw["evals"][index]["dataset"]["transform"] = f"broken_transforms:{transform}"
    raw["output"] = str(tmp_path / "out")
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.mark.parametrize("index,transform,expected", [
    (0, "explode", r"evals\[0\]\.dataset\.transform: broken_transforms:explode raised "
                   r"ValueError: cannot decode these bytes$"),
    (0, "one_row_short", r"evals\[0\]\.dataset\.transform: broken_transforms:one_row_short "
                         r"returned shape \((\d+), 3, 16, 16\) for a batch of (?!\1 )\d+ rows"),
    (1, "scalar", r"evals\[1\]\.dataset\.transform: broken_transforms:scalar returned shape "
                  r"\(\) for a batch of \d+ rows"),
    (1, "short_keyword", r"evals\[1\]\.dataset\.transform: broken_transforms:short_keyword "
                         r"returned shape \(1,\) for 'brightness' for a batch of \d+ rows"),
], ids=["raises", "rows-short", "scalar", "keyword-rows-short"])
def test_a_broken_transform_is_one_line_before_ray(vision, tmp_path, index, transform, expected):
    """prepare() is everything `rayeval run` does before it starts Ray."""
    sweep = load_sweep(str(broken_sweep(vision, tmp_path, index, transform)))
    with pytest.raises(RayevalError) as info:
        prepare(sweep)
    message = str(info.value)
    assert re.match(expected, message), message
    assert "\n" not in message
    assert not (tmp_path / "out").exists(), "nothing written"


def test_the_command_line_prints_a_broken_transform_as_one_line(vision, tmp_path):
    sweep = broken_sweep(vision, tmp_path, 1, "explode")
    proc = rayeval_cli("run", str(sweep), cwd=str(tmp_path))
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "evals[1].dataset.transform: broken_transforms:explode raised ValueError" in lines[0]
    assert "worker group" not in proc.stderr, "no cluster was started"


# --- the shipped digits suite -----------------------------------------------------------------

def test_the_digits_suite_points_at_existing_files(tmp_path):
    sweep = load_sweep(os.path.join(DIGITS, "sweep.yaml"))
    assert [e.name for e in sweep.evals] == ["clean", "noisy"]
    rows = {}
    for e in sweep.evals:
        assert e.task == "classification"
        assert [m.key for m in e.metrics] == ["accuracy", "macro_f1", "nll"]
        assert os.path.isfile(e.dataset.path), e.dataset.path
        rows[e.name] = pq.ParquetFile(e.dataset.path).metadata.num_rows
    assert rows == {"clean": 1009, "noisy": 2003}
    assert len(glob.glob(os.path.join(DIGITS, "ckpts", "step_*"))) == 4
    # Everything the driver checks before Ray (columns, labels, the model on real rows).
    plan = prepare(sweep.replace(output=str(tmp_path / "out")))
    assert len(plan.cells) == 8 and not plan.failed
    # The single-evaluation sweeps beside it still load, on the noisy set.
    for name in ("sweep_metrics.yaml", "sweep_s3.yaml"):
        other = load_sweep(os.path.join(DIGITS, name))
        assert len(other.evals) == 1
        assert other.evals[0].dataset.path.endswith("eval.parquet")
