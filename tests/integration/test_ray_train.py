"""Evaluating while training: ``rayeval.validation_config`` on a real Ray Train
``TorchTrainer`` whose loop reports checkpoints with ``validation=True``, on one local Ray.

One training fit serves the Ray tests (each fit costs 20-30 s here, and each validation runs
rayeval's own worker group on the same cluster): two reported checkpoints, the first truncated,
the second good under Ray's dated default name with its step passed in fn_kwargs.
The cheap tests before it check the options and how the checkpoint and its step are found.
"""

import json
import os
import subprocess
import sys
import tempfile

import pytest
import torch

import rayeval
from rayeval.errors import CheckpointError, SpecError
from rayeval.ranking import latest_rows
from rayeval.integrations.ray_train import RayevalValidation, validation_config
from rayeval.plan.loader import load_sweep
from rayeval.io.store import ResultStore
from support import make_data, write_model_module, write_parquet

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS = (10, 20)
BROKEN = 10                 # its model.pt is truncated


def write_sweep(folder, **extra) -> str:
    """One evaluation: each one's Ray Data pipeline costs seconds in every run here (suites
    and the aggregate are checked on a written store below)."""
    import yaml

    spec = {"name": "rt", "model": {"factory": "tiny_models:build"},
            "checkpoints": "model.pt",           # the file inside each reported checkpoint
            "evals": [{"name": "val", "task": "classification",
                       "dataset": {"path": "val.parquet", "inputs": "x", "target": "y",
                                   "id": "row"},
                       "metrics": ["accuracy", "nll", "confusion_matrix"]}],
            "bootstrap": {"replicates": 50}, "batch_size": 64, "workers": 1,
            "output": "store", **extra}
    path = os.path.join(folder, "sweep.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(spec, f)
    return path


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ray_train")
    write_model_module(str(folder))
    x, y = make_data(301, seed=1)                  # 301: no worker count divides it
    write_parquet(str(folder / "val.parquet"), x, y)
    return folder, write_sweep(str(folder))


# --- cheap: options, the checkpoint inside a folder, its step ---------------------------------

def test_import_is_lazy_and_validation_config_is_a_public_name():
    code = ("import json, sys, rayeval; f = rayeval.validation_config; rayeval.RayevalValidation; "
            "print(json.dumps([f.__module__] + [x in sys.modules for x in ('torch', 'ray')]))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == ["rayeval.integrations.ray_train", False, False]
    assert {"validation_config", "RayevalValidation"} <= set(dir(rayeval))


def test_options_override_the_sweep_and_bad_ones_fail_with_the_option_named(project, tmp_path):
    folder, path = project
    config = validation_config(path, workers=2, use_gpu=False, output=str(tmp_path / "o"),
                               resources_per_worker={"CPU": 1, "cheap_gpu": 0.5},
                               timeout_s=120, ray_remote_kwargs={"max_retries": 0})
    fn = config.fn
    assert isinstance(fn, RayevalValidation)
    assert (fn.sweep.workers, fn.sweep.output) == (2, str(tmp_path / "o"))
    assert dict(fn.sweep.resources_per_worker) == {"CPU": 1.0, "cheap_gpu": 0.5}
    assert fn.pattern == "model.pt"                   # the sweep's bare name, inside folders
    assert config.task_config.timeout_s == 120 and config.task_config.fn_kwargs == {}
    assert config.ray_remote_kwargs == {"num_cpus": 0, "max_retries": 0}
    assert validation_config(path, checkpoint_name="*.safetensors", check=False).fn.pattern \
        == "*.safetensors"
    sweep = load_sweep(path).replace(checkpoints=(str(folder / "ckpts" / "step_*"),))
    assert validation_config(sweep, check=False).fn.pattern is None   # for `rayeval run`

    for kwargs, key in [({"workers": 0}, "--workers"), ({"timeout_s": 0}, "timeout_s"),
                        ({"resources_per_worker": {"GPU": "one"}}, "resources_per_worker"),
                        ({"use_gpu": True, "resources_per_worker": {"GPU": 0}},
                         "resources_per_worker"),
                        ({"checkpoint_name": "../model.pt"}, "checkpoint_name"),
                        ({"step_key": "n", "epoch_key": "n"}, "step_key")]:
        with pytest.raises(SpecError, match=key):
            validation_config(path, check=False, **kwargs)
    write_model_module(str(tmp_path))
    bad = write_sweep(str(tmp_path), evals=[
        {"name": "v", "task": "classification", "metrics": ["accuracy"],
         "dataset": {"path": str(folder / "val.parquet"), "inputs": "nope", "target": "y"}}])
    with pytest.raises(rayeval.DataError, match="nope"):        # checked before training
        validation_config(bad)

def test_the_checkpoint_inside_a_reported_folder_and_its_step(project, tmp_path):
    _, path = project
    fn = validation_config(path, check=False).fn
    dated = tmp_path / "checkpoint_2026-01-02_03-04-05.678901"
    dated.mkdir()
    (dated / "model.pt").write_bytes(b"x")
    (dated / "optimizer.pt").write_bytes(b"x")
    assert fn.locate(str(dated)) == str(dated / "model.pt")
    # Ray's dated folder names carry no step: the one passed in fn_kwargs, else none
    assert fn.ref(str(dated / "model.pt"), None, None).step is None
    assert fn.ref(str(dated / "model.pt"), 30, None).step == 30
    named = tmp_path / "epoch=2-step=400"
    named.mkdir()
    (named / "model.pt").write_bytes(b"x")
    ref = fn.ref(fn.locate(str(named)), None, None)
    assert (ref.step, ref.epoch) == (400, 2)
    (named / "model_v2.pt").write_bytes(b"x")            # the folder's name wins over the file's
    assert fn.ref(str(named / "model_v2.pt"), None, None).step == 400
    assert fn.ref(str(dated / "model_300.pt"), None, None).step == 300
    assert fn.ref(str(named / "model.pt"), 7, 1).step == 7          # fn_kwargs win
    with pytest.raises(CheckpointError, match="no checkpoint.*'model.pt'.*checkpoint_name"):
        fn.locate(str(tmp_path))
    several = validation_config(path, check=False, checkpoint_name="*.pt").fn
    with pytest.raises(CheckpointError, match="several.*model.pt, optimizer.pt"):
        several.locate(str(dated))
    whole = validation_config(path, check=False, checkpoint_name=".").fn
    assert whole.pattern is None                         # the folder itself, layout detected
    assert whole.locate(str(named)) == str(named)
    assert whole.ref(str(named), None, None).step == 400
    with pytest.raises(SpecError, match="unknown key.*steps"):
        fn(None, steps=3)
    with pytest.raises(SpecError, match="whole number"):
        fn(None, step="ten")


def test_checkpoints_elsewhere_are_read_in_place_or_copied_under_their_own_name(project, tmp_path,
                                                                              monkeypatch):
    import pyarrow.fs as pafs
    from ray.train import Checkpoint

    from rayeval.io import paths
    from s3server import CREDENTIALS, MotoServer

    _, path = project
    fn = validation_config(path, check=False).fn
    run = tmp_path / "run" / "step_000040"
    run.mkdir(parents=True)
    (run / "model.pt").write_bytes(b"weights")
    (run / "optimizer.pt").write_bytes(b"state")

    # a filesystem rayeval has no URI for: copied once, under the checkpoint's own name
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    sub = Checkpoint(path="run/step_000040",
                     filesystem=pafs.SubTreeFileSystem(str(tmp_path), pafs.LocalFileSystem()))
    copy = fn.folder(sub)
    assert os.path.basename(copy) == "step_000040" and copy != str(run)
    assert (open(os.path.join(copy, "model.pt"), "rb").read() == b"weights")
    assert fn.ref(fn.locate(copy), None, None).step == 40
    assert copy.startswith(str(tmp_path / "tmp")) and fn.folder(sub) == copy
    (run / "model.pt").write_bytes(b"new weights")           # rewritten: copied again
    assert open(os.path.join(fn.folder(sub), "model.pt"), "rb").read() == b"new weights"

    # S3 (a real S3 API on loopback): read where Ray Train persisted it, no copy
    server = MotoServer()
    try:
        for k, v in {**CREDENTIALS, "AWS_ENDPOINT_URL": server.url}.items():
            monkeypatch.setenv(k, v)
        paths.clear_cache()
        s3 = pafs.S3FileSystem(endpoint_override=server.url, allow_bucket_creation=True)
        s3.create_dir("bkt")
        pafs.copy_files(str(run), "bkt/runs/train/step_000040",
                        source_filesystem=pafs.LocalFileSystem(), destination_filesystem=s3)
        folder = fn.folder(Checkpoint(path="bkt/runs/train/step_000040", filesystem=s3))
        assert folder == "s3://bkt/runs/train/step_000040"
        location = fn.locate(folder)
        assert location == "s3://bkt/runs/train/step_000040/model.pt"
        assert fn.ref(location, None, None).step == 40
    finally:
        server.stop()
        paths.clear_cache()


def test_returned_metrics_name_each_evaluation_and_add_the_suites_aggregate(project, tmp_path):
    from datetime import datetime, timezone

    _, path = project
    fn = validation_config(path, check=False, prefix="rayeval").fn
    store = ResultStore(str(tmp_path / "store"))
    t0 = datetime(2026, 1, 1, tzinfo=timezone.utc)

    def row(evaluation, metric, value, higher=True, matrix=None):
        return {"sweep": "rt", "checkpoint": "/c/step_1", "step": 1, "evaluation": evaluation,
                "metric": metric, "value": value, "ci_low": None, "ci_high": None,
                "num_samples": 10, "world_size": 1, "created_at": t0, "higher_is_better": higher,
                "bootstrap": None, "replicates": None, "matrix": matrix}

    store.write_cell("a", [row("val", "accuracy", 0.75), row("val", "nll", 0.5, False),
                           row("val", "confusion_matrix", None, matrix=[[1, 0], [0, 1]])])
    store.write_cell("b", [row("ood", "nll", 1.25, False)])
    assert fn.metrics(store, ["a"]) == {"rayeval/val/accuracy": 0.75, "rayeval/val/nll": 0.5}
    assert fn.metrics(store, ["a", "b"]) == {          # first metrics, lower-is-better negated
        "rayeval/val/accuracy": 0.75, "rayeval/val/nll": 0.5, "rayeval/ood/nll": 1.25,
        "rayeval/aggregate": (0.75 - 1.25) / 2}


# --- a real TorchTrainer with validation ---------------------------------------------------------

@pytest.fixture(scope="module")
def ray_local(ray_cluster):
    """The user's own Ray, which the session's is (support.shared_ray: a Ray this process
    started, its workers at the test's priority as rayeval's local Ray has them; Ray's
    default, 15 steps nicer, is starved by other work on a busy machine), with room for 1
    training worker + rayeval's 1 validation worker + Ray Data's CPUs beside them."""
    from ray import cloudpickle

    # The training loop below is sent by value: Ray's workers cannot import this test module.
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    yield
    cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


def _train_loop(config):
    """Trains the tiny model; reports a checkpoint (model.pt + optimizer.pt) at each step with
    validation: ``broken`` as step_000010 with model.pt truncated (validation=True), the last
    under Ray's dated default name with its step in fn_kwargs (a ValidationTaskConfig). Returns
    every reported checkpoint's status and metrics once their validations are done."""
    import tempfile

    import ray.train

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    x, y = torch.tensor(config["x"]), torch.tensor(config["y"])
    for step in config["steps"]:
        for _ in range(10):
            loss = torch.nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        with tempfile.TemporaryDirectory() as d:
            torch.save(model.state_dict(), os.path.join(d, "model.pt"))
            torch.save(opt.state_dict(), os.path.join(d, "optimizer.pt"))
            if step == config["broken"]:
                with open(os.path.join(d, "model.pt"), "r+b") as f:
                    f.truncate(100)
            if step == config["steps"][-1]:
                extra = {"validation": ray.train.ValidationTaskConfig(fn_kwargs={"step": step})}
            else:
                extra = {"validation": True, "checkpoint_dir_name": f"step_{step:06d}"}
            ray.train.report({"loss": float(loss), "step": step},
                             checkpoint=ray.train.Checkpoint.from_directory(d), **extra)
    reported = ray.train.get_all_reported_checkpoints(timeout_s=300)
    return [(r.checkpoint.path, r.status.value, dict(r.metrics)) for r in reported]


@pytest.fixture(scope="module")
def fitted(project, ray_local, tmp_path_factory):
    import time

    import ray.train
    from ray.train.torch import TorchTrainer

    folder, path = project
    x, y = make_data(256, seed=2)
    storage = tmp_path_factory.mktemp("train_storage")
    began = time.perf_counter()
    trainer = TorchTrainer(
        _train_loop,
        train_loop_config={"x": x, "y": y, "steps": STEPS, "broken": BROKEN},
        scaling_config=ray.train.ScalingConfig(num_workers=1),
        validation_config=validation_config(path, timeout_s=300),
        run_config=ray.train.RunConfig(
            name="train", storage_path=str(storage),
            checkpoint_config=ray.train.CheckpointConfig(
                checkpoint_score_attribute="eval/val/accuracy",
                checkpoint_score_order="max")))
    result = trainer.fit()
    seconds = time.perf_counter() - began
    print(f"training fit with {len(STEPS)} validations: {seconds:.1f} s")
    return result, load_sweep(path)


def _by_step(result):
    return {m["step"]: (c, m) for c, m in result.best_checkpoints}


def test_validation_metrics_join_the_training_result(fitted):
    result, _ = fitted
    assert result.error is None
    by_step = _by_step(result)
    assert sorted(by_step) == list(STEPS), "training finished with every checkpoint"
    keys = {"eval/val/accuracy", "eval/val/nll"}
    for step in STEPS:
        metrics = by_step[step][1]
        assert "loss" in metrics
        if step == BROKEN:
            assert not any(k.startswith("eval/") for k in metrics), metrics
        else:
            assert keys == {k for k in metrics if k.startswith("eval/")}, metrics
            assert 0 <= metrics["eval/val/accuracy"] <= 1
    assert result.metrics["step"] == STEPS[-1] and keys <= set(result.metrics)
    # ranked by the validation metric: best last, the failed one (no score) first
    scores = [m.get("eval/val/accuracy", float("-inf")) for _, m in result.best_checkpoints]
    assert scores == sorted(scores) and result.best_checkpoints[0][1]["step"] == BROKEN
    statuses = {m["step"]: status for _, status, m in result.return_value}
    assert statuses == {10: "VALIDATION_FAILED", 20: "VALIDATED"}


def test_store_rows_equal_a_separate_run_and_are_found_cached(fitted, tmp_path):
    result, sweep = fitted
    by_step = _by_step(result)
    good = [s for s in STEPS if s != BROKEN]
    files = {s: os.path.join(by_step[s][0].path, "model.pt") for s in good}
    assert os.path.basename(by_step[BROKEN][0].path) == "step_000010"
    assert os.path.basename(by_step[20][0].path).startswith("checkpoint_20")   # Ray's, dated

    rows = latest_rows(ResultStore(sweep.output).read())
    assert {(r["checkpoint"], r["step"]) for r in rows} == {(files[s], s) for s in good}, \
        "the persisted checkpoint's path and the right step, not a temporary copy"
    for r in rows:                      # what Ray Train got is what the store holds
        metrics, key = by_step[r["step"]][1], f"eval/{r['evaluation']}/{r['metric']}"
        if r["matrix"]:                 # a confusion matrix is stored, not returned
            assert key not in metrics
        else:
            assert metrics[key] == r["value"]

    # the same files again into the same store: cached, nothing evaluated
    again = rayeval.run(sweep.replace(checkpoints=tuple(files.values())))
    assert (len(again.plan.cells), len(again.plan.cached), again.outcomes) == (0, 1, [])
    # and the validation function itself returns them from the store, evaluating nothing
    fn = validation_config(sweep, check=False).fn
    step = good[0]
    assert fn(by_step[step][0], step=step) == {
        k: v for k, v in by_step[step][1].items() if k.startswith("eval/")}

    # a separate run of the same files into another store evaluates them: same numbers
    other = rayeval.run(sweep.replace(checkpoints=tuple(files.values())),
                        output=str(tmp_path / "other"))
    assert len(other.outcomes) == 1 and not other.failures
    theirs = {(r["checkpoint"], r["evaluation"], r["metric"]): r
              for r in latest_rows(ResultStore(str(tmp_path / "other")).read())}
    assert len(theirs) == len(rows) == 3
    for r in rows:
        t = theirs[(r["checkpoint"], r["evaluation"], r["metric"])]
        for column in ("value", "ci_low", "ci_high", "num_samples", "replicates", "matrix",
                       "cell", "bootstrap", "higher_is_better"):
            assert r[column] == t[column] or r[column] != r[column] and t[column] != t[column], \
                (r["checkpoint"], r["metric"], column)       # (a NaN: a matrix's value)
