"""``rayeval submit`` and ``rayeval jobs``: a sweep as a Ray Job, through the Ray Jobs API.

The sweep file's folder travels with the job as its working_dir (model module, metric module,
relative data and checkpoint paths); the job runs ``rayeval run`` on the cluster. Token
authentication is found out from the cluster itself (``/api/authentication_mode``), so a user
never sets ``RAY_AUTH_MODE``: with token auth the token comes from ``RAY_AUTH_TOKEN``,
``RAY_AUTH_TOKEN_PATH`` or ``~/.ray/auth_token`` and is sent as a bearer header.
"""

from __future__ import annotations

import json
import os
import logging
import shlex
import sys
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass

import yaml

from rayeval.config import constants
from rayeval.io import paths
from rayeval import errors
from rayeval.errors import RunError, SpecError
from rayeval.config.schema import Sweep
from rayeval.plan.loader import (is_relative_local, load_sweep, with_overrides, with_trackers,
                                   written_locations)

MAX_UPLOAD_MB = constants.DEFAULT_MAX_UPLOAD_MB    # what may travel with a job (constants)
AGENT_WAIT_S = 90                # how long a new cluster's job agent may take to come up
EXCLUDES = [".git", "__pycache__", "*.pyc", ".pytest_cache", ".ipynb_checkpoints"]
EXIT_JOB_FAILED = 1


def normalize_address(address: str | None) -> str:
    address = address or constants.ray_address()
    if not address:
        raise RunError("--address: give the cluster's dashboard address, e.g. "
                       "http://HEAD:8265 (or set RAY_ADDRESS)")
    if "://" not in address:
        address = "http://" + address
    if not address.startswith(("http://", "https://")):
        raise RunError(f"--address: {address!r} is not a dashboard address; the Jobs API "
                       "listens on http://HEAD:8265, not on the ray:// or GCS port")
    return address.rstrip("/")


def find_token() -> str | None:
    if constants.ray_auth_token() is not None:
        return constants.ray_auth_token()
    path = constants.ray_auth_token_path()
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().strip() or None
    except OSError:
        return None


def auth_mode(address: str, timeout: float = 10.0) -> str | None:
    """"token", "disabled", or None when the cluster does not say (an older Ray)."""
    try:
        with urllib.request.urlopen(f"{address}/api/authentication_mode", timeout=timeout) as r:
            return json.loads(r.read().decode()).get("authentication_mode")
    except urllib.error.HTTPError as e:
        if e.code == 404:
            return None
        raise RunError(f"--address: the dashboard at {address} answered HTTP {e.code}; check "
                       "the address (http://HEAD:8265)") from None
    except (urllib.error.URLError, OSError, ValueError) as e:
        reason = getattr(e, "reason", e)
        raise RunError(f"--address: nothing answers at {address} ({reason}); start the cluster "
                       "(`ray start --head --dashboard-host 0.0.0.0`) or check the address and "
                       "port (the dashboard's, 8265 by default)") from None


def client(address: str | None):
    """A JobSubmissionClient for the cluster, with the token when the cluster wants one."""
    from ray.exceptions import AuthenticationError
    from ray.job_submission import JobSubmissionClient

    # Ray logs each upload at INFO; rayeval says what it submitted in its own line.
    logging.getLogger("ray.dashboard.modules.dashboard_sdk").setLevel(logging.WARNING)
    address = normalize_address(address)
    mode = auth_mode(address)
    token = find_token()
    headers = {}
    if mode == "token" or (mode is None and token):
        if not token:
            raise RunError(f"the cluster at {address} uses token authentication and no token "
                           "was found; put it in RAY_AUTH_TOKEN, or in a file named by "
                           "RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token")
        headers["Authorization"] = f"Bearer {token}"
    try:
        return JobSubmissionClient(address, headers=headers)
    except AuthenticationError:
        raise RunError(f"the cluster at {address} refused the token; use the token of that "
                       "cluster (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token)") \
            from None
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise errors.wrap(e, RunError, f"--address: cannot use the Jobs API at {address}",
                          location=address) from None


def call(what: str, fn, *args, **kwargs):
    """A Jobs API call whose failure is one line."""
    from ray.exceptions import AuthenticationError

    try:
        return fn(*args, **kwargs)
    except AuthenticationError:
        raise RunError(f"{what}: the cluster refused the token; use that cluster's token "
                       "(RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token)") from None
    except RuntimeError as e:
        text = errors.reason(e, last=True)     # the Jobs API puts the server's answer last
        if "does not exist" in text or "404" in text:
            raise RunError(f"{what}: no such job on this cluster; `rayeval jobs list` shows "
                           "them") from None
        raise RunError(f"{what}: {text}") from None


# --- what travels with the job ------------------------------------------------------------

@dataclass(frozen=True)
class Package:
    folder: str          # the sweep file's folder: the job's working_dir
    sweep_file: str      # relative to folder
    bytes: int
    excludes: tuple[str, ...]


def _inside(path: str, folder: str) -> bool:
    return os.path.commonpath([os.path.abspath(path), folder]) == folder


def package(sweep_path: str, sweep: Sweep, output_override: str | None) -> Package:
    """Check that the sweep can run on a cluster and measure what travels with it."""
    folder = os.path.dirname(os.path.abspath(sweep_path))
    with open(sweep_path, encoding="utf-8") as f:
        raw = yaml.safe_load(f) or {}
    excludes = list(EXCLUDES)

    if output_override is not None and is_relative_local(output_override):
        raise SpecError(f"--output: {output_override!r} is a relative local path; the job "
                        "runs on the cluster, so give s3://bucket/prefix (or an absolute path "
                        "on storage that the cluster shares)")
    for key, value in written_locations(raw):
        if not is_relative_local(value):
            continue
        if key == "output" and output_override is None:
            raise SpecError(f"{sweep_path}: output: {value!r} is a local folder relative to "
                            "the sweep; a Ray Job writes its results on the cluster, not back "
                            "here: use s3://bucket/prefix (or --output with an absolute path on "
                            "storage that the cluster shares)")
        if key != "output" and not _inside(os.path.join(folder, value), folder):
            raise SpecError(f"{sweep_path}: {key}: {value!r} is outside the sweep's folder, and "
                            "only that folder travels with the job; move it inside, or use "
                            "s3://... or an absolute path on shared storage")
    out = output_override or sweep.output
    if not paths.is_uri(out) and _inside(out, folder):
        excludes.append(os.path.relpath(out, folder))

    total = 0
    skip = {os.path.join(folder, e) for e in excludes if "*" not in e}
    for root, dirs, files in os.walk(folder):
        dirs[:] = [d for d in dirs if os.path.join(root, d) not in skip and d not in EXCLUDES]
        for name in files:
            if name.endswith(".pyc"):
                continue
            try:
                total += os.path.getsize(os.path.join(root, name))
            except OSError:
                pass
    limit = constants.max_upload_bytes()
    if total > limit:
        raise SpecError(f"{folder}: the sweep's folder holds {total / (1 << 20):.0f} MiB, over "
                        f"the {limit / (1 << 20):.0f} MiB that may travel with a job; put the data "
                        "and checkpoints in object storage (s3://...) and refer to them by URI "
                        "(RAYEVAL_MAX_UPLOAD_MB raises the limit)")
    return Package(folder, os.path.relpath(os.path.abspath(sweep_path), folder), total,
                   tuple(excludes))


def entrypoint(pkg: Package, *, workers: int | None, output: str | None, force: bool,
               mlflow: str | None = None, wandb: str | None = None) -> str:
    args = ["rayeval", "run", pkg.sweep_file, "--address", "auto"]
    if workers is not None:
        args += ["--workers", str(workers)]
    if output is not None:
        args += ["--output", output]
    if mlflow is not None:
        args += ["--mlflow", mlflow]
    if wandb is not None:
        args += ["--wandb", wandb]
    if force:
        args.append("--force")
    return " ".join(shlex.quote(a) for a in args)


def submit(sweep_path: str, address: str | None, *, workers: int | None = None,
           output: str | None = None, force: bool = False, mlflow: str | None = None,
           wandb: str | None = None) -> tuple[object, str, Package]:
    """Validate here, then submit; returns (client, job id, package). The trackers' packages
    are the cluster's business: its `rayeval run` checks them."""
    sweep = with_trackers(with_overrides(load_sweep(sweep_path, output=output),
                                         workers=workers),
                          mlflow=mlflow, wandb=wandb)
    pkg = package(sweep_path, sweep, output)
    jobs = client(address)
    job_id = f"rayeval-{sweep.name}-{uuid.uuid4().hex[:8]}"
    job_id = "".join(c if c.isalnum() or c in "-_" else "-" for c in job_id)
    # A cluster that has just started answers "No available agent to submit job, please try
    # again later" until its job agent is up: try again for a while, with backoff.
    deadline = time.monotonic() + AGENT_WAIT_S
    delay = 1.0
    while True:
        try:
            call("submit", jobs.submit_job,
                  entrypoint=entrypoint(pkg, workers=workers, output=output, force=force,
                                        mlflow=mlflow, wandb=wandb),
                  submission_id=job_id,
                  runtime_env={"working_dir": pkg.folder, "excludes": list(pkg.excludes)},
                  metadata={"rayeval_sweep": sweep.name})
            return jobs, job_id, pkg
        except RunError as e:
            if "try again later" not in e.message or time.monotonic() + delay > deadline:
                raise
            time.sleep(delay)
            delay = min(delay * 2, 8.0)


def follow(jobs, job_id: str, stream=None) -> str:
    """Stream the job's logs until it ends; returns its final status."""
    import asyncio

    stream = stream or sys.stdout

    async def tail():
        async for chunk in jobs.tail_job_logs(job_id):
            stream.write(chunk)
            stream.flush()

    call(f"job {job_id}", asyncio.run, tail())
    return str(call(f"job {job_id}", jobs.get_job_status, job_id))


STOP_WAIT_S = 15.0              # how long a stopped job may take to say STOPPED


def stop(jobs, job_id: str, wait_s: float = STOP_WAIT_S) -> str:
    """Stop the job (Ctrl-C or SIGTERM to ``rayeval submit``) and wait, at most ``wait_s``,
    for the cluster to say it ended; what became of it, in words, for the interrupted line.
    Ray's job supervisor sends the entrypoint (``rayeval run``) SIGTERM, which stops it as a
    local run stops (the workers at their next sync point, nothing half-written), and
    SIGKILLs it 3 s later (RAY_JOB_STOP_WAIT_TIME_S) if it is still there."""
    try:
        call(f"job {job_id}", jobs.stop_job, job_id)
        deadline = time.monotonic() + wait_s
        status = str(call(f"job {job_id}", jobs.get_job_status, job_id)).rsplit(".", 1)[-1]
        while status in ("PENDING", "RUNNING") and time.monotonic() < deadline:
            time.sleep(0.25)
            status = str(call(f"job {job_id}", jobs.get_job_status, job_id)).rsplit(".", 1)[-1]
    except RunError as e:
        return (f"could not stop job {job_id} ({e.message}); `rayeval jobs stop {job_id}` "
                "stops it")
    if status in ("PENDING", "RUNNING"):
        return (f"asked the cluster to stop job {job_id}, which still says {status} after "
                f"{wait_s:g} s; `rayeval jobs status {job_id}` shows when it ends")
    return (f"job {job_id} {status}; every result written so far is complete, and submitting "
            "the same sweep again evaluates the rest")


def exit_code(jobs, job_id: str) -> int:
    info = call(f"job {job_id}", jobs.get_job_info, job_id)
    status = str(info.status)
    if status.endswith("SUCCEEDED"):
        return 0
    code = getattr(info, "driver_exit_code", None)
    return code if isinstance(code, int) and code > 0 else EXIT_JOB_FAILED
