"""``rayeval serve`` on a real local Ray (docs/service.md): two sweeps in a row handed by plain
``rayeval run``, one of them with its own ``tiny_models.py`` of the same module name as the
other's, a worker lost mid-run, bad input, a checkpoint submitted over the HTTP API and polled,
all with the figures of a plain computation; a service killed under a run is one line for the client; Ctrl-C stops a
service cleanly (no Ray process, no service file left)."""

import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time
import urllib.request

import pytest
import torch

from rayeval.io.store import ResultStore
from support import (build_model, make_data, reference_metrics, wait_for, write_model_module,
                     write_parquet, write_sweep)

pytestmark = pytest.mark.ray

ROWS = 600


def sweep_folder(folder, seeds, factory="tiny_models:build", extra_code="", workers=2,
                 **overrides):
    (folder / "ckpts").mkdir(parents=True)
    write_model_module(str(folder))
    if extra_code:
        with open(folder / "tiny_models.py", "a") as f:
            f.write(extra_code)
    write_parquet(str(folder / "data.parquet"), *make_data(ROWS, seed=5))
    for s in seeds:
        torch.save(build_model(seed=s, hidden=overrides.pop("hidden", 16)).state_dict(),
                   folder / "ckpts" / f"step_{s}.pt")
    return write_sweep(str(folder), workers=workers, model={"factory": factory},
                       output=str(folder / "store"), **overrides)


def figures(store) -> dict:
    rows = ResultStore(str(store)).read(["checkpoint", "metric", "value"]).to_pylist()
    return {(os.path.basename(r["checkpoint"]), r["metric"]): r["value"] for r in rows}


def expect(got: dict, seeds, hidden=16) -> None:
    x, y = make_data(ROWS, seed=5)
    for s in seeds:
        for metric, value in reference_metrics(build_model(seed=s, hidden=hidden), x,
                                               y).items():
            assert got[(f"step_{s}.pt", metric)] == pytest.approx(value, rel=1e-9), (s, metric)


class Service:
    def __init__(self, tmp_path, workers=2, env=None, name="service"):
        """``env``: the service's environment, its clients' too (default: this one, with a
        service file of its own in ``tmp_path``); with ``env``, the file is the one the
        environment's HOME holds (the default file's place)."""
        self.file = tmp_path / f"{name}.json"
        if env is not None:
            self.file = None
        # progress lines every 0.5 s in what the service's runs print (its environment's)
        self.env = env or {**os.environ, "RAYEVAL_SERVICE_FILE": str(self.file),
                           "RAYEVAL_PROGRESS_INTERVAL_S": "0.5"}
        self.log = tmp_path / f"{name}.log"
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "rayeval", "serve", "--workers", str(workers)],
                stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True)
        wait_for(lambda: "ready" in self.log.read_text() or self.proc.poll() is not None,
                 300, "the service's ready line", self.log)
        if self.file is None:
            (self.file,) = (pathlib.Path(self.env["HOME"]) / ".rayeval").iterdir()
        assert self.proc.poll() is None and self.file.exists(), self.log.read_text()
        self.info = json.loads(self.file.read_text())

    def run(self, *args, cwd, env=None):
        return subprocess.run([sys.executable, "-m", "rayeval", "run", *args], cwd=cwd,
                              env=env or self.env, capture_output=True, text=True, timeout=600)

    def serve(self, flag, env=None):
        return subprocess.run([sys.executable, "-m", "rayeval", "serve", flag], env=env or
                              self.env, capture_output=True, text=True, timeout=300)

    def named_in(self, stderr: str) -> bool:
        """Whether a client's output says, first, that it ran on this service."""
        return stderr.startswith(f"[rayeval] on the rayeval service at {self.info['url']} "
                                 f"(pid {self.proc.pid}, ")

    def call(self, method, path, body=None):
        req = urllib.request.Request(self.info["url"] + path, method=method,
                                     data=None if body is None else json.dumps(body).encode(),
                                     headers={"Authorization": f"Bearer {self.info['token']}"})
        with urllib.request.urlopen(req, timeout=30) as r:
            return json.loads(r.read())

    def stop(self, sig=signal.SIGINT):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(30)


def test_a_service_takes_sweeps_in_a_row_and_over_http(tmp_path):
    a = sweep_folder(tmp_path / "a", seeds=(1, 2))
    # b: its own tiny_models.py, another file of the same module name with one more factory
    b = sweep_folder(tmp_path / "b", seeds=(4,), factory="tiny_models:build_wide", hidden=24,
                     extra_code="\n\ndef build_wide(**kw):\n    return build(hidden=24, **kw)\n")
    bad = write_sweep(str(tmp_path / "a"), name="bad.yaml", workers=2,
                      metrics=["acuracy"], output=str(tmp_path / "bad-store"))
    service = Service(tmp_path)
    try:
        first = service.run(a, cwd=tmp_path / "a")
        assert first.returncode == 0, first.stdout + first.stderr
        assert "2 cell(s) evaluated" in first.stdout, first.stdout
        assert service.named_in(first.stderr), first.stderr
        expect(figures(tmp_path / "a" / "store"), (1, 2))

        second = service.run(b, cwd=tmp_path / "b")
        assert second.returncode == 0, second.stdout + second.stderr
        expect(figures(tmp_path / "b" / "store"), (4,), hidden=24)
        # each run's progress counts its own cells (2, then 1), not the service's so far,
        # and says nothing of watching for checkpoints
        for run, cells in ((first, "2"), (second, "1")):
            totals = re.findall(r"\[rayeval\] \d+/(\d+) cells", run.stderr)
            assert totals and set(totals) == {cells}, run.stderr
            assert "checkpoints" not in run.stderr.split("cell(s), ", 1)[-1], run.stderr

        # A worker lost mid-run: the standing group restarts, the run ends well, and the
        # service goes on
        trap = tmp_path / "trap"
        trapped = write_sweep(str(tmp_path / "a"), name="trap.yaml", workers=2, batch_size=50,
                              output=str(tmp_path / "trap-store"), model={
                                  "factory": "tiny_models:Trap",
                                  "kwargs": {"trap": str(trap), "delay": 0.05}})
        said = tmp_path / "trap.log"
        with open(said, "w") as f:        # the trap is set once planned (the probe runs it)
            lost = subprocess.Popen([sys.executable, "-m", "rayeval", "run", trapped],
                                    cwd=tmp_path / "a", env=service.env, stdout=f, stderr=f)
            wait_for(lambda: "to evaluate" in said.read_text() or lost.poll() is not None, 120,
                     "the trapped run's plan", said)
            trap.write_text("")
            assert lost.wait(600) == 0, said.read_text()
        assert (tmp_path / "trap.fired").exists() and "restart" in said.read_text(), \
            said.read_text()
        expect(figures(tmp_path / "trap-store"), (1, 2))

        wrong = service.run(bad, cwd=tmp_path / "a")
        assert wrong.returncode == 2, wrong.stdout + wrong.stderr
        lines = wrong.stderr.strip().splitlines()       # which service, then the one line
        assert service.named_in(lines[0]) and len(lines) == 2 and "acuracy" in lines[1] and \
            "Traceback" not in wrong.stderr, wrong.stderr
        assert not (tmp_path / "bad-store").exists()

        # A training loop's submission: one new checkpoint, polled until its cell is done
        new = tmp_path / "new" / "step_3.pt"
        new.parent.mkdir()
        torch.save(build_model(seed=3).state_dict(), new)
        job = service.call("POST", "/runs", {"sweep": a, "checkpoints": [str(new)]})["id"]
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            got = service.call("GET", f"/runs/{job}?wait=1")
            if got["state"] not in ("queued", "running"):
                break
        assert got["state"] == "done" and got["exit"] == 0, got
        (cell,) = got["cells"]
        x, y = make_data(ROWS, seed=5)
        ref = reference_metrics(build_model(seed=3), x, y)
        assert cell["ok"] and cell["checkpoint"] == str(new)
        assert {m: v["value"] for m, v in cell["metrics"].items()} == pytest.approx(ref,
                                                                                    rel=1e-9)
        log = service.log.read_text()
        assert log.count(": exit 0,") == 4 and log.count(": exit 2,") == 1, log

        # The service killed under a run: the client says so in one line
        slow = write_sweep(str(tmp_path / "a"), name="slow.yaml", workers=2, batch_size=50,
                           output=str(tmp_path / "slow-store"), model={
                               "factory": "tiny_models:Trap", "kwargs": {
                                   "trap": str(tmp_path / "no-trap"), "delay": 0.5}})
        client = subprocess.Popen([sys.executable, "-m", "rayeval", "run", slow],
                                  cwd=tmp_path / "a", env=service.env, text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        wait_for(lambda: "cell(s)" in service.log.read_text().split("exit 0")[-1] or
                 client.poll() is not None or (tmp_path / "slow-store").exists(), 120,
                 "the slow run under way", service.log)
        time.sleep(1)
        os.kill(service.proc.pid, signal.SIGKILL)         # the service only, as `kill -9 PID`
        out, err = client.communicate(timeout=60)
        assert client.returncode == 1, out + err
        said = [line for line in err.splitlines() if "stopped answering" in line]
        assert len(said) == 1 and "Traceback" not in err, err
        # ... and nothing of its session is left: its Ray went down with it (service_guard:
        # gone 5.3 s after the kill here; without it Ray's dashboard and runtime-env agents
        # lived on for 61.5 s), within a bound that load does not stretch
        service.proc.wait(30)
        killed = time.monotonic()
        while session_processes(service.proc.pid) and time.monotonic() - killed < 30:
            time.sleep(0.2)
        assert not session_processes(service.proc.pid), session_processes(service.proc.pid)
    finally:
        service.stop(signal.SIGKILL)


def test_ctrl_c_stops_a_service_cleanly(tmp_path):
    service = Service(tmp_path, workers=1)
    service.stop(signal.SIGINT)
    assert service.proc.returncode == 130, service.log.read_text()
    assert "service stopped (SIGINT)" in service.log.read_text()
    assert not service.file.exists()
    # a plain run afterwards is a local one: no service file, nothing to find
    from rayeval.integrations import service_client

    os.environ["RAYEVAL_SERVICE_FILE"], saved = str(service.file), os.environ.get(
        "RAYEVAL_SERVICE_FILE")
    try:
        assert service_client.find(None) is None
    finally:
        os.environ["RAYEVAL_SERVICE_FILE"] = saved


def session_processes(session: int) -> list[str]:
    """The live processes of session ``session`` (a process started with a session of its
    own: everything it starts keeps it, orphans included), as "PID ARGS"."""
    out = subprocess.run(["ps", "-eo", "pid=,sid=,stat=,args="], capture_output=True,
                         text=True).stdout
    return [f"{pid} {args}" for pid, sid, stat, args in (
        (line.split(None, 3) + ["", ""])[:4] for line in out.splitlines())
        if sid.isdigit() and int(sid) == session and not stat.startswith("Z")]


def _plugin_dist(folder) -> str:
    """A folder that, on PYTHONPATH, gives a process one more ``rayeval.plugins`` entry point
    (a distribution's metadata only: the client compares entry points, it loads none)."""
    info = folder / "rayeval_extra-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: rayeval-extra\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[rayeval.plugins]\nextra = rayeval_extra:register\n")
    return str(folder)


def test_a_run_goes_to_its_own_environments_service_only_and_says_so(tmp_path):
    """Two services on one machine, under two service files (two environments, as the file
    of each environment is its own): a run goes to the one its environment names, never the
    other; under CI it uses neither unless told; a client whose rayeval differs (here: a
    plugin the service did not start with) is refused in one line; --status and --stop find
    and stop a service."""
    a = sweep_folder(tmp_path / "a", seeds=(1,), workers=1)      # the services' shape
    bad = write_sweep(str(tmp_path / "a"), name="bad.yaml", workers=1, metrics=["acuracy"],
                      output=str(tmp_path / "bad-store"))
    home = tmp_path / "home"                 # B: the default file of a user's environment
    env_b = {k: v for k, v in os.environ.items() if k not in ("RAYEVAL_SERVICE_FILE", "CI")}
    env_b["HOME"] = str(home)
    one = Service(tmp_path, workers=1, name="one")
    try:
        two = Service(tmp_path, workers=1, env=env_b, name="two")
        assert two.file.name.startswith("service-") and two.info["url"] != one.info["url"]

        on_one = one.run(a, cwd=tmp_path / "a")
        assert on_one.returncode == 0 and one.named_in(on_one.stderr), on_one.stderr
        on_two = two.run(bad, cwd=tmp_path / "a")
        assert on_two.returncode == 2 and two.named_in(on_two.stderr), on_two.stderr
        assert "acuracy" in on_two.stderr
        logs = one.log.read_text(), two.log.read_text()       # one line per run taken
        assert logs[0].count("): exit ") == 1 and logs[1].count("): exit ") == 1, logs
        assert f"run {a} " in logs[0] and "bad.yaml" in logs[1] and ": exit 2," in logs[1]

        # Under CI, the default file is not looked for: the same bad sweep fails here
        ci = two.run(bad, cwd=tmp_path / "a", env={**env_b, "CI": "true"})
        assert ci.returncode == 2 and "rayeval service" not in ci.stderr, ci.stderr
        assert len(ci.stderr.strip().splitlines()) == 1 and "acuracy" in ci.stderr
        assert two.log.read_text().count("): exit ") == 1

        # A client with a plugin the service did not start with: refused, in one line
        pp = _plugin_dist(tmp_path / "extra")
        other = one.run(a, cwd=tmp_path / "a", env={
            **one.env, "PYTHONPATH": os.pathsep.join(filter(None, [pp, os.environ.get(
                "PYTHONPATH")]))})
        lines = other.stderr.strip().splitlines()
        assert other.returncode == 2 and len(lines) == 2 and one.named_in(lines[0]), \
            other.stderr
        assert lines[1].startswith(f"error: the rayeval service at {one.info['url']}") and \
            "without the plugin(s) extra = rayeval_extra:register" in lines[1] and \
            "rayeval serve --stop" in lines[1] and "--no-service" in lines[1], lines[1]
        assert one.log.read_text().count("): exit ") == 1       # never queued

        status = one.serve("--status")
        assert status.returncode == 0 and one.info["url"] in status.stderr and \
            f"pid {one.proc.pid}" in status.stderr, status.stderr
        stop = two.serve("--stop")
        assert stop.returncode == 0 and f"pid {two.proc.pid}" in stop.stderr, stop.stderr
        assert two.proc.wait(30) == 143 and not two.file.exists()
        gone = two.serve("--status")
        assert gone.returncode == 1 and "no rayeval service is up" in gone.stderr, gone.stderr
        assert one.proc.poll() is None and one.serve("--status").returncode == 0
    finally:
        for service in (one, locals().get("two")):
            if service is not None:
                service.stop(signal.SIGKILL)
