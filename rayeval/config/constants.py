"""Every environment variable rayeval reads or sets, in one place (Ray Train v2 keeps its own in
``ray/train/v2/config/constants.py``): its name, its default and why it exists.

Values are read when they are needed, never at import time: a test or a user may set one
between two runs of the same process. This module imports nothing but ``os``.

Other services' variables stay with their clients: ``AWS_*`` (rayeval.io.paths) and
``MLFLOW_*`` (rayeval.reporting.trackers, which bounds MLflow's retries while it logs).
"""

from __future__ import annotations

import os

# --- rayeval's own knobs ------------------------------------------------------------------

# How many bytes of decoded shard a worker may keep between passes, over all evaluations.
# Unset: a quarter of the node's available memory, shared by the workers on it. Tests set it
# low to force the streaming path.
SHARD_CACHE_BYTES_ENV = "RAYEVAL_SHARD_CACHE_BYTES"

# "0" turns off fetching and reading the next checkpoint while the current one is evaluated
# (to measure what prefetching saves, or to save the memory of one more checkpoint).
PREFETCH_ENV = "RAYEVAL_PREFETCH"
DEFAULT_PREFETCH = "1"

# The most tasks of an evaluation's Ray Data stage (its transform, or its tokenizer or
# processor) at once where the sweep sets no dataset.concurrency; unset: as many as the
# cluster's free CPUs allow. Each task's process pays the stage's setup once (transformers and
# a processor: ~6 CPU-seconds), which a cluster's idle CPUs absorb; on a machine whose Ray
# declares more CPUs than it has (a shared head node, the test suite's Ray: 12 on 2 cores) the
# setups are the run: a 16-item image evaluation's first run took 64 s, 28 s with 2 tasks.
DATA_CONCURRENCY_ENV = "RAYEVAL_DATA_CONCURRENCY"

# The knobs above that the workers read: a run hands the driver's values to its workers (a
# standing group's rank 0 builds the plan's pipelines).
WORKER_ENVS = (SHARD_CACHE_BYTES_ENV, PREFETCH_ENV, DATA_CONCURRENCY_ENV)

# "ray" sends local parquet through Ray Data as well (every other source always goes through
# it): to compare the direct read (the fast path) with the pipeline on the same files.
DATA_PLANE_ENV = "RAYEVAL_DATA_PLANE"
DEFAULT_DATA_PLANE = "auto"

# What may travel with a Ray Job (`rayeval submit`): the sweep's folder, in MiB. Data and
# checkpoints belong in object storage; this catches a folder that holds them by mistake.
MAX_UPLOAD_MB_ENV = "RAYEVAL_MAX_UPLOAD_MB"
DEFAULT_MAX_UPLOAD_MB = 100

# Seconds between the plain progress lines of a run whose output is not a terminal (CI, Ray
# Job logs). Tests set it low to see what the line says during a short run.
PROGRESS_INTERVAL_ENV = "RAYEVAL_PROGRESS_INTERVAL_S"
DEFAULT_PROGRESS_INTERVAL_S = 10.0

# Attempts of each S3 request (pyarrow's retry strategy): a 503 storm of an object store is
# ridden out, a dead endpoint is not waited on for long. Read by rayeval.io.paths (which still
# spells the name out; that layer is being reworked apart from this change).
S3_MAX_ATTEMPTS_ENV = "RAYEVAL_S3_MAX_ATTEMPTS"
DEFAULT_S3_MAX_ATTEMPTS = 10

# --- Ray's knobs that rayeval reads or sets -------------------------------------------------

# Ray 2.60 sends the cluster's token only when RAY_AUTH_MODE=token; rayeval sets it before Ray
# is imported when a token is at hand and the user chose no mode (see lifecycle).
RAY_AUTH_MODE_ENV = "RAY_AUTH_MODE"
RAY_AUTH_MODE_TOKEN = "token"
# The token itself, or the file that holds it (Ray's own default: ~/.ray/auth_token).
RAY_AUTH_TOKEN_ENV = "RAY_AUTH_TOKEN"
RAY_AUTH_TOKEN_PATH_ENV = "RAY_AUTH_TOKEN_PATH"
DEFAULT_RAY_AUTH_TOKEN_PATH = "~/.ray/auth_token"

# The Jobs API's address for `rayeval submit` / `rayeval jobs` when --address is not given,
# in the order Ray's own job CLI reads them.
RAY_ADDRESS_ENVS = ("RAY_API_SERVER_ADDRESS", "RAY_ADDRESS")

# Ray Train's controller looks at its workers every 2 s by default: up to 2 s after the last
# worker is done before fit() returns. rayeval sets 0.5 s for its own fits unless the user
# chose; the controller reads it when it starts (it inherits the driver's environment).
HEALTH_CHECK_INTERVAL_ENV = "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"
DEFAULT_HEALTH_CHECK_INTERVAL_S = "0.5"


# Ray starts its workers 15 steps nicer than the raylet (its ``worker_niceness``). On a cluster
# that keeps Ray's own processes responsive; on the machine of rayeval's embedded local Ray it
# starves the evaluation behind any other program (beside two busy loops on 2 cores, a small
# two-checkpoint sweep took 251 s instead of 21). rayeval's local Ray runs its workers at rayeval's
# priority (``nice rayeval run`` still lowers it) unless the user set this variable; a cluster
# started with `ray start` keeps whatever its owner chose.
RAY_WORKER_NICENESS_ENV = "RAY_worker_niceness"
LOCAL_WORKER_NICENESS = 0     # added to the raylet's, which is the rayeval process's own
# A local Ray's first driver starts no idle workers ahead of the run (Ray's default starts one per
# logical CPU): a run's workers are Train's actors, started for it, and on the 2-core machine
# those idle Python processes' start-up competed with the run's own (the digits example as
# `rayeval run`, alternated under load: 40.6 and 51.6 s with them, 28.3 and 30.7 s without).
RAY_PRESTART_ENV = "RAY_prestart_worker_first_driver"


def ray_auth_token_path() -> str:
    """The file Ray reads the cluster's token from."""
    return os.environ.get(RAY_AUTH_TOKEN_PATH_ENV) or os.path.expanduser(
        DEFAULT_RAY_AUTH_TOKEN_PATH)


def ray_auth_token() -> str | None:
    """The token given in the environment, stripped; None when none is."""
    token = os.environ.get(RAY_AUTH_TOKEN_ENV)
    return token.strip() if token else None


def shard_cache_bytes() -> int | None:
    """RAYEVAL_SHARD_CACHE_BYTES, or None when unset (the worker then asks the node)."""
    value = os.environ.get(SHARD_CACHE_BYTES_ENV)
    return None if value is None else int(value)


def prefetch_enabled() -> bool:
    return os.environ.get(PREFETCH_ENV, DEFAULT_PREFETCH) != "0"


def data_concurrency() -> int | None:
    """RAYEVAL_DATA_CONCURRENCY, or None when unset; a value that is not a whole number of at
    least 1 is a ValueError naming the variable (``preflight`` checks it before Ray starts)."""
    value = os.environ.get(DATA_CONCURRENCY_ENV, "").strip()
    if not value:
        return None
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{DATA_CONCURRENCY_ENV}={value!r}: expected a whole number of tasks, "
                         "at least 1 (or unset it)")
    return int(value)


def data_plane() -> str:
    """``auto`` (local parquet read directly by the workers) or ``ray`` (Ray Data for all)."""
    return os.environ.get(DATA_PLANE_ENV, DEFAULT_DATA_PLANE)


def max_upload_bytes() -> int:
    return int(float(os.environ.get(MAX_UPLOAD_MB_ENV, DEFAULT_MAX_UPLOAD_MB)) * (1 << 20))


def ray_address() -> str | None:
    """The Jobs API address from the environment, if any."""
    return next((os.environ[k] for k in RAY_ADDRESS_ENVS if os.environ.get(k)), None)


def progress_interval_s() -> float:
    return float(os.environ.get(PROGRESS_INTERVAL_ENV, DEFAULT_PROGRESS_INTERVAL_S))


def installed_version() -> str:
    """rayeval's installed version, from its distribution's metadata (what a report and a
    service's identity say; ``rayeval.__version__`` is the package above every module that
    asks), or "unknown" in a source tree that was never installed."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("rayeval")
    except PackageNotFoundError:
        return "unknown"
