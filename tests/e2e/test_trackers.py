"""Experiment trackers: a real MLflow tracking server on loopback (started here, read back with
MlflowClient) and W&B runs written offline (read back from the run's own .wandb file).

One real Ray run (the CLI, end to end) logs to MLflow (into a training run, at the checkpoints'
steps) and to W&B at once; everything else goes through `rayeval leaderboard --to-mlflow /
--to-wandb` on a store, or a `run` whose cells are all cached, which need no Ray."""

import csv
import glob
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import time
import urllib.request
from datetime import datetime, timezone

import pytest
import torch
import yaml

import rayeval
from rayeval.ui import cli
from rayeval.config.schema import MlflowTracker, Trackers, WandbTracker
from rayeval.errors import SpecError
from rayeval.plan.loader import parse_sweep, trackers_spec, with_trackers
from rayeval.io.store import ResultStore
from rayeval.reporting.trackers import metric_name, points, wandb_run_id
from support import (build_model, make_data, ray_starts, rayeval_cli, write_model_module,
                     write_parquet)

STEPS = (100, 200)
EVALS = ("clean", "noisy")
METRICS = ("accuracy", "nll")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def dead_uri() -> str:
    return f"http://127.0.0.1:{free_port()}"       # closed again: nothing listens there


# --- a real MLflow tracking server ------------------------------------------------------------

@pytest.fixture(scope="module")
def mlflow_uri(tmp_path_factory):
    folder = tmp_path_factory.mktemp("mlflow")
    port = free_port()
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    log = open(folder / "server.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
         "--workers", "1", "--backend-store-uri", f"sqlite:///{folder}/mlflow.db",
         "--artifacts-destination", str(folder / "artifacts")],
        stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    uri = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                with urllib.request.urlopen(f"{uri}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError("the MLflow server did not come up:\n"
                                     + (folder / "server.log").read_text()[-3000:])
            time.sleep(0.3)
        yield uri
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)      # its own session: the server and its worker
            proc.wait(timeout=20)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=20)
        log.close()


@pytest.fixture(scope="module")
def client(mlflow_uri):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=mlflow_uri)


def history(client, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


def expected(rows: list[dict], suffix: str = "") -> dict[str, list[tuple[int, float]]]:
    """The store's rows as the points a tracker must hold: name -> sorted (step, value)."""
    out: dict[str, list] = {}
    column = {"": "value", "_ci_low": "ci_low", "_ci_high": "ci_high"}[suffix]
    for r in rows:
        out.setdefault(metric_name(r["evaluation"], r["metric"]) + suffix, []).append(
            (r["step"], r[column]))
    return {k: sorted(v) for k, v in out.items()}


def sweep_runs(client, experiment: str, sweep: str):
    exp = client.get_experiment_by_name(experiment)
    return client.search_runs([exp.experiment_id],
                              filter_string=f"tags.`rayeval.sweep` = '{sweep}'")


# --- W&B offline runs, read back from their .wandb file ----------------------------------------

def wandb_records(run_dir: str) -> list:
    """The records of an offline run's .wandb file: W&B's log format (a 7-byte file header,
    then 32 KiB blocks of records, each with a 7-byte header: CRC, length, kind — full, first,
    middle, last) holding protobuf ``Record``s."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = glob.glob(os.path.join(run_dir, "*.wandb"))
    data = open(path, "rb").read()
    assert data[:4] == b":W&B"
    block, pos, pending, payloads = 32768, 7, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:                       # a block's tail too short for a header: padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        body = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == 0:
            break
        if kind == 1:
            payloads.append(body)
        elif kind == 2:
            pending = body
        elif kind == 3:
            pending += body
        elif kind == 4:
            payloads.append(pending + body)
    records = []
    for body in payloads:
        r = pb.Record()
        r.ParseFromString(body)
        records.append(r)
    return records


def wandb_history(records) -> list[dict]:
    return [{(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in r.history.item}
            for r in records if r.WhichOneof("record_type") == "history"]


def offline_run(wandb_dir, run_id: str, timeout: float = 120) -> str:
    """The offline run's folder, once W&B's service has written the run's exit record into its
    .wandb file (the service writes on its own process: on a busy machine that can trail
    ``run.finish()``). Bounded by the event, with a generous limit."""
    pattern = os.path.join(str(wandb_dir), "wandb", f"offline-run-*-{run_id}")
    deadline = time.monotonic() + timeout
    while True:
        found = glob.glob(pattern)
        if len(found) == 1 and glob.glob(os.path.join(found[0], "*.wandb")) and any(
                r.WhichOneof("record_type") == "exit" for r in wandb_records(found[0])):
            return found[0]
        if time.monotonic() > deadline:
            raise AssertionError(f"no finished offline run {pattern}: {found}")
        time.sleep(0.2)


def check_wandb_run(run_dir: str, rows: list[dict], project: str, run_id: str):
    records = wandb_records(run_dir)
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert (run.project, run.run_id) == (project, run_id)
    metrics = [r.metric for r in records if r.WhichOneof("record_type") == "metric"]
    assert any(m.glob_name == "eval/*" and m.step_metric == "eval/step" for m in metrics)
    logged: dict[str, list] = {}
    tables = 0
    for h in wandb_history(records):
        tables += "rayeval/leaderboard/_type" in h
        for key, value in h.items():
            if key.startswith("eval/") and key != "eval/step":
                logged.setdefault(key, []).append((h["eval/step"], value))
    want = {**expected(rows), **expected(rows, "_ci_low"), **expected(rows, "_ci_high")}
    assert {k: sorted(v) for k, v in logged.items()} == want
    assert tables == 1
    (table,) = glob.glob(os.path.join(run_dir, "files", "media", "table", "rayeval",
                                      "leaderboard_*.table.json"))
    board = json.load(open(table))
    assert board["columns"][:5] == ["rank", "best", "sweep", "checkpoint", "step"]
    assert sorted(line[4] for line in board["data"]) == sorted({r["step"] for r in rows})


# --- the sweep: two checkpoints x two evaluations, one real Ray run ---------------------------

def sweep_dict(**extra) -> dict:
    return {"name": "trk", "model": {"factory": "trk_models:build"},
            "checkpoints": ["ckpts/*"], "output": "out", "workers": 1, "batch_size": 64,
            "bootstrap": {"replicates": 50},
            "evals": [{"name": e, "task": "classification", "metrics": list(METRICS),
                       "dataset": {"path": "data.parquet", "inputs": "x", "target": "y"}}
                      for e in EVALS], **extra}


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory, mlflow_uri, client):
    """`rayeval run` (one real Ray run) into an MLflow training run that has gone further than
    the checkpoints, and into W&B offline. The sweep file's URI and project are placeholders
    that --mlflow / --wandb override (its run_id and mode stay)."""
    folder = tmp_path_factory.mktemp("evaluated")
    write_model_module(str(folder), name="trk_models")
    x, y = make_data(60)
    write_parquet(str(folder / "data.parquet"), x, y)
    (folder / "ckpts").mkdir()
    for seed, step in enumerate(STEPS, 1):
        torch.save(build_model(seed=seed).state_dict(), folder / "ckpts" / f"step_{step}.pt")
    experiment = client.create_experiment("training")
    training = client.create_run(experiment, run_name="train").info.run_id
    for step in (100, 200, 300):
        client.log_metric(training, "train/loss", 1.0 / step, step=step)
    sweep = folder / "sweep.yaml"
    sweep.write_text(yaml.safe_dump(sweep_dict(aggregate="mean", trackers={
        "mlflow": {"uri": dead_uri(), "run_id": training},
        "wandb": {"project": "placeholder", "mode": "offline"}})))
    (folder / "plain.yaml").write_text(yaml.safe_dump(sweep_dict()))    # same cells, no trackers
    env = {**os.environ, "WANDB_DIR": str(folder), "WANDB_SILENT": "true"}
    env.pop("WANDB_MODE", None)
    began = time.monotonic()
    proc = rayeval_cli("run", str(sweep), "--mlflow", mlflow_uri, "--wandb", "rayeval-tests",
                       cwd=str(folder), env=env, timeout=600)
    print(f"rayeval run with trackers: {time.monotonic() - began:.1f} s")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = rayeval.results(str(folder / "out")).to_pylist()
    return {"folder": folder, "proc": proc, "training": training, "rows": rows,
            "store": str(folder / "out")}


@pytest.mark.ray
def test_run_logs_each_cell_into_the_training_run_at_its_step(evaluated, client):
    rows, run_id = evaluated["rows"], evaluated["training"]
    assert len(rows) == len(STEPS) * len(EVALS) * len(METRICS)
    assert all(r["ci_low"] is not None for r in rows)
    for suffix in ("", "_ci_low", "_ci_high"):
        for key, points_ in expected(rows, suffix).items():
            assert history(client, run_id, key) == points_, key
            assert [s for s, _ in points_] == list(STEPS)
    assert history(client, run_id, "train/loss") == [(100, 0.01), (200, 0.005),
                                                     (300, 1 / 300)]
    run = client.get_run(run_id)
    assert run.info.status == "RUNNING"           # a training run's status is not ours
    assert client.get_experiment_by_name("rayeval") is None     # no run of the sweep's own
    err = evaluated["proc"].stderr
    assert "warning" not in err, err
    done = "8 metric value(s) of 4 cell(s) (with their intervals) and the leaderboard logged"
    assert f"[rayeval] mlflow: {done} to run {run_id} (http://127.0.0.1:" in err
    assert f"[rayeval] wandb: {done} to run {wandb_run_id('trk')} (project rayeval-tests, " \
           "offline)" in err


@pytest.mark.ray
def test_run_logs_the_leaderboard_as_a_table_artifact(evaluated, client, tmp_path):
    run_id = evaluated["training"]
    names = {a.path for a in client.list_artifacts(run_id, "rayeval")}
    assert names == {"rayeval/leaderboard.csv", "rayeval/leaderboard.json"}
    local = client.download_artifacts(run_id, "rayeval/leaderboard.csv", str(tmp_path))
    lines = list(csv.DictReader(open(local)))
    assert sorted(int(line["step"]) for line in lines) == list(STEPS)
    by_step = {int(line["step"]): line for line in lines}
    for r in evaluated["rows"]:
        line = by_step[r["step"]]
        assert float(line[f"{r['evaluation']}/{r['metric']}"]) == r["value"]
        assert float(line[f"{r['evaluation']}/{r['metric']}_ci_low"]) == r["ci_low"]
    # ranked by the sweep's aggregate: mean, as the terminal's board (issue 57: the trackers
    # used the default win rate whatever the sweep said)
    mean = {e.step: e.value("aggregate") for e in
            rayeval.leaderboard(evaluated["store"], aggregate="mean").entries}
    wins = {e.step: e.value("aggregate") for e in
            rayeval.leaderboard(evaluated["store"]).entries}
    assert mean != wins                   # the two rules differ here: the check can fail
    assert {step: float(line["aggregate"]) for step, line in by_step.items()} == mean


@pytest.mark.ray
def test_run_logs_to_wandb_offline_against_eval_step(evaluated):
    run_id = wandb_run_id("trk")          # no run_id in the sweep: the sweep's own run
    check_wandb_run(offline_run(evaluated["folder"], run_id), evaluated["rows"],
                    "rayeval-tests", run_id)


@pytest.mark.ray
def test_cached_cells_are_not_logged_again_by_run(evaluated, client, mlflow_uri):
    """A second run (every cell cached: no Ray) through the API's trackers=: nothing is
    logged again; the leaderboard artifact is written again."""
    run_id = evaluated["training"]
    before = {k: history(client, run_id, k) for k in expected(evaluated["rows"])}
    report = rayeval.run(str(evaluated["folder"] / "sweep.yaml"),
                         trackers={"mlflow": {"uri": mlflow_uri, "run_id": run_id},
                                   "wandb": None})
    assert report.plan.cells == () and len(report.plan.cached) == 4
    assert {k: history(client, run_id, k) for k in before} == before


@pytest.mark.ray
def test_a_tracker_that_is_down_never_fails_the_run(evaluated, capsys):
    store = evaluated["store"]
    before = sorted(os.listdir(os.path.join(store, "results")))
    began = time.monotonic()
    code = cli.main(["run", str(evaluated["folder"] / "plain.yaml"), "--mlflow", dead_uri(),
                     "--quiet"])
    assert time.monotonic() - began < 30
    out, err = capsys.readouterr()
    assert code == 0, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("[rayeval] warning: mlflow: cannot use http://127.0.0.1:")
    assert "nothing answers at" in lines[0] and "Traceback" not in err
    assert "0 cell(s) evaluated, 4 already in the store" in out
    assert sorted(os.listdir(os.path.join(store, "results"))) == before


# --- `rayeval leaderboard --to-mlflow / --to-wandb` on a store written here (no Ray) ----------

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)


@pytest.fixture
def store(tmp_path):
    """Two sweeps, two checkpoints each (steps 100 and 200), two evaluations, with intervals;
    one checkpoint of sweep b has no step in its name."""
    st = ResultStore(str(tmp_path / "store"))
    for sweep, steps in (("a", (100, 200)), ("b", (100, None))):
        for i, step in enumerate(steps):
            ckpt = f"/ckpts/{sweep}/step_{step}.pt" if step else f"/ckpts/{sweep}/final.pt"
            for e in EVALS:
                rows = [{"sweep": sweep, "checkpoint": ckpt, "step": step, "evaluation": e,
                         "metric": m, "value": 0.5 + 0.1 * i + 0.01 * j,
                         "ci_low": 0.4 + 0.1 * i, "ci_high": 0.6 + 0.1 * i + 0.02 * j,
                         "num_samples": 500, "world_size": 1, "created_at": T0,
                         "higher_is_better": m != "nll"} for j, m in enumerate(METRICS)]
                st.write_cell(f"{sweep}-{i}-{e}", rows)
    return str(tmp_path / "store")


def rows_of(store, sweep):
    return rayeval.results(store, sweep=sweep).to_pylist()


def test_push_gives_each_sweep_one_run_that_a_second_push_reuses(store, client, mlflow_uri,
                                                                 capsys):
    argv = ["leaderboard", store, "--to-mlflow", mlflow_uri, "--experiment", "pushed"]
    assert cli.main(argv) == 0
    first = capsys.readouterr()
    assert "rank" in first.out and "step_200.pt" in first.out      # the board is still shown
    assert cli.main(argv + ["--format", "json"]) == 0
    second = capsys.readouterr()
    json.loads(second.out)                # MLflow's "View run" lines are not in the JSON
    for sweep in ("a", "b"):
        runs = sweep_runs(client, "pushed", sweep)
        assert len(runs) == 1
        run = runs[0]
        assert run.info.run_name == sweep and run.info.status == "FINISHED"
        stepped = [r for r in rows_of(store, sweep) if r["step"] is not None]
        for suffix in ("", "_ci_low", "_ci_high"):
            for key, points_ in expected(stepped, suffix).items():
                assert history(client, run.info.run_id, key) == points_   # not doubled
        assert {a.path for a in client.list_artifacts(run.info.run_id, "rayeval")} == \
            {"rayeval/leaderboard.csv", "rayeval/leaderboard.json"}
    a_run = sweep_runs(client, "pushed", "a")[0].info.run_id
    done = "metric value(s) of 4 cell(s) (with their intervals) and the leaderboard logged"
    assert f"[rayeval] mlflow: 8 {done} to run {a_run} (http" in first.err
    assert f"[rayeval] mlflow: 0 {done} to run {a_run} (http" in second.err
    assert "4 metric value(s) of checkpoints without a training step left out" in first.err


def test_push_into_a_given_run_at_the_checkpoints_steps(store, client, mlflow_uri, capsys):
    experiment = client.create_experiment("another-training")
    run_id = client.create_run(experiment, run_name="t").info.run_id
    client.log_metric(run_id, "train/loss", 0.1, step=1000)
    assert cli.main(["leaderboard", store, "--sweep", "a", "--to-mlflow", mlflow_uri,
                     "--run-id", run_id, "--format", "csv"]) == 0
    capsys.readouterr()
    for key, points_ in expected(rows_of(store, "a")).items():
        assert history(client, run_id, key) == points_
    assert history(client, run_id, "train/loss") == [(1000, 0.1)]
    assert client.get_run(run_id).info.status == "RUNNING"
    # two sweeps cannot share one run's names: a one-line error, nothing sent
    assert cli.main(["leaderboard", store, "--to-mlflow", mlflow_uri, "--run-id", run_id]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --run-id: the store holds 2 sweeps (a, b)")
    assert "--sweep" in err and len(err.splitlines()) == 1
    # a run id the server does not have: one warning, exit 1, the board still shown
    assert cli.main(["leaderboard", store, "--sweep", "a", "--to-mlflow", mlflow_uri,
                     "--run-id", "0" * 32]) == 1
    out, err = capsys.readouterr()
    assert "step_200.pt" in out
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "warning: mlflow" in lines[0] and "check the run id" in lines[0]


def test_push_to_wandb_offline(store, tmp_path, monkeypatch, capsys):
    # W&B leaves WANDB_SERVICE (its service's socket) in the environment: not for later tests
    monkeypatch.setenv("WANDB_SERVICE", "")
    monkeypatch.delenv("WANDB_SERVICE")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    assert cli.main(["leaderboard", store, "--sweep", "a", "--to-wandb", "pushed",
                     "--format", "csv"]) == 0
    err = capsys.readouterr().err
    run_id = wandb_run_id("a")
    assert f"[rayeval] wandb: 8 metric value(s) of 4 cell(s) (with their intervals) and the " \
           f"leaderboard logged to run {run_id} (project pushed, offline)" in err
    check_wandb_run(offline_run(tmp_path, run_id), rows_of(store, "a"), "pushed", run_id)
    # into a training run by id
    assert cli.main(["leaderboard", store, "--sweep", "a", "--to-wandb", "pushed",
                     "--run-id", "train-7", "--format", "csv"]) == 0
    capsys.readouterr()
    check_wandb_run(offline_run(tmp_path, "train-7"), rows_of(store, "a"), "pushed", "train-7")


def test_push_to_a_tracker_that_is_down_warns_once_and_exits_1(store, capsys, tmp_path):
    began = time.monotonic()
    assert cli.main(["leaderboard", store, "--to-mlflow", dead_uri()]) == 1
    assert time.monotonic() - began < 20
    out, err = capsys.readouterr()
    assert "step_200.pt" in out
    lines = err.strip().splitlines()
    # one line per sweep's run: the second sweep opens the tracker again
    assert len(lines) == 2 and all("warning: mlflow: cannot use" in ln for ln in lines), err
    # W&B online without a key: misconfigured, one line. In a process of its own: W&B reads
    # its mode once per process, and this one has written offline runs.
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(WANDB_MODE="online", WANDB_BASE_URL=dead_uri(), WANDB_DIR=str(tmp_path),
               HOME=str(tmp_path))                 # no ~/.netrc with a key
    proc = rayeval_cli("leaderboard", store, "--sweep", "a", "--to-wandb", "p", env=env,
                       timeout=120)
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("[rayeval] warning: wandb: "), lines
    assert "step_200.pt" in proc.stdout


@pytest.mark.parametrize("argv, fragment", [
    (["--experiment", "x"], "--experiment: only with --to-mlflow"),
    (["--run-id", "x"], "--run-id: give it with one of --to-mlflow or --to-wandb"),
    (["--run-id", "x", "--to-mlflow", "http://h", "--to-wandb", "p"], "--run-id: give it"),
    (["--to-mlflow", " "], "--to-mlflow: expected a non-empty value"),
])
def test_push_flag_errors_are_one_line(store, capsys, argv, fragment):
    assert cli.main(["leaderboard", store, *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and fragment in err and len(err.splitlines()) == 1


def test_a_missing_package_is_one_line_before_anything_starts(store, tmp_path, monkeypatch,
                                                              capsys):
    monkeypatch.setitem(sys.modules, "mlflow", None)      # `import mlflow` fails, as uninstalled
    assert cli.main(["leaderboard", store, "--to-mlflow", "http://127.0.0.1:1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "error: --to-mlflow: the mlflow package is not installed; " \
                  "pip install 'rayeval[mlflow]'"
    monkeypatch.setitem(sys.modules, "wandb", None)
    sweep = tmp_path / "s.yaml"
    sweep.write_text(yaml.safe_dump(sweep_dict(trackers={"wandb": {"project": "p"}})))
    with ray_starts() as started, pytest.raises(
            SpecError, match=r"trackers\.wandb: the wandb package is not "
                             r"installed; pip install 'rayeval\[wandb\]'"):
        rayeval.run(str(sweep))           # the checkpoints do not even exist: it fails first
    assert not started


# --- the sweep's trackers: key ---------------------------------------------------------------

def test_trackers_parse_into_frozen_types():
    sweep = parse_sweep(sweep_dict(trackers={
        "mlflow": {"uri": "http://mlflow:5000", "experiment": "e", "run_id": "abc"},
        "wandb": {"project": "p", "entity": "team", "run_id": "r1", "mode": "offline"}}),
        base_dir="/tmp")
    assert sweep.trackers == Trackers(
        mlflow=MlflowTracker(uri="http://mlflow:5000", experiment="e", run_id="abc"),
        wandb=WandbTracker(project="p", entity="team", run_id="r1", mode="offline"))
    assert parse_sweep(sweep_dict(), base_dir="/tmp").trackers == Trackers()
    assert not Trackers().any
    with pytest.raises(AttributeError):
        sweep.trackers.mlflow.uri = "x"                          # frozen


@pytest.mark.parametrize("trackers, message", [
    ({"mlfow": {}}, "trackers.mlfow: unknown key; did you mean 'mlflow'?"),
    ({"mlflow": {"experimnt": "e"}}, "trackers.mlflow.experimnt: unknown key; did you mean "
                                     "'experiment'?"),
    ({"mlflow": None}, "trackers.mlflow: expected a mapping, got nothing"),
    ({"mlflow": {"uri": 5000}}, "trackers.mlflow.uri: expected a non-empty string, got 5000"),
    ({"mlflow": {"run_id": 123}}, "trackers.mlflow.run_id: expected a run id string, got 123 "
                                  "(int); quote it"),
    ({"wandb": {"mode": "offline"}}, "trackers.wandb.project: missing required key"),
    ({"wandb": {"project": "p", "mode": "cloud"}}, "trackers.wandb.mode: expected one of "
                                                   "online, offline, got 'cloud'"),
    ({"wandb": "p"}, "trackers.wandb: expected a mapping, got 'p'"),
    (["mlflow"], "trackers: expected a mapping"),
])
def test_trackers_errors_name_the_key_path(trackers, message):
    with pytest.raises(SpecError) as e:
        parse_sweep(sweep_dict(trackers=trackers), base_dir="/tmp", source="s.yaml")
    assert e.value.message.startswith(f"s.yaml: {message}"), e.value.message


def test_flags_override_the_uri_and_project_and_keep_the_rest():
    sweep = parse_sweep(sweep_dict(trackers={"mlflow": {"uri": "http://a", "run_id": "r"},
                                             "wandb": {"project": "p", "mode": "offline"}}),
                        base_dir="/tmp")
    t = with_trackers(sweep, mlflow="http://b", wandb="q").trackers
    assert (t.mlflow.uri, t.mlflow.run_id, t.wandb.project, t.wandb.mode) == \
        ("http://b", "r", "q", "offline")
    added = with_trackers(parse_sweep(sweep_dict(), base_dir="/tmp"), mlflow="http://c").trackers
    assert added == Trackers(mlflow=MlflowTracker(uri="http://c", key_path="--mlflow"))
    # the API's trackers= replaces the trackers it names; None removes one
    t = trackers_spec({"wandb": None, "mlflow": {"uri": "http://d"}}, base=sweep.trackers,
                      removable=True)
    assert t == Trackers(mlflow=MlflowTracker(uri="http://d"))


def test_points_carry_the_step_and_leave_out_what_cannot_be_charted():
    row = {"sweep": "s", "checkpoint": "c", "evaluation": "val set", "metric": "top_k(k=5)",
           "step": 7, "value": 0.5, "ci_low": 0.4, "ci_high": None, "created_at": T0}
    pts, unstepped = points([row, {**row, "step": None}, {**row, "value": float("nan")}])
    assert [(p.key, p.value, p.step) for p in pts] == [
        ("eval/val set/top_k_k_5_", 0.5, 7), ("eval/val set/top_k_k_5__ci_low", 0.4, 7)]
    assert unstepped == 1 and pts[0].timestamp_ms == int(T0.timestamp() * 1000)


def test_submit_forwards_the_tracker_flags_to_the_job():
    from rayeval.integrations.jobs import Package, entrypoint

    pkg = Package(folder="/x", sweep_file="sweep.yaml", bytes=0, excludes=())
    assert entrypoint(pkg, workers=None, output=None, force=False, mlflow="http://m:5000",
                      wandb="my proj") == ("rayeval run sweep.yaml --address auto "
                                           "--mlflow http://m:5000 --wandb 'my proj'")
