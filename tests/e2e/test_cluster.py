"""Tier 4: a real two-node Ray cluster on loopback (`ray start --head` with the dashboard and
token authentication, then `ray start --address` for a second node with its own resources),
`rayeval run --address` and `rayeval submit` through the real Jobs API, and a head without
authentication; every node is stopped at the end of the module."""

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import uuid

import pytest

from s3server import free_port
from support import load_stretch, rayeval_cli

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = pytest.mark.ray


def user_env(**extra) -> dict:
    """The environment of a user who never set RAY_AUTH_MODE."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_AUTH_MODE"}
    env.update(extra)
    return env


class Node:
    """`ray start --block` in its own process group, so the test stops exactly what it started."""

    def __init__(self, args: list[str], env: dict):
        # The test machine's choice, as a cluster owner's would be: the workers at the test's
        # priority, not Ray's 15 steps below it, which other work on a busy machine starves.
        env = {"RAY_worker_niceness": "0", **env}
        self.proc = subprocess.Popen(["ray", "start", "--block", *args], env=env,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     start_new_session=True)

    def stop(self):
        stop_nodes([self])


GRACE_S = 3


def stop_nodes(nodes: list[Node]) -> None:
    """Stop the nodes together: SIGTERM to each node's whole process group, a short grace,
    then SIGKILL to what is left of it. After SIGTERM Ray's GCS server took ~30 s and the
    raylet ~10 s to exit (idle, 2 cores): two nodes stopped one after the other were 34 s of
    teardown, and the unauthenticated head's stop half of its test. Nothing of a node is kept
    (its temp folder is removed), so waiting out its graceful shutdown bought nothing."""
    live = [n for n in nodes if n.proc.poll() is None]
    for n in live:
        _signal_group(n.proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + GRACE_S
    for n in live:
        try:
            n.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for n in live:                  # the group, even when `ray start` itself has exited
        _signal_group(n.proc.pid, signal.SIGKILL)
    for n in live:
        n.proc.wait(timeout=30)


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:      # every process of the group has exited
        pass


def reached(gcs: str, count: int, env: dict, node: Node, timeout: float = 120) -> bool:
    """Whether the cluster at ``gcs`` has ``count`` live nodes within ``timeout`` s (stretched
    by the load), ``node``'s `ray start` still running."""
    script = ("import ray; ray.init(address=%r, logging_level='ERROR'); "
              "print(sum(n['Alive'] for n in ray.nodes()))" % gcs)
    deadline = time.monotonic() + timeout * load_stretch()
    while time.monotonic() < deadline and node.proc.poll() is None:
        out = subprocess.run(["python", "-c", script], env=env, capture_output=True, text=True,
                             timeout=60)
        if out.returncode == 0 and out.stdout.strip().splitlines()[-1:] == [str(count)]:
            return True
        time.sleep(1)
    return False


def wait_for_nodes(gcs: str, count: int, env: dict, node: Node, timeout: float = 120) -> None:
    assert node.proc.poll() is None, "ray start exited"
    if not reached(gcs, count, env, node, timeout):
        pytest.fail(f"the cluster did not reach {count} node(s) within {timeout} s "
                    f"(ray start {'exited' if node.proc.poll() is not None else 'running'})")


def own_ports() -> list[str]:
    """Ports that default to fixed numbers: several nodes on one machine need their own."""
    return [f"--dashboard-agent-listen-port={free_port()}",
            f"--dashboard-agent-grpc-port={free_port()}", f"--metrics-export-port={free_port()}",
            f"--runtime-env-agent-port={free_port()}"]


def start_head(env: dict, temp: str, resources: str,
               tries: int = 3) -> tuple[Node, str, str]:
    """A head node that is up (one live node), its GCS address and dashboard URL, on fresh
    ports at each of up to ``tries`` starts. `ray start` gives its raylet a fixed 30 s to
    register with the GCS (ray/_private/node.py) and exits when it has not: beside another
    end-to-end file on CI's 2 cores, one head's GCS answered too late ("The current node timed
    out during startup", CI of stop 71)."""
    for _ in range(tries):
        port, dash = free_port(), free_port()
        head = Node(["--head", f"--port={port}", "--node-ip-address=127.0.0.1", "--num-cpus=3",
                     f"--resources={resources}", "--include-dashboard=true",
                     "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}",
                     f"--ray-client-server-port={free_port()}", f"--temp-dir={temp}",
                     *own_ports()], env)
        if reached(f"127.0.0.1:{port}", 1, env, head):
            return head, f"127.0.0.1:{port}", f"http://127.0.0.1:{dash}"
        head.stop()
    pytest.fail(f"the head did not start in {tries} starts")


def second_node_args(gcs: str, resources: str) -> list[str]:
    return [f"--address={gcs}", "--node-ip-address=127.0.0.1", "--num-cpus=3",
            f"--resources={resources}", *own_ports()]


@pytest.fixture(scope="module")
def cluster():
    """Two nodes with token auth. `ray start` needs a token to exist (unlike ray.init): one is
    made for this module, and the nodes read it from RAY_AUTH_TOKEN."""
    import secrets

    token = secrets.token_hex(32)
    env = user_env(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token)
    temp = tempfile.mkdtemp(prefix="rt", dir="/tmp")      # short: Ray's socket paths are long
    nodes = []
    try:
        head, gcs, dashboard = start_head(env, temp, '{"slot": 1}')
        nodes.append(head)
        nodes.append(Node(second_node_args(gcs, '{"slot": 1}'), env))
        wait_for_nodes(gcs, 2, env, head)
        yield {"gcs": gcs, "dashboard": dashboard, "token": token}
    finally:
        stop_nodes(nodes)
        shutil.rmtree(temp, ignore_errors=True)


def digits(tmp_path, **settings):
    """The shipped example in tmp_path, with settings appended to its sweep file."""
    example = tmp_path / "digits"
    shutil.copytree(os.path.join(REPO, "configs", "digits"), example,
                    ignore=shutil.ignore_patterns("out"))
    sweep = example / "sweep.yaml"
    text = sweep.read_text()
    for key, value in settings.items():
        text = "\n".join(ln for ln in text.splitlines() if not ln.startswith(f"{key}:"))
        text += f"\n{key}: {json.dumps(value)}\n"
    sweep.write_text(text)
    return sweep


def stored(store) -> dict:
    rows = json.loads(rayeval_cli("leaderboard", str(store), "--format", "json").stdout)
    return {(os.path.basename(r["checkpoint"]), r["evaluation"], r["metric"]): r for r in rows
            if r["metric"] != "aggregate"}


# The tests without the module's cluster come first: on 2 cores, the idle two-node cluster
# beside the unauthenticated head would only slow it down.

def test_unreachable_address_is_one_line_and_fast(tmp_path):
    start = time.monotonic()
    proc = rayeval_cli("run", os.path.join(REPO, "configs", "digits", "sweep.yaml"), "--address",
                       f"127.0.0.1:{free_port()}", "--output", str(tmp_path / "o"))
    assert proc.returncode == 2 and "nothing answers at" in proc.stderr
    assert time.monotonic() - start < 60
    assert not (tmp_path / "o").exists()


def test_submit_to_a_cluster_without_authentication(tmp_path):
    env = user_env(RAY_AUTH_MODE="disabled")
    env.pop("RAY_AUTH_TOKEN", None)
    temp = tempfile.mkdtemp(prefix="rt", dir="/tmp")
    head, gcs, dashboard = start_head(env, temp, "{}")
    try:
        sweep = digits(tmp_path, workers=1)
        # The user's environment may hold a token for another cluster: it must not matter.
        sub = rayeval_cli("submit", str(sweep), "--address", dashboard, "--output",
                          str(tmp_path / "store"), env=user_env(RAY_AUTH_TOKEN=uuid.uuid4().hex),
                          timeout=600)
        assert sub.returncode == 0, (sub.stdout, sub.stderr)
        assert len(stored(tmp_path / "store")) == 24
    finally:
        head.stop()
        shutil.rmtree(temp, ignore_errors=True)


def test_multi_node_submit_equals_a_one_node_run(cluster, tmp_path):
    env = user_env(RAY_AUTH_TOKEN=cluster["token"])
    one = digits(tmp_path / "one")
    proc = rayeval_cli("run", str(one), "--address", cluster["gcs"], "--workers", "1",
                       "--output", str(tmp_path / "one-store"), env=env)
    assert proc.returncode == 0, (proc.stdout, proc.stderr)
    assert "1 worker(s) on 1 node(s)" in proc.stdout

    # One "slot" on each node and one per worker: the two workers land on the two nodes.
    two = digits(tmp_path / "two", resources_per_worker={"CPU": 1, "slot": 1})
    sub = rayeval_cli("submit", str(two), "--address", cluster["dashboard"], "--output",
                      str(tmp_path / "two-store"), env=env, timeout=600)
    assert sub.returncode == 0, (sub.stdout, sub.stderr)
    assert "2 worker(s) on 2 node(s)" in sub.stdout          # the job's own log, streamed
    assert "SUCCEEDED" in sub.stderr
    a, b = stored(tmp_path / "one-store"), stored(tmp_path / "two-store")
    assert set(a) == set(b) and len(a) == 24    # 4 checkpoints x 2 evaluations x 3
    for key, row in a.items():
        assert b[key]["world_size"] == 2 and row["world_size"] == 1
        assert b[key]["num_samples"] == row["num_samples"] == \
            {"clean": 1009, "noisy": 2003}[key[1]]
        assert b[key]["value"] == pytest.approx(row["value"], rel=1e-9), key


def test_no_wait_status_logs_and_stop(cluster, tmp_path):
    env = user_env(RAY_AUTH_TOKEN=cluster["token"])
    sweep = digits(tmp_path, workers=1)
    sub = rayeval_cli("submit", str(sweep), "--address", cluster["dashboard"], "--no-wait",
                      "--output", str(tmp_path / "store"), env=env)
    assert sub.returncode == 0, sub.stderr
    job = sub.stdout.strip()
    assert job.startswith("rayeval-digits-")
    stop = rayeval_cli("jobs", "stop", job, "--address", cluster["dashboard"], env=env)
    assert stop.returncode == 0, stop.stderr
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        status = rayeval_cli("jobs", "status", job, "--address", cluster["dashboard"], env=env)
        assert status.returncode in (0, 1, 3), status.stderr          # 3: still running
        if status.returncode != 3:
            break
        time.sleep(1)
    assert (status.returncode, status.stdout.split(":")[1].split()[0]) in (
        (1, "STOPPED"), (0, "SUCCEEDED")), status.stdout
    listed = rayeval_cli("jobs", "list", "--address", cluster["dashboard"], env=env)
    assert listed.returncode == 0 and job in listed.stdout
    logs = rayeval_cli("jobs", "logs", job, "--address", cluster["dashboard"], env=env)
    assert logs.returncode == 0
    missing = rayeval_cli("jobs", "status", "rayeval-no-such-job", "--address",
                          cluster["dashboard"], env=env)
    assert missing.returncode == 2 and "no such job" in missing.stderr


def test_submit_errors_are_one_line(cluster, tmp_path):
    def one_line(proc, fragment):
        assert proc.returncode == 2, (proc.stdout, proc.stderr)
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
        assert fragment in lines[0], lines[0]

    sweep = digits(tmp_path)
    good = ["--output", str(tmp_path / "store")]
    one_line(rayeval_cli("submit", str(sweep), "--address", cluster["dashboard"], *good,
                         env=user_env(RAY_AUTH_TOKEN="not-the-token")), "refused the token")
    one_line(rayeval_cli("submit", str(sweep), "--address", cluster["dashboard"], *good,
                         env=user_env(RAY_AUTH_TOKEN_PATH=str(tmp_path / "none"),
                                      HOME=str(tmp_path))),
             "uses token authentication and no token was found")
    one_line(rayeval_cli("submit", str(sweep), "--address", f"http://127.0.0.1:{free_port()}",
                         *good, env=user_env()), "nothing answers at")
    one_line(rayeval_cli("submit", str(sweep), "--address", cluster["dashboard"],
                         env=user_env(RAY_AUTH_TOKEN=cluster["token"])),
             "output: 'out' is a local folder relative to the sweep")
    big = digits(tmp_path / "big")
    (big.parent / "blob.bin").write_bytes(b"\0" * (3 << 20))
    one_line(rayeval_cli("submit", str(big), "--address", cluster["dashboard"], *good,
                         env=user_env(RAY_AUTH_TOKEN=cluster["token"],
                                      RAYEVAL_MAX_UPLOAD_MB="2")),
             "over the 2 MiB that may travel with a job")
