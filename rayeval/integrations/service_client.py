"""The client side of ``rayeval serve`` (``ui.service``): how ``rayeval run`` finds a
service and runs a sweep on it, printing what the service's run prints, as a local run would.

Kept to the standard library: a run handed to a service costs the client only Python's start
and this module, not torch, pyarrow or Ray.

A service on this machine is found through its file (``service_file``: the URL, the token and
the service's process id, readable by this user only); ``--service URL`` names one anywhere,
with its token in ``RAYEVAL_SERVICE_TOKEN`` (or the file). The HTTP/JSON API (docs/service.md):

    GET  /health                       {"ok": true, "workers": N, "queued": K, "running": ID}
    POST /runs {"argv": [...], "cwd": DIR}  or  {"sweep": PATH, "checkpoints": [...], ...}
                                       {"id": ID}
    GET  /runs/ID?after=N&wait=S       {"state", "exit", "output": [[stream, text], ...],
                                        "next": N, "cells": [...]}
    POST /runs/ID/cancel               {"state"}

Every request carries ``Authorization: Bearer TOKEN``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from dataclasses import dataclass

SERVICE_FILE_ENV = "RAYEVAL_SERVICE_FILE"
TOKEN_ENV = "RAYEVAL_SERVICE_TOKEN"
CANCEL_WAIT_S = 30.0       # how long a cancelled run may take to stop before the client goes


@dataclass(frozen=True)
class Found:
    url: str
    token: str


class ServiceError(Exception):
    """The service did not answer as it should (one line, for the user)."""


def service_file() -> str:
    """Where the service on this machine writes its URL and token."""
    return os.environ.get(SERVICE_FILE_ENV) or os.path.join(
        os.path.expanduser("~"), ".rayeval", "service.json")


def find(url: str | None) -> Found | None:
    """The service to run on: ``url`` (``--service``), else the one this machine's service
    file names if its process is alive and it answers; None: run here."""
    from rayeval.errors import SpecError

    token = os.environ.get(TOKEN_ENV)
    info = _read_file()
    if url:
        url = url.rstrip("/")
        if not token and info and info.get("url") == url:
            token = info.get("token")
        if not token:
            raise SpecError(f"--service {url}: no token; put the service's token in "
                            f"{TOKEN_ENV} (`rayeval serve` prints where it keeps it)")
        found = Found(url, token)
        try:
            call(found, "GET", "/health", timeout=5)
        except ServiceError as e:
            raise SpecError(f"--service {url}: {e}; start it with `rayeval serve`, or run "
                            "without --service") from None
        return found
    if info is None or not _alive(info.get("pid")):
        return None
    found = Found(info["url"], info["token"])
    try:
        call(found, "GET", "/health", timeout=2)
    except ServiceError:
        return None                  # a service going down: this run is a local one
    return found


def _read_file() -> dict | None:
    try:
        with open(service_file()) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _alive(pid) -> bool:
    try:
        os.kill(int(pid), 0)
        return True
    except (OSError, TypeError, ValueError):
        return False


def call(found: Found, method: str, path: str, body: dict | None = None,
         timeout: float = 30.0) -> dict:
    """One request to the service, its JSON answer; ServiceError when none comes."""
    import urllib.error        # here: a run without a service never pays for urllib (0.07 s)
    import urllib.request

    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(found.url + path, data=data, method=method, headers={
        "Authorization": f"Bearer {found.token}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        try:
            said = json.loads(e.read()).get("error", "")
        except ValueError:
            said = ""
        raise ServiceError(said or f"HTTP {e.code}") from None
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise ServiceError(f"no answer from {found.url} ({getattr(e, 'reason', e)})") from None


def run(found: Found, argv: list[str]) -> int:
    """``rayeval run ARGV`` on the service: its output printed here as it comes, its exit
    status returned. Ctrl-C cancels the run on the service (it stops as a local run does)."""
    tty = sys.stdout.isatty()
    width = os.get_terminal_size().columns if tty else 200
    try:
        job = call(found, "POST", "/runs", {"argv": list(argv), "cwd": os.getcwd(),
                                            "width": width, "color": tty})["id"]
        return _follow(found, job)
    except ServiceError as e:
        print(f"error: the rayeval service at {found.url} stopped answering ({e}); what it "
              "published is complete: run again (`--no-service` runs here)", file=sys.stderr)
        return 1


def _follow(found: Found, job: str) -> int:
    after, cancelled = 0, None
    while True:
        try:
            got = call(found, "GET", f"/runs/{job}?after={after}&wait=1", timeout=30)
        except KeyboardInterrupt as e:
            if cancelled is not None:            # a second Ctrl-C: leave now
                return 128 + getattr(e, "signum", signal.SIGINT)
            cancelled = time.monotonic()
            call(found, "POST", f"/runs/{job}/cancel", timeout=10)
            continue
        for stream, text in got["output"]:
            (sys.stdout if stream == "out" else sys.stderr).write(text)
        sys.stdout.flush()
        sys.stderr.flush()
        after = got["next"]
        if got["state"] not in ("queued", "running"):
            return int(got["exit"]) if got["exit"] is not None else 1
        if cancelled is not None and time.monotonic() - cancelled > CANCEL_WAIT_S:
            print(f"[rayeval] the service has not stopped run {job} yet; leaving it",
                  file=sys.stderr)
            return 130
