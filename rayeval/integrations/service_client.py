"""The client side of ``rayeval serve`` (``ui.service``): how ``rayeval run`` finds a
service and runs a sweep on it, printing what the service's run prints, as a local run would.

Kept to the standard library: a run handed to a service costs the client only Python's start
and this module, not torch, pyarrow or Ray.

A service on this machine is found through its file (``service_file``: the URL, the token and
the service's process id, readable by this user only), one per Python environment: a run from
another virtual environment never finds it, and a run under CI (``CI`` set, as every CI system
sets it) looks for none unless told (``RAYEVAL_SERVICE_FILE``, ``--service``). ``--service URL``
names one anywhere, with its token in ``RAYEVAL_SERVICE_TOKEN`` (or the file). A run says first
which service it runs on, and a service refuses a run whose rayeval differs from its own
(``identity``: version, installed source, extras, plugins). The HTTP/JSON API (docs/service.md):

    GET  /health                       {"ok": true, "workers": N, "queued": K, "running": ID,
                                        "pid": PID, "identity": {...}}
    POST /runs {"argv": [...], "cwd": DIR, "identity": {...}}  or
               {"sweep": PATH, "checkpoints": [...], ...}
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

from rayeval.config import constants

SERVICE_FILE_ENV = "RAYEVAL_SERVICE_FILE"
TOKEN_ENV = "RAYEVAL_SERVICE_TOKEN"
CANCEL_WAIT_S = 30.0       # how long a cancelled run may take to stop before the client goes
STOP_WAIT_S = 120.0        # ``serve --stop``: how long a service may take to finish and go
# The optional packages whose presence changes what a run can do (an extra's built-in slice,
# a tracker): a service started before one was installed refuses the run (``differs``).
OPTIONAL = ("transformers", "lm_eval", "lmms_eval", "vllm", "mlflow", "wandb")


@dataclass(frozen=True)
class Found:
    url: str
    token: str
    about: dict          # the service's /health answer: pid, workers, identity
    local: bool = True   # found through this environment's file, not named (--service URL)


class ServiceError(Exception):
    """The service did not answer as it should (one line, for the user)."""


class Refused(ServiceError):
    """The service answered, and refused the request (bad input: the run's or the client's)."""


def service_file() -> str:
    """Where this environment's service writes its URL and token: ``RAYEVAL_SERVICE_FILE``,
    else one file per user and Python environment (``sys.prefix``), so that a run from
    another virtual environment never finds a service it did not start."""
    given = os.environ.get(SERVICE_FILE_ENV)
    if given:
        return given
    import hashlib

    scope = hashlib.sha256(os.path.realpath(sys.prefix).encode()).hexdigest()[:12]
    return os.path.join(os.path.expanduser("~"), ".rayeval", f"service-{scope}.json")


def identity() -> dict:
    """What this install's runs depend on, compared by a service with its own at every run:
    rayeval's version and where it is installed, a digest of its installed files (names,
    sizes, modification times: an edited editable install or a reinstall changes it; ~40 ms),
    the optional packages present and the plugins' entry points."""
    import importlib.util
    from importlib.metadata import entry_points

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))      # rayeval/
    return {"version": constants.installed_version(), "where": root,
            "source": source_digest(root),
            "extras": [m for m in OPTIONAL if importlib.util.find_spec(m) is not None],
            "plugins": sorted(f"{e.name} = {e.value}"
                              for e in entry_points(group="rayeval.plugins"))}


def source_digest(root: str) -> str:
    """A digest of the files under ``root`` as installed: names, sizes and modification
    times (not their bytes: ~40 ms for rayeval's on a loaded 2-core machine)."""
    import hashlib

    h = hashlib.sha256()
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(files):
            st = os.stat(os.path.join(folder, name))
            h.update(f"{os.path.relpath(os.path.join(folder, name), root)}\0{st.st_size}\0"
                     f"{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:16]


def _identity(found: Found) -> dict:
    """What the client sends: its whole ``identity`` to this environment's service, its
    version to one named by URL."""
    return identity() if found.local else {"version": constants.installed_version()}


def differs(service: dict, client: dict) -> str | None:
    """What of the client's ``identity`` differs from the service's, in words; None: alike.
    Only what the client sent is compared: a service named by URL (another machine, a
    cluster's image) is asked for the same version only."""
    if service.get("version") != client["version"] or client.get("where", service.get(
            "where")) != service.get("where"):
        return (f"it runs rayeval {service.get('version')} from {service.get('where')}, this "
                f"command rayeval {client['version']}" + (f" from {client['where']}" if
                                                          "where" in client else ""))
    if client.get("source", service.get("source")) != service.get("source"):
        return (f"rayeval's installed files ({client['where']}) have changed since it "
                "started: it runs the old code")
    for key, what in (("extras", "package"), ("plugins", "plugin")):
        if key not in client:
            continue
        have, want = set(service.get(key) or ()), set(client[key])
        if have != want:
            words = [f"without the {what}(s) {', '.join(sorted(want - have))}"] if want - have \
                else []
            words += [f"with the {what}(s) {', '.join(sorted(have - want))}, since removed"] \
                if have - want else []
            return f"it started {' and '.join(words)}"
    return None


def in_ci() -> bool:
    """A CI job (``CI`` set, as GitHub Actions, GitLab CI, Buildkite and others set it)."""
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def find(url: str | None) -> Found | None:
    """The service to run on: ``url`` (``--service``), else this environment's (``local``),
    except under CI without ``RAYEVAL_SERVICE_FILE``: a CI job on a machine someone else
    serves on runs on its own. None: run here."""
    from rayeval.errors import SpecError

    if not url:
        if in_ci() and not os.environ.get(SERVICE_FILE_ENV):
            return None
        return local()
    token = os.environ.get(TOKEN_ENV)
    info = _read_file()
    url = url.rstrip("/")
    if not token and info and info.get("url") == url:
        token = info.get("token")
    if not token:
        raise SpecError(f"--service {url}: no token; put the service's token in "
                        f"{TOKEN_ENV} (`rayeval serve` prints where it keeps it)")
    try:
        return Found(url, token, call(Found(url, token, {}), "GET", "/health", timeout=5),
                     local=False)
    except ServiceError as e:
        raise SpecError(f"--service {url}: {e}; start it with `rayeval serve`, or run "
                        "without --service") from None


def local() -> Found | None:
    """The service this environment's file names, if its process is alive and it answers."""
    info = _read_file()
    if info is None or not alive(info.get("pid")):
        return None
    found = Found(info["url"], info["token"], {})
    try:
        return Found(found.url, found.token, call(found, "GET", "/health", timeout=2))
    except ServiceError:
        return None                  # a service going down: this run is a local one


def _read_file() -> dict | None:
    try:
        with open(service_file()) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def alive(pid) -> bool:
    """Whether process ``pid`` runs (one that has exited but not been reaped does not)."""
    try:
        os.kill(int(pid), 0)
    except (OSError, TypeError, ValueError):
        return False
    try:
        with open(f"/proc/{int(pid)}/stat") as f:         # Linux: "Z", exited, not reaped
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


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
        raise (Refused if said and 400 <= e.code < 500 else ServiceError)(
            said or f"HTTP {e.code}") from None
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise ServiceError(f"no answer from {found.url} ({getattr(e, 'reason', e)})") from None


def run(found: Found, argv: list[str]) -> int:
    """``rayeval run ARGV`` on the service: its output printed here as it comes, its exit
    status returned. Ctrl-C cancels the run on the service (it stops as a local run does)."""
    tty = sys.stdout.isatty()
    width = os.get_terminal_size().columns if tty else 200
    about = found.about
    print(f"[rayeval] on the rayeval service at {found.url} (pid {about.get('pid')}, "
          f"{about.get('workers')} worker(s), rayeval "
          f"{(about.get('identity') or {}).get('version')}); --no-service runs here",
          file=sys.stderr, flush=True)
    try:
        job = call(found, "POST", "/runs", {"argv": list(argv), "cwd": os.getcwd(),
                                            "width": width, "color": tty,
                                            "identity": _identity(found)})["id"]
        return _follow(found, job)
    except Refused as e:
        print(f"error: {e}", file=sys.stderr)
        return 2                                        # bad input (ui.exit_codes)
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


# --- rayeval serve --status / --stop: this environment's service, from the standard library --

def _local_or_say() -> Found | None:
    """This environment's service, or None after saying there is none."""
    found = local()
    if found is None:
        print(f"[rayeval] no rayeval service is up for this environment ({service_file()})",
              file=sys.stderr)
    return found


def status() -> int:
    """``rayeval serve --status``: this environment's service (exit 0), or that there is none
    (exit 1)."""
    found = _local_or_say()
    if found is None:
        return 1
    about, ident = found.about, found.about.get("identity") or {}
    print(f"[rayeval] rayeval service at {found.url}: pid {about.get('pid')}, "
          f"{about.get('workers')} worker(s), rayeval {ident.get('version')} from "
          f"{ident.get('where')}; running {about.get('running') or 'nothing'}, "
          f"{about.get('queued')} queued; file {service_file()}", file=sys.stderr)
    return 0


def stop() -> int:
    """``rayeval serve --stop``: SIGTERM to this environment's service (its run in progress
    stops as on Ctrl-C, every published cell complete), then wait until it is gone."""
    found = _local_or_say()
    if found is None:
        return 1
    pid = int(found.about["pid"])
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_WAIT_S
    while alive(pid):
        if time.monotonic() > deadline:
            print(f"error: the rayeval service (pid {pid}) is still up {STOP_WAIT_S:.0f} s "
                  f"after SIGTERM; `kill -9 {pid}` ends it", file=sys.stderr)
            return 1
        time.sleep(0.1)
    print(f"[rayeval] stopped the rayeval service at {found.url} (pid {pid})", file=sys.stderr)
    return 0
