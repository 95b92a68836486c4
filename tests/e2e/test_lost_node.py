"""Tier 4: a node lost whole mid-sweep. Three Ray nodes on loopback (a head that holds no
Train worker, and two nodes that can each hold both), a sweep submitted as a Ray Job
(`rayeval submit`), and at its first published cell the node holding both workers is SIGKILLed
whole: its `ray start`, raylet, object store, agents and workers, at once. The worker group
restarts on the node left, with rayeval's default `recovery:` settings; the run exits 0, every
figure equals the plain single-process loop's, each cell is written once, and the run's output
says the group was restarted.

Each node is `ray start --block` in a session of its own. Ray's daemons and workers inherit the
session, but a worker gets a process group of its own: a node is the processes of its session,
not of its group. Which node holds the workers is read at run time: each process that runs the
tiny model writes the rows it scores to a file named by its pid (``support.MODEL_MODULE``'s
``count``), and the node is the one whose session holds those pids."""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field

import pytest
import torch

from rayeval.io.store import ResultStore
from s3server import free_port
from support import (build_model, load_stretch, make_data, reference_metrics,
                     write_model_module, write_parquet, write_sweep)
from test_cluster import own_ports, user_env

pytestmark = pytest.mark.ray

ROWS = 1011              # 505 + 506 rows on 2 workers (the Trap counts distinct rows)
SEEDS = (1, 2, 3)        # one cell each: one published before the kill, one in flight, one left
RUN_S = 240.0            # the submitted run, kill and restart included (stretched by the load)


# --- the nodes -------------------------------------------------------------------------------

class RayNode:
    """`ray start --block ARGS` in a session of its own, its output in ``log``."""

    def __init__(self, args: list[str], env: dict, log: str):
        # The workers at the test's priority, as test_cluster.Node starts them.
        self.log = log
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(["ray", "start", "--block", *args],
                                         env={"RAY_worker_niceness": "0", **env}, stdout=out,
                                         stderr=subprocess.STDOUT, start_new_session=True)

    def said(self) -> str:
        with open(self.log, errors="replace") as f:
            return f.read()[-3000:]


def session(sid: int) -> set[int]:
    """The live processes of session ``sid``."""
    pids = set()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                state, _, _, sess = f.read().rsplit(")", 1)[1].split()[:4]
        except (OSError, ValueError):       # ended meanwhile
            continue
        if int(sess) == sid and state != "Z":
            pids.add(int(name))
    return pids


def kill_node(node: RayNode) -> None:
    """SIGKILL the whole node: its process group, then what of its session is outside the
    group (the workers)."""
    try:
        os.killpg(node.proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for pid in session(node.proc.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def gone(node: RayNode, timeout: float = 30) -> bool:
    """Whether every process of the node has ended within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while session(node.proc.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    try:
        node.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        return False
    return not session(node.proc.pid)


@dataclass
class Cluster:
    dashboard: str
    token: str
    workers: list[RayNode] = field(default_factory=list)   # each can hold both Train workers

    def ask(self, what: str) -> list[dict]:
        """Ray's state API (``/api/v0/WHAT``): the dashboard over HTTP, with the token."""
        req = urllib.request.Request(f"{self.dashboard}/api/v0/{what}?detail=1&limit=10000",
                                     headers={"Authorization": f"Bearer {self.token}"})
        with urllib.request.urlopen(req, timeout=30) as answer:
            return json.load(answer)["data"]["result"]["result"]

    def joined(self, count: int, node: RayNode, timeout: float = 60) -> bool:
        """Whether ``count`` nodes are alive within ``timeout`` s (stretched by the load),
        ``node``'s `ray start` still running."""
        deadline = time.monotonic() + timeout * load_stretch()
        while node.proc.poll() is None and time.monotonic() < deadline:
            try:
                if sum(n["state"] == "ALIVE" for n in self.ask("nodes")) == count:
                    return True
            except (OSError, ValueError, KeyError):       # the dashboard is not up yet
                pass
            time.sleep(0.5)
        return False

    def actors_on(self, node: RayNode) -> list[str]:
        """The class names of the node's live actors."""
        pids = session(node.proc.pid)
        return sorted(a["class_name"] for a in self.ask("actors")
                      if a["state"] == "ALIVE" and a.get("pid") in pids)


@pytest.fixture
def cluster():
    """A head of 1 CPU and two nodes of 2 CPUs and "pool": 2, with this test's own token (every
    node and client); every node SIGKILLed whole at the end and its temp folder removed. One
    cluster per case: a case kills one of its nodes."""
    import secrets

    token = secrets.token_hex(32)
    env = user_env(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token)
    temp = tempfile.mkdtemp(prefix="rt", dir="/tmp")      # short: Ray's socket paths are long
    nodes: list[RayNode] = []
    try:
        cluster, port = head_node(env, temp, token, nodes)
        for count in (2, 3):
            nodes.append(worker_node(cluster, count, f"127.0.0.1:{port}", env, temp))
            cluster.workers.append(nodes[-1])
        yield cluster
    finally:
        for n in nodes:
            kill_node(n)
        left = [n.proc.pid for n in nodes if not gone(n)]
        shutil.rmtree(temp, ignore_errors=True)
        assert not left, f"processes of the sessions {left} outlived SIGKILL"


def head_node(env: dict, temp: str, token: str, nodes: list[RayNode],
              tries: int = 3) -> tuple[Cluster, int]:
    """The head (appended to ``nodes``, so the fixture stops every start) and its GCS port, on
    fresh ports at each of up to ``tries`` starts. `ray start` gives its raylet a fixed 30 s to
    register with the GCS (ray/_private/node.py) and exits when it has not: beside another
    end-to-end file on CI's 2 cores, one head's GCS answered too late and the case failed at
    setup ("The current node timed out during startup", CI of stop 71)."""
    for attempt in range(tries):
        port, dash = free_port(), free_port()
        cluster = Cluster(f"http://127.0.0.1:{dash}", token)
        nodes.append(RayNode([
            "--head", f"--port={port}", "--node-ip-address=127.0.0.1", "--num-cpus=1",
            "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}",
            f"--ray-client-server-port={free_port()}", f"--temp-dir={temp}", *own_ports()],
            env, os.path.join(temp, f"head{attempt}.out")))
        if cluster.joined(1, nodes[-1]):
            return cluster, port
        kill_node(nodes[-1])
        gone(nodes[-1])
    pytest.fail(f"the head did not start in {tries} starts:\n{nodes[-1].said()}")


def worker_node(cluster: Cluster, count: int, gcs: str, env: dict, temp: str,
                tries: int = 3) -> RayNode:
    """The cluster's ``count``-th node, started once the one before it is up: two raylets
    starting together on one host collided on a port ("bind: Address already in use") and one
    `ray start` gave up, and so may one beside another Ray on a shared machine: up to
    ``tries`` starts."""
    for _ in range(tries):
        node = RayNode([f"--address={gcs}", "--node-ip-address=127.0.0.1", "--num-cpus=2",
                        '--resources={"pool": 2}', *own_ports()], env,
                       os.path.join(temp, f"node{count}.out"))
        if cluster.joined(count, node):
            return node
        kill_node(node)
        gone(node)
    pytest.fail(f"node {count} did not join in {tries} starts:\n{node.said()}")


# --- the run -----------------------------------------------------------------------------------

def published(store) -> bool:
    """The first cell published (its file under results/)."""
    return bool(cell_files(store))


def states_files(store) -> list[str]:
    """The cells kept in progress (their files under states/)."""
    d = store / "states"
    return sorted(p.name for p in d.iterdir()) if d.is_dir() else []


def kept_in_progress(store) -> bool:
    """A cell's states kept mid-way (a file under states/)."""
    return bool(states_files(store))


def cell_files(store) -> dict[str, int]:
    """The cell files under results/ and their modification times."""
    found = {}
    d = store / "results"
    for p in d.iterdir() if d.is_dir() else ():
        try:
            if not p.name.startswith("."):
                found[p.name] = p.stat().st_mtime_ns
        except FileNotFoundError:           # moved into a part at the run's end
            pass
    return found


@dataclass
class Watch:
    """What the test sees of a run as it goes: each cell file's modification times, and the
    session (the node) of each process that scored rows, read while it lives."""
    store: object
    count: object
    written: dict[str, set[int]] = field(default_factory=dict)
    where: dict[int, int] = field(default_factory=dict)

    def look(self) -> None:
        for name, mtime in cell_files(self.store).items():
            self.written.setdefault(name, set()).add(mtime)
        for p in self.count.iterdir():
            if int(p.name) not in self.where:
                try:
                    self.where[int(p.name)] = os.getsid(int(p.name))
                except ProcessLookupError:
                    pass

    def on(self, node: RayNode) -> set[int]:
        return {pid for pid, sid in self.where.items() if sid == node.proc.pid}

    def rows(self) -> dict[int, int]:
        """Rows scored, by process id."""
        return {int(p.name): sum(int(n) for n in p.read_text().split())
                for p in self.count.iterdir()}


def sweep_folder(folder, store, count, extra: dict, delay: float) -> str:
    """The job's folder: the tiny model, ROWS rows, a checkpoint a seed; its sweep file."""
    for d in (folder, folder / "ckpts", count):
        d.mkdir()
    write_model_module(str(folder))
    write_parquet(str(folder / "data.parquet"), *make_data(ROWS, seed=5))
    for s in SEEDS:
        torch.save(build_model(seed=s).state_dict(), folder / "ckpts" / f"step_{s}.pt")
    # DELAY s a batch of 50: DELAY x 10 s a cell on 2 workers, so cells are left after the
    # kill. Each process writes the rows it scores to count/PID.
    model = {"factory": "tiny_models:Trap", "kwargs": {
        "trap": str(count.parent / "no-trap"), "delay": delay, "count": str(count)}}
    return write_sweep(str(folder), workers=2, batch_size=50, model=model, output=str(store),
                       resources_per_worker={"CPU": 1, "pool": 1}, **extra)


# The sweep's extra top-level keys, and the moment of the kill (a function of the store).
# "plain": no cell is kept in progress (resume.every 0), so the cell in flight at the kill is
# scored again from its first row by the restarted group.
# "resumed": kept every second; a cell takes about 4 s (a range lasts at least 49 times its
# fixed cost, so a 1 s cell would be one range, never kept mid-way), and the kill comes once
# the cell in flight has kept states: the restarted group goes on from them.
@pytest.mark.parametrize("extra, delay, kill_at", [
    pytest.param({"resume": {"every": 0}}, 0.1, published, id="plain"),
    pytest.param({"resume": {"every": 1}}, 0.4, kept_in_progress, id="resumed"),
])
def test_a_lost_node_is_survived(cluster, tmp_path, one_torch_thread, extra, delay, kill_at):
    store, count = tmp_path / "store", tmp_path / "count"
    sweep = sweep_folder(tmp_path / "job", store, count, extra, delay)
    log_path = tmp_path / "submit.log"
    with open(log_path, "w") as log:
        run = subprocess.Popen(
            [sys.executable, "-m", "rayeval", "submit", sweep, "--address", cluster.dashboard],
            cwd=str(tmp_path / "job"), stdout=log, stderr=subprocess.STDOUT,
            env=user_env(RAY_AUTH_TOKEN=cluster.token), start_new_session=True)
    watch = Watch(store, count)
    try:
        began = time.monotonic()
        deadline = began + RUN_S * load_stretch()
        while not kill_at(store) and run.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert kill_at(store) and run.poll() is None, log_path.read_text()
        watch.look()
        holders = [n for n in cluster.workers if watch.on(n)]
        assert len(holders) == 1 and len(watch.on(holders[0])) == 2, \
            ("both workers on one node", watch.where)
        lost = holders[0]
        before = set(watch.rows())
        lost_actors = cluster.actors_on(lost)     # what the failure of the run may be about
        kill_node(lost)
        killed_at = time.monotonic() - began
        assert gone(lost), "the node's processes outlived SIGKILL"
        kept = len(cell_files(store))
        in_progress = states_files(store)
        while run.poll() is None and time.monotonic() < deadline:
            watch.look()
            time.sleep(0.1)
        watch.look()
        text = log_path.read_text()
        assert run.poll() == 0, f"the actors of the lost node: {lost_actors}\n{text}"
        print(f"\nkilled at {killed_at:.1f} s with {kept} cell(s) published ({lost_actors} "
              f"on the node); finished at {time.monotonic() - began:.1f} s")
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
            run.wait(30)

    assert "restarting the worker group (1 of" in text and \
        "worker group restarted (attempt 2)" in text, text
    (survivor,) = [n for n in cluster.workers if n is not lost]
    after = {pid: rows for pid, rows in watch.rows().items() if pid not in before}
    assert after and set(after) <= watch.on(survivor), \
        ("restarted on the node left", watch.where)
    # Each cell written once: no cell file written twice, and no row of a cell published
    # before the kill scored again.
    assert all(len(times) == 1 for times in watch.written.values()), watch.written
    assert sum(after.values()) <= (len(SEEDS) - kept) * ROWS, (after, kept)
    if extra["resume"]["every"]:
        # The cell in flight had kept states at the kill: the restarted group went on from
        # them (rows are scored once: the kept buckets are not scored again)
        assert in_progress and sum(after.values()) < (len(SEEDS) - kept) * ROWS, \
            (after, kept, in_progress)
    rows = ResultStore(str(store)).read(["cell", "checkpoint", "metric", "value"]).to_pylist()
    assert len(rows) == len({(r["cell"], r["metric"]) for r in rows}) == len(SEEDS) * 3
    got = {(os.path.basename(r["checkpoint"]), r["metric"]): r["value"] for r in rows}
    x, y = make_data(ROWS, seed=5)
    for s in SEEDS:
        for metric, value in reference_metrics(build_model(seed=s), x, y).items():
            assert got[(f"step_{s}.pt", metric)] == pytest.approx(value, rel=1e-9), \
                (s, metric)
