"""``rayeval serve``: Ray, the imports and a worker group kept up, taking sweeps one after the
other, so that a run costs its checkpoints' loads and passes, not a start (docs/service.md).

    rayeval serve --workers 2          # foreground; prints "ready" once it takes sweeps
    rayeval run sweep.yaml             # elsewhere on this machine: runs on the service

The service is one process. Its main thread runs the queued runs, each exactly as ``rayeval
run`` would (``cli.dispatch``, handed to ``serve``: the same pre-flight errors, board, summary
and exit status), with what it prints sent to the client that asked (``service_client``),
and the service sits on the command line's floor for that reason; an HTTP/JSON API on
loopback (token-authenticated, ``service_client``'s docstring) takes the runs and answers the
polls from a thread. The worker group stands between runs (``driver.StandingGroups``): a
sweep whose workers are alike runs on it, its workers set up for that sweep's plan in the
same processes; a sweep Ray Data feeds, or with other workers, gets its own group.

What a long-lived process must not keep, it does not: the sweep's own modules (``my_models``)
are imported again for each run (``execution.user_code``); a plugin edited since the service
started fails the run with a line that says to restart it (its code is loaded once); each run
reads its sweep, data and checkpoints again, so nothing is served from a stale copy.
"""

from __future__ import annotations

import contextlib
import hmac
import io
import json
import os
import secrets
import signal
import threading
import time
import traceback
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

from rayeval.errors import RunError, SpecError
from rayeval.integrations.service_client import TOKEN_ENV, service_file
from rayeval.ui.exit_codes import EXIT_BAD_INPUT, EXIT_CELLS_FAILED

KEEP_JOBS = 200              # finished runs kept for polling
READY_TIMEOUT_S = 600.0      # the first worker group's start, at most
POLL_WAIT_MAX_S = 5.0


@dataclass
class Job:
    """One run asked of the service: its command line and folder, and what it printed."""
    id: str
    argv: list[str]
    cwd: str
    width: int = 200
    color: bool = False
    state: str = "queued"          # queued, running, done, cancelled
    exit: int | None = None
    output: list[tuple[str, str]] = field(default_factory=list)   # (out | err, text)
    cells: list[dict] = field(default_factory=list)
    submitted: float = field(default_factory=time.time)

    def view(self, after: int) -> dict:
        return {"id": self.id, "state": self.state, "exit": self.exit,
                "output": self.output[after:], "next": len(self.output), "cells": self.cells}


class _Stream(io.TextIOBase):
    """A job's stdout or stderr: what is written goes to the client's next poll."""

    def __init__(self, service: Service, job: Job, name: str):
        self.service, self.job, self.name = service, job, name

    def write(self, text: str) -> int:
        if text:
            with self.service.cond:
                self.job.output.append((self.name, text))
                self.service.cond.notify_all()
        return len(text)

    def isatty(self) -> bool:
        return False


class Service:
    def __init__(self, command, workers: int, host: str, port: int, address: str | None,
                 verbose: bool, use_gpu: bool = False):
        self.command = command     # the CLI's: (argv, out, err, standing=, seen=) -> status
        self.workers, self.host, self.port = workers, host, port
        self.address, self.verbose, self.use_gpu = address, verbose, use_gpu
        # a cluster's service takes its token from a Secret; on one machine, a new one
        self.token = os.environ.get(TOKEN_ENV) or secrets.token_urlsafe(24)
        self.cond = threading.Condition()
        self.jobs: dict[str, Job] = {}
        self.queue: list[Job] = []
        self.running: Job | None = None
        self.cancelling: str | None = None        # the running job a cancel was sent to
        self.last_cancel = -1e9                   # when (monotonic) the last one was sent
        self.plugins: dict[str, str] = {}
        self.identity: dict = {}                  # service_client.identity() at the start
        self.guard: int | None = None             # the pipe only this process holds open
        self.standing = None
        self.http: ThreadingHTTPServer | None = None
        self.url = ""

    # --- the API's side (the HTTP thread) -------------------------------------------------

    def submit(self, body: dict) -> Job:
        from rayeval.integrations import service_client

        client = body.get("identity")     # `rayeval run`'s; the HTTP API's callers send none
        why = service_client.differs(self.identity, client) if client else None
        if why:
            raise SpecError(f"the rayeval service at {self.url} (pid {os.getpid()}) cannot take "
                            f"this run: {why}; restart it (`rayeval serve --stop`, then "
                            "`rayeval serve`) or run here with --no-service")
        argv, cwd = _argv(body), body.get("cwd") or os.getcwd()
        if not os.path.isdir(cwd):
            raise SpecError(f"cwd: {cwd!r} is not a folder")
        job = Job(uuid.uuid4().hex[:12], argv, cwd, int(body.get("width") or 200),
                  bool(body.get("color")))
        with self.cond:
            self.jobs[job.id] = job
            self.queue.append(job)
            for old in [j for j in self.jobs.values() if j.state in ("done", "cancelled")
                        ][:-KEEP_JOBS]:
                del self.jobs[old.id]
            self.cond.notify_all()
        return job

    def poll(self, job_id: str, after: int, wait: float) -> dict:
        with self.cond:
            job = self._job(job_id)
            self.cond.wait_for(lambda: len(job.output) > after or job.state in (
                "done", "cancelled"), timeout=min(max(wait, 0.0), POLL_WAIT_MAX_S))
            return job.view(after)

    def cancel(self, job_id: str) -> dict:
        """A queued run is dropped; the running one gets the signal a local run would (it
        stops as Ctrl-C stops ``rayeval run``); the service goes on."""
        with self.cond:
            job = self._job(job_id)
            if job.state == "queued":
                self.queue.remove(job)
                job.state, job.exit = "cancelled", 130
                job.output.append(("err", "[rayeval] cancelled before it started\n"))
                self.cond.notify_all()
            elif job.state == "running" and self.cancelling is None:
                self.cancelling, self.last_cancel = job.id, time.monotonic()
                signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
            return {"state": job.state}

    def health(self) -> dict:
        with self.cond:
            return {"ok": True, "workers": self.workers, "queued": len(self.queue),
                    "running": self.running.id if self.running else None,
                    "pid": os.getpid(), "identity": self.identity}

    def _job(self, job_id: str) -> Job:
        job = self.jobs.get(job_id)
        if job is None:
            raise KeyError(job_id)
        return job

    # --- the main thread ----------------------------------------------------------------------

    def serve(self, say) -> int:
        """Up, ready, the runs one by one until SIGINT/SIGTERM; then down, cleanly."""
        from rayeval.execution import signals

        self._refuse_a_second()
        try:
            self._start(say)
            say(f"[rayeval] service ready on {self.url} ({self.workers} worker(s), rayeval "
                f"{self.identity['version']}): `rayeval run SWEEP` in this Python environment "
                f"runs here (its file: {service_file()}); Ctrl-C or `rayeval serve --stop` "
                "stops it")
            while True:
                try:
                    job = self._next()
                    if job is not None:
                        began = time.perf_counter()
                        try:
                            self._execute(job)
                        finally:
                            say(f"[rayeval] run {job.id}: rayeval {' '.join(job.argv)} (in "
                                f"{job.cwd}): exit {job.exit}, "
                                f"{time.perf_counter() - began:.1f} s")
                except KeyboardInterrupt:
                    if time.monotonic() - self.last_cancel > 5:
                        raise
                    # a cancel's signal that landed as its run ended: the service goes on
        except KeyboardInterrupt as e:
            say(f"[rayeval] service stopped ({signals.name(e)})")
            return signals.exit_code(e)
        finally:
            with signals.held():
                self._stop()

    def _refuse_a_second(self) -> None:
        from rayeval.integrations import service_client

        if self.host in ("127.0.0.1", "localhost") and service_client.local() is not None:
            raise SpecError(f"a rayeval service is already up on this machine "
                            f"({service_file()}); stop it first, or set "
                            f"{service_client.SERVICE_FILE_ENV} to keep another's file apart")

    def _start(self, say) -> None:
        # What every run needs, imported once: the point of the service.
        import torch  # noqa: F401
        import ray.train  # noqa: F401
        from rayeval import api  # noqa: F401
        from rayeval.config import plugins
        from rayeval.execution import driver, signals, user_code  # noqa: F401
        from rayeval.execution.workers import worker  # noqa: F401
        from rayeval.execution.lifecycle import start_ray_for
        from rayeval.plan import preflight  # noqa: F401
        from rayeval.ranking import build_board  # noqa: F401

        from rayeval.integrations.service_client import identity

        _warm()
        self.plugins = _plugin_digests(plugins)
        self.identity = identity()
        if not self.address:
            self.guard = _guard()      # its Ray goes down with it (service_guard)
        self.started_ray = start_ray_for(self.workers, self.use_gpu, self.address,
                                         self.verbose)
        signals.install()
        self.standing = driver.StandingGroups()
        group = self.standing.start(driver.Shape(self.workers, self.use_gpu))
        user_code.mark()
        self._listen()
        deadline = time.monotonic() + READY_TIMEOUT_S
        while group.ledger.ranks_up() < self.workers:
            if not group.alive or time.monotonic() > deadline:
                raise RunError(f"the service's worker group did not start "
                               f"({group.fit.error or 'timed out'}); see --verbose")
            time.sleep(0.1)
        self._write_file()

    def _listen(self) -> None:
        try:
            self.http = ThreadingHTTPServer((self.host, self.port), _handler(self))
        except OSError as e:
            raise SpecError(f"--host {self.host} --port {self.port}: cannot listen there "
                            f"({e.strerror or e}); choose another port (0: any free one)") from None
        self.http.daemon_threads = True
        host, port = self.http.server_address[:2]
        self.url = f"http://{host}:{port}"
        threading.Thread(target=self.http.serve_forever, name="rayeval-service-http",
                         daemon=True).start()

    def _write_file(self) -> None:
        path = service_file()
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"url": self.url, "token": self.token, "pid": os.getpid(),
                       "workers": self.workers, "identity": self.identity}, f)
        os.replace(tmp, path)

    def _next(self) -> Job | None:
        with self.cond:
            self.cond.wait_for(lambda: self.queue, timeout=0.5)
            if not self.queue:
                return None
            job = self.queue.pop(0)
            job.state, self.running = "running", job
            return job

    def _execute(self, job: Job) -> None:
        from rich.console import Console

        from rayeval.execution import user_code

        out, err = _Stream(self, job, "out"), _Stream(self, job, "err")
        consoles = [Console(file=f, width=job.width, force_terminal=job.color,
                            color_system="standard" if job.color else None, highlight=False)
                    for f in (out, err)]
        here = os.getcwd()
        code = EXIT_BAD_INPUT
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                try:
                    os.chdir(job.cwd)
                    user_code.forget()           # the sweep's modules, read again
                    changed = self._plugin_changed()
                    if changed:
                        consoles[1].print(f"[bold red]error:[/] plugin {changed} changed since "
                                          "`rayeval serve` started (a plugin's code is loaded "
                                          "once); restart the service", soft_wrap=True)
                    else:
                        code = self.command(
                            job.argv, *consoles, standing=self.standing,
                            seen=lambda report, stored: self._seen(job, report, stored))
                except SystemExit as e:                 # argparse's usage error
                    code = e.code if isinstance(e.code, int) else EXIT_BAD_INPUT
                except Exception:                       # a bug: the run's, not the service's
                    traceback.print_exc()
                    code = EXIT_CELLS_FAILED
                    if self.standing is not None:
                        self.standing.close(timeout_s=5)
        finally:
            os.chdir(here)
            with self.cond:
                cancelled = self.cancelling == job.id
                self.cancelling = None
                job.state, job.exit, self.running = "done", code, None
                self.cond.notify_all()
        if code in (130, 143) and not cancelled:
            raise KeyboardInterrupt    # the service's own Ctrl-C, mid-run: it stops too

    def _seen(self, job: Job, report, stored: list[dict]) -> None:
        """The run's cells and their figures (from the store's rows the run's board was
        built from), for the API's polls."""
        plan = report.plan
        cells = {c.key: {"key": c.key, "checkpoint": c.checkpoint.location,
                         "evaluation": c.evaluation, "ok": True, "error": None,
                         "cached": c in plan.cached, "metrics": {}}
                 for c in plan.cells + plan.cached}
        for o in report.outcomes:
            if o.key in cells:
                cells[o.key].update(ok=o.ok, error=o.error, step=o.step)
        for r in stored:
            if r["cell"] in cells:
                cells[r["cell"]]["step"] = r["step"]
                cells[r["cell"]]["metrics"][r["metric"]] = {
                    "value": r["value"], "ci_low": r["ci_low"], "ci_high": r["ci_high"]}
        job.cells = list(cells.values())

    def _plugin_changed(self) -> str | None:
        from rayeval.config import plugins

        now = _plugin_digests(plugins)
        return next((name for name, digest in now.items()
                     if self.plugins.get(name) != digest), None)

    def _stop(self) -> None:
        with self.cond:
            for job in self.queue:
                job.state, job.exit = "cancelled", 130
                job.output.append(("err", "[rayeval] the service stopped before this run\n"))
            self.queue.clear()
            self.cond.notify_all()
        try:
            info = json.load(open(service_file()))
            if info.get("pid") == os.getpid():
                os.remove(service_file())
        except (OSError, ValueError):
            pass
        if self.standing is not None:
            self.standing.close(timeout_s=10)
        if self.http is not None:
            self.http.shutdown()
        if getattr(self, "started_ray", False):
            import ray

            ray.shutdown()


def _guard() -> int:
    """Start ``service_guard`` (its docstring: the local Ray goes down with this process,
    even a SIGKILLed one); the pipe's end it waits on, held open until this process ends."""
    import subprocess
    import sys

    read, write = os.pipe()          # not inherited by anything started later (PEP 446)
    try:
        subprocess.Popen([sys.executable, "-m", "rayeval.ui.service_guard"], stdin=read)
    finally:
        os.close(read)
    return write


def _warm() -> None:
    """What a first run would otherwise pay in the service: the planner's probe runs the
    model on the meta device, whose first call imports torch._dynamo (1.6 s of a 2.3 s first
    plan of the digits example, measured); the checkpoint layouts' readers."""
    import torch

    from rayeval.execution.workers.worker import warm

    with torch.device("meta"):
        torch.nn.Linear(2, 2)(torch.empty(1, 2))
    warm()


def _plugin_digests(plugins) -> dict[str, str]:
    """Each loaded plugin's source digest as its files are now (not the process's cache)."""
    return {str(p): plugins.source_digest.__wrapped__(p.top, p.top)
            for p in plugins.loaded()}


def _argv(body: dict) -> list[str]:
    """The ``rayeval run`` command line of a request: the CLI's own, or the API's fields."""
    if "argv" in body:
        argv = [str(a) for a in body["argv"]]
        if not argv or argv[0] != "run":
            raise SpecError("argv: the service runs `rayeval run` command lines only")
        return argv
    if not body.get("sweep"):
        raise SpecError("sweep: missing; send the sweep file's path (and checkpoints: "
                        "[PATH, ...] to evaluate those instead of its checkpoints:)")
    argv = ["run", str(body["sweep"])]
    for c in body.get("checkpoints") or ():
        argv += ["--checkpoint", str(c)]
    for key in ("workers", "output"):
        if body.get(key) is not None:
            argv += [f"--{key}", str(body[key])]
    return argv + (["--force"] if body.get("force") else [])


def _handler(service: Service):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):          # no access log on the service's console
            pass

        def _answer(self, code: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _allowed(self) -> bool:
            given = self.headers.get("Authorization", "")
            if hmac.compare_digest(given.encode(), f"Bearer {service.token}".encode()):
                return True
            self._answer(401, {"error": "missing or wrong token (Authorization: Bearer "
                                        "TOKEN; the service's file holds it)"})
            return False

        def _route(self, method: str) -> None:
            if not self._allowed():
                return
            url = urlparse(self.path)
            parts = [p for p in url.path.split("/") if p]
            query = parse_qs(url.query)
            try:
                if method == "GET" and parts == ["health"]:
                    return self._answer(200, service.health())
                if method == "POST" and parts == ["runs"]:
                    size = int(self.headers.get("Content-Length") or 0)
                    body = json.loads(self.rfile.read(size) or b"{}")
                    return self._answer(200, {"id": service.submit(body).id})
                if method == "GET" and len(parts) == 2 and parts[0] == "runs":
                    after = int(query.get("after", ["0"])[0])
                    wait = float(query.get("wait", ["0"])[0])
                    return self._answer(200, service.poll(parts[1], after, wait))
                if method == "POST" and len(parts) == 3 and parts[::2] == ["runs", "cancel"]:
                    return self._answer(200, service.cancel(parts[1]))
                self._answer(404, {"error": f"no such endpoint: {method} {url.path}"})
            except KeyError as e:
                self._answer(404, {"error": f"no such run: {e.args[0]}"})
            except (SpecError, ValueError) as e:
                self._answer(400, {"error": getattr(e, "message", str(e))})

        def do_GET(self):
            self._route("GET")

        def do_POST(self):
            self._route("POST")

    return Handler


def serve(args, err, command) -> int:
    """``rayeval serve``: see the module docstring. ``command``: how the CLI runs a parsed
    command line with given consoles (``cli.dispatch``), for each run."""
    def say(text: str) -> None:
        err.print(text, markup=False, highlight=False, soft_wrap=True)

    if args.workers < 1:
        raise SpecError("--workers must be at least 1")
    if not 0 <= args.port < 65536:
        raise SpecError(f"--port {args.port}: a port is 0 (any free one) to 65535")
    return Service(command, args.workers, args.host, args.port, args.address, args.verbose,
                   args.use_gpu).serve(say)

