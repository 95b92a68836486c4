"""Tier 4: `rayeval run --address` against a real cluster started with `ray start --head`
on loopback, stopped at the end of the module."""

import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time

import pytest

from support import rayeval_cli

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.ray


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _has_token() -> bool:
    path = os.environ.get("RAY_AUTH_TOKEN_PATH") or os.path.expanduser("~/.ray/auth_token")
    return bool(os.environ.get("RAY_AUTH_TOKEN")) or os.path.exists(path)


@pytest.fixture(scope="module")
def head():
    """A head node in the foreground (--block) of its own process group, so the test can stop
    exactly what it started. conftest.py turns token auth on; `ray start` needs a token to
    exist (unlike ray.init), so a fresh machine gets one for this module."""
    added_token = False
    if os.environ.get("RAY_AUTH_MODE") == "token" and not _has_token():
        import secrets

        os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)
        added_token = True
    port = free_port()
    temp = tempfile.mkdtemp(prefix="rt", dir="/tmp")      # short: Ray's socket paths are long
    proc = subprocess.Popen(
        ["ray", "start", "--head", "--block", f"--port={port}", "--node-ip-address=127.0.0.1",
         "--num-cpus=4", "--include-dashboard=false", f"--temp-dir={temp}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 90
    try:
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert proc.poll() is None, "ray start --head exited"
                time.sleep(0.5)
        else:
            pytest.fail("the head node did not open its port within 90 s")
        yield f"127.0.0.1:{port}"
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        shutil.rmtree(temp, ignore_errors=True)
        if added_token:
            del os.environ["RAY_AUTH_TOKEN"]


def test_run_on_an_existing_cluster(head, tmp_path):
    example = tmp_path / "digits"
    shutil.copytree(os.path.join(REPO, "configs", "digits"), example,
                    ignore=shutil.ignore_patterns("out"))
    proc = rayeval_cli("run", str(example / "sweep.yaml"), "--address", head, "--output",
                       str(tmp_path / "store"), cwd=str(tmp_path))
    assert proc.returncode == 0, (proc.stdout, proc.stderr)
    rows = json.loads(rayeval_cli("leaderboard", str(tmp_path / "store"), "--format",
                                  "json").stdout)
    assert len(rows) == 12 and {r["num_samples"] for r in rows} == {2003}


def test_unreachable_address_is_one_line_and_fast(tmp_path):
    start = time.monotonic()
    proc = rayeval_cli("run", os.path.join(REPO, "configs", "digits", "sweep.yaml"), "--address",
                       f"127.0.0.1:{free_port()}", "--output", str(tmp_path / "o"))
    assert proc.returncode == 2 and "nothing answers at" in proc.stderr
    assert time.monotonic() - start < 60
    assert not (tmp_path / "o").exists()
