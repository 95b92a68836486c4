"""Tier 3/4: object storage end to end against a real S3 API on loopback (moto's server): the
data set, the checkpoints (a file and a DCP folder) and the result store all in S3; transient
errors retried; a missing bucket one clear line."""

import json
import os
import shutil

import pyarrow.fs as pafs
import pytest

from rayeval.io import paths
from rayeval.execution.driver import run_sweep
from rayeval.ranking import latest_rows
from rayeval.plan.loader import load_sweep, with_overrides
from rayeval.io.store import ResultStore
from rayeval.io.store.layout import list_suites
from s3server import CREDENTIALS, FlakyProxy, MotoServer
from support import rayeval_cli, rayeval_main, stop_ray

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DIGITS = os.path.join(REPO, "configs", "digits")
pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def s3():
    """moto's server on loopback, with the environment a user would set for an S3 endpoint.
    Requested before ray_cluster, so Ray's workers inherit the environment too: the session's
    Ray is stopped first (a Ray of the module's own, started with this environment) and
    after the module (no later module's workers see an endpoint that is gone)."""
    stop_ray()
    server = MotoServer()
    saved = {k: os.environ.get(k) for k in [*CREDENTIALS, "AWS_ENDPOINT_URL"]}
    os.environ.update(CREDENTIALS, AWS_ENDPOINT_URL=server.url)
    fs = pafs.S3FileSystem(endpoint_override=server.url, allow_bucket_creation=True)
    fs.create_dir("rayeval-example")
    local = pafs.LocalFileSystem()
    pafs.copy_files(os.path.join(DIGITS, "ckpts"), "rayeval-example/digits/ckpts",
                    source_filesystem=local, destination_filesystem=fs)
    pafs.copy_files(os.path.join(DIGITS, "data", "eval.parquet"),
                    "rayeval-example/digits/eval.parquet", source_filesystem=local,
                    destination_filesystem=fs)
    yield server
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    server.stop()
    stop_ray()


def s3_sweep(tmp_path, output="s3://rayeval-example/evals", **extra):
    shutil.copy(os.path.join(DIGITS, "my_models.py"), tmp_path)
    text = open(os.path.join(DIGITS, "sweep_s3.yaml")).read()
    text = text.replace("use_gpu: true", "use_gpu: false")
    text = text.replace("output: s3://rayeval-example/evals", f"output: {output}")
    for old, new in extra.items():
        text = text.replace(old, new)
    (tmp_path / "sweep.yaml").write_text(text)
    return str(tmp_path / "sweep.yaml")


def test_data_checkpoints_and_results_in_s3(s3, ray_cluster, tmp_path):
    path = s3_sweep(tmp_path)
    sweep = load_sweep(path)
    report = run_sweep(sweep)
    assert [o.ok for o in report.outcomes] == [True] * 4, report.failures
    # parquet on object storage comes through Ray Data (its read tasks read S3 themselves)
    assert all(t["ray data"][1] >= 1 for t in report.worker_times.values()), report.worker_times
    got = {(os.path.basename(r["checkpoint"]), r["metric"]): r
           for r in latest_rows(ResultStore(sweep.output).read())}
    assert len(got) == 12 and all(r["checkpoint"].startswith("s3://") for r in got.values())

    # The same sweep on local files gives the same numbers.
    local = shutil.copytree(DIGITS, tmp_path / "local", ignore=shutil.ignore_patterns("out"))
    local_sweep = with_overrides(load_sweep(str(local / "sweep.yaml")), 
        output=str(tmp_path / "local-out"))
    assert all(o.ok for o in run_sweep(local_sweep).outcomes)
    # The local example is a suite; its `noisy` evaluation reads the same file as sweep_s3.yaml.
    ref = {(os.path.basename(r["checkpoint"]), r["metric"]): r
           for r in latest_rows(ResultStore(local_sweep.output).read())
           if r["evaluation"] == "noisy"}
    assert set(ref) == set(got)
    for key, row in ref.items():
        assert got[key]["value"] == pytest.approx(row["value"], rel=1e-9, abs=1e-12), key
        assert got[key]["num_samples"] == 2003

    # The store keeps the sweep file as written: once per text, the newest read.
    store = ResultStore(sweep.output)
    written = open(path, "rb").read().decode()
    assert store.sweep_texts(sweep.name) == {sweep.name: written}
    assert store.keep_sweep(sweep.name, written) is None            # a re-run's: no copy
    with open(path, "a") as f:
        f.write("# edited\n")                                        # the same cells

    # Fingerprints of S3 objects: a second run evaluates nothing.
    again = run_sweep(load_sweep(path))
    assert again.outcomes == [] and len(again.plan.cached) == 4
    # nothing evaluated, so nothing kept: the text behind the rows stays the newest
    assert [t for _, t in store.sweep_files(sweep.name)[sweep.name]] == [written]
    assert store.keep_sweep(sweep.name, written + "# edited\n") is not None
    assert [t for _, t in store.sweep_files(sweep.name)[sweep.name]] == \
        [written + "# edited\n", written]

    lb = rayeval_main("leaderboard", "s3://rayeval-example/evals", "--format", "json")
    assert lb.returncode == 0, lb.stderr
    assert len(json.loads(lb.stdout)) == 12

    # The suite's store, as its run left it (a part with its suite file), reads the same on S3.
    fs = pafs.S3FileSystem(endpoint_override=s3.url)
    pafs.copy_files(str(tmp_path / "local-out"), "rayeval-example/suite-copy",
                    source_filesystem=pafs.LocalFileSystem(), destination_filesystem=fs)
    copy = ResultStore("s3://rayeval-example/suite-copy")
    assert len(list_suites(copy.fs, copy.root)) == 1
    here = rayeval_main("leaderboard", str(tmp_path / "local-out"), "--format", "json")
    there = rayeval_main("leaderboard", "s3://rayeval-example/suite-copy", "--format", "json")
    assert there.returncode == 0, there.stderr
    assert there.stdout == here.stdout and '"metric": "aggregate"' in there.stdout
    # rayeval view reads an S3 store as it reads a local one (docs/report.md)
    from rayeval.reporting.report import Report

    s3_report = Report("s3://rayeval-example/suite-copy", marks=False)
    local_report = Report(str(tmp_path / "local-out"), marks=False)
    assert s3_report.view("board", {}) == local_report.view("board", {})
    assert s3_report.view("paired", {"ref": "1"}) == local_report.view("paired", {"ref": "1"})


def test_transient_errors_are_retried(s3, tmp_path, monkeypatch):
    proxy = FlakyProxy(s3.port, every=3)
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        store = ResultStore("s3://rayeval-example/flaky")
        for i in range(4):
            store.write_cell(f"cell{i}", [{"sweep": "s", "checkpoint": "c", "step": i,
                                           "evaluation": "d", "metric": "m", "value": float(i),
                                           "ci_low": None, "ci_high": None, "num_samples": 1,
                                           "world_size": 1, "higher_is_better": True}])
        assert sorted(store.read().column("value").to_pylist()) == [0.0, 1.0, 2.0, 3.0]
        found = paths.glob("s3://rayeval-example/digits/ckpts/step_*")
        assert len(found) == 4
        assert proxy.failed >= 3, "the proxy did inject errors"

        # Without retries the same calls fail: the retries are what carried them.
        monkeypatch.setenv("RAYEVAL_S3_MAX_ATTEMPTS", "1")
        paths.clear_cache()
        with pytest.raises(OSError):
            for i in range(6):
                paths.glob("s3://rayeval-example/digits/ckpts/step_*")
    finally:
        paths.clear_cache()
        proxy.stop()


def test_missing_bucket_is_one_line(s3, tmp_path):
    proc = rayeval_main("run", s3_sweep(tmp_path, output="s3://no-such-bucket/evals"))
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr
    assert "output: bucket 'no-such-bucket' does not exist" in lines[0]

    data = rayeval_main("run", s3_sweep(tmp_path, **{
        "s3://rayeval-example/digits/eval.parquet": "s3://missing-data/eval.parquet"}))
    assert data.returncode == 2 and "dataset.path: bucket 'missing-data' does not exist" in \
        data.stderr, data.stderr
    ckpt = rayeval_main("leaderboard", "s3://no-such-bucket/evals")
    assert ckpt.returncode == 2 and "bucket 'no-such-bucket' does not exist" in ckpt.stderr


def test_denied_access_is_one_line(s3, tmp_path):
    strict = MotoServer(enforce_auth=True)
    try:
        env = {**os.environ, "AWS_ENDPOINT_URL": strict.url}
        proc = rayeval_cli("run", s3_sweep(tmp_path), env=env)
        assert proc.returncode == 2, (proc.stdout, proc.stderr)
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
        assert lines[0].startswith("error: dataset.path: access denied to "
                                   "s3://rayeval-example/digits/eval.parquet; check the "
                                   "credentials"), lines[0]
        lb = rayeval_cli("leaderboard", "s3://rayeval-example/evals", env=env)
        assert lb.returncode == 2 and "STORE: access denied to s3://rayeval-example/evals" in \
            lb.stderr, lb.stderr
    finally:
        strict.stop()
