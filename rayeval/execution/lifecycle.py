"""The one Ray lifecycle of a run, written once for ``run_sweep``, ``rayeval watch`` and the Ray
Train validation backend (which runs ``run_sweep``):

    with RayLifecycle(sweep, address=..., callbacks=...) as life:
        life.ensure_ray()                      # start Ray in-process, connect, or reuse
        with life.following(keys):             # a fit over these cells is in flight
            ...                                # SIGINT/SIGTERM winds the group down (follow)
    # SIGINT/SIGTERM held: the standing group closed, the Ray this process started shut
    # down, the partial store files of unfinished cells removed, callbacks.on_end(error),
    # the process's signal handlers as they were before

``follow`` is the loop that shows a fit's progress through the run's callbacks and hands
them each finished cell; ``_wind_down`` is what a signal does to a fit in flight.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from typing import TYPE_CHECKING, Iterable, Protocol

from rayeval import compat
from rayeval.config import constants
from rayeval.execution import signals
from rayeval.execution.callbacks import Callbacks, OnCell, RunCallback
from rayeval.execution.ledger import DriverLedger
from rayeval import errors
from rayeval.errors import RunError

if TYPE_CHECKING:
    from rayeval.execution.profile import Timer
    from rayeval.config.schema import Sweep

STOP_GRACE_S = 30.0            # how long a signal waits for the workers to agree to stop
HEALTH_CHECK_ENV = constants.HEALTH_CHECK_INTERVAL_ENV


class Closes(Protocol):
    """What the lifecycle holds of a worker group kept across fits (``driver.StandingGroups``,
    which `watch` hands it): something to close at the teardown. The driver, above this
    module, builds it; naming its class here was an import circle."""

    def close(self) -> None: ...


class RayLifecycle:
    """Ray for one run, from start (or connection) to shutdown: see the module docstring.
    Only what this process started is shut down; Ray that was already up is left running.
    ``timer``: the driver's phases (``ray start``, ``ray shutdown``) for --profile."""

    def __init__(self, sweep: Sweep, *, address: str | None = None, verbose: bool = False,
                 callbacks: RunCallback | Iterable[RunCallback] | None = None,
                 timer: Timer | None = None):
        self.sweep = sweep
        self.address = address
        self.verbose = verbose
        self.callbacks = Callbacks.of(callbacks)
        self.timer = timer
        self.started = False           # this process started Ray: it shuts it down at the end
        self.connected = False
        self.standing: Closes | None = None         # watch's worker group, kept across fits
        self.partial: set[str] = set()              # cells whose temporary files may be left
        self._signals = contextlib.ExitStack()

    def __enter__(self) -> RayLifecycle:
        # rayeval's handlers go in once Ray is up (start_ray); the caller's come back at the end.
        self._signals.enter_context(signals.restored())
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        try:
            with signals.held():            # a second Ctrl-C must not cut the teardown
                try:
                    self._tear_down()
                finally:
                    self.callbacks.on_end(exc)
        finally:
            self._signals.close()
        return False

    def _tear_down(self) -> None:
        if self.standing is not None:
            self.standing.close()
        if self.started:
            import ray

            with self._span("ray shutdown"):
                ray.shutdown()
        if self.partial:
            from rayeval.io.store import ResultStore

            ResultStore(self.sweep.output).discard_partial(self.partial)

    def _span(self, name: str):
        return self.timer.span(name) if self.timer is not None else contextlib.nullcontext()

    def ensure_ray(self) -> None:
        """Ray up for the run's fits, once: connected to ``address``, the Ray this process
        already has, or one started here (``start_ray``)."""
        if self.connected:
            return
        with self._span("ray start"):
            self.started = start_ray(self.sweep, self.address, self.verbose)
        self.connected = True

    @contextlib.contextmanager
    def following(self, keys: Iterable[str], discard_now: bool = False):
        """A fit over these cells is in flight in the block. Their temporary store files are
        removed at the end of the run, or as the block ends (``discard_now``: ``watch``, whose
        run goes on). A SIGINT/SIGTERM that leaves a thread inside Ray's client (the workers
        did not stop in time, see ``_wind_down``) must not see Ray shut down under it (a crash,
        not a clean exit): then Ray goes down with this process instead."""
        keys = list(keys)
        self.partial.update(keys)
        # rayeval's handlers for the fit, whoever set theirs since Ray came up: Ray Train v2's
        # SIGINT handler stays installed after any fit() that ran in this process's main
        # thread (a user's, before a Python API call on the same Ray); it ignores the first
        # two SIGINTs once that fit is over and sys.exit(0)s on the third (compat.trainer_class).
        signals.install()
        try:
            yield
        except KeyboardInterrupt as e:
            if not getattr(e, "group_stopped", False):
                self.started = False
            raise
        finally:
            if discard_now:
                from rayeval.io.store import ResultStore

                ResultStore(self.sweep.output).discard_partial(keys)


def start_ray(sweep: Sweep, address: str | None, verbose: bool) -> bool:
    """Connect to a cluster (``address``), reuse the current one, or start one in-process with
    more logical CPUs than workers (Train's controller and the run ledger run beside
    them). Returns whether this call started Ray. First, the installed versions of the packages
    whose private hooks the run reaches (``compat.check_sweep``): one line, before Ray starts."""
    compat.check_sweep(sweep)
    return start_ray_for(sweep.workers, sweep.use_gpu, address, verbose)


def start_ray_for(workers: int, use_gpu: bool, address: str | None, verbose: bool) -> bool:
    """``start_ray`` for this many workers (``rayeval serve``'s Ray, before any sweep)."""
    if address:
        _use_token_if_available()       # before Ray is imported: it reads the mode then
    import ray

    if ray.is_initialized():
        return False
    kwargs = dict(log_to_driver=verbose, logging_level=logging.INFO if verbose else logging.ERROR,
                  configure_logging=True)
    if address:
        _probe(address)
        try:
            ray.init(address=address, **kwargs)
        except (ConnectionError, RuntimeError, ValueError) as e:
            raise RunError(f"--address: cannot connect to Ray at {address!r}: "
                           f"{errors.reason(e)}; if the cluster uses token auth, put "
                           "its token in RAY_AUTH_TOKEN or ~/.ray/auth_token") from None
        signals.install()
        return True
    num_cpus = max(os.cpu_count() or 1, workers + 2)
    # Train and its controller start several processes at once; without a higher
    # start-up concurrency the raylet warns about it on every run of a small machine.
    start_local_ray(**compat.with_system_config(
        dict(num_cpus=num_cpus, include_dashboard=False, **kwargs),
        worker_maximum_startup_concurrency=max(8, num_cpus)))
    signals.install()               # Ray's native SIGTERM handler would print a stack and die
    if use_gpu:
        gpus = int(ray.cluster_resources().get("GPU", 0))
        if gpus < workers:
            ray.shutdown()
            raise RunError(f"use_gpu: true needs {workers} GPU(s) for workers: "
                           f"{workers}, this machine has {gpus}; lower workers or set "
                           "use_gpu: false")
    return True


def start_local_ray(attempts: int = 3, **kwargs) -> None:
    """``ray.init`` for a new local node, tried again when the node times out during start-up:
    Ray gives its raylet a fixed 30 s to register, which a machine under heavy load overruns,
    and a second try on the same machine then starts in seconds. Its workers run at the calling
    process's priority, not Ray's 15 steps below it (constants.RAY_WORKER_NICENESS_ENV), and
    none is started before a run asks (constants.RAY_PRESTART_ENV); a user's variable wins.
    Always a new node (``address="local"``): without an address, ``ray.init`` joins the
    cluster a ``ray start`` left on this machine (/tmp/ray/ray_current_cluster), where
    ``num_cpus`` is refused and the run would share another cluster's workers."""
    import ray

    kwargs.setdefault("address", "local")

    if constants.RAY_WORKER_NICENESS_ENV not in os.environ:
        kwargs = compat.with_system_config(kwargs, worker_niceness=constants.LOCAL_WORKER_NICENESS)
    if constants.RAY_PRESTART_ENV not in os.environ:        # constants: why none are prestarted
        kwargs = compat.with_system_config(kwargs, prestart_worker_first_driver=False)
    for attempt in range(1, attempts + 1):
        try:
            ray.init(**kwargs)
            return
        except Exception as e:  # noqa: BLE001 - Ray raises a bare Exception for this one
            if "timed out during startup" not in str(e) or attempt == attempts:
                raise
            ray.shutdown()      # the half-started node's processes


def _probe(address: str, timeout: float = 5.0) -> None:
    """Fail fast on an address where nothing listens: Ray's own client retries for minutes."""
    import socket

    if "://" in address or ":" not in address:      # auto, local, ray://...: Ray resolves them
        return
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            pass
    except (OSError, ValueError):
        raise RunError(f"--address: nothing answers at {address!r}; start the cluster with "
                       "`ray start --head` and pass the address it prints (HOST:6379)") from None


def _use_token_if_available() -> None:
    """Ray 2.60 clusters started with ``ray start --head`` use token auth when a token exists,
    but a client only sends one when RAY_AUTH_MODE=token. Send it whenever one is at hand (a
    cluster without auth ignores it), unless the user chose a mode."""
    if constants.RAY_AUTH_MODE_ENV in os.environ:
        return
    if os.environ.get(constants.RAY_AUTH_TOKEN_ENV) or os.path.exists(
            constants.ray_auth_token_path()):
        os.environ[constants.RAY_AUTH_MODE_ENV] = constants.RAY_AUTH_MODE_TOKEN


@contextlib.contextmanager
def controller_env():
    """The environment Ray Train's controller inherits when a fit in the block starts it (it
    reads these once, as it starts), each left as the user set it if they did:
    - its workers' health checks every 0.5 s, not its 2 s default: up to 2 s after the last
      worker is done before fit() returns;
    - on a Ray without a dashboard (the local one rayeval starts), no PreemptionWatcher: an
      actor per worker group that watches for nodes being drained, to tell the workers (for
      ``ray.train.get_preemption_info``, which rayeval never asks). On one local node there is
      nothing to drain; the actor is a process started per fit: a 2-worker fit took 7.8-7.9 s
      with it (and the datasets callback, ``trainer``) and 6.3-6.7 s without, on the 2-core
      machine (four fits each, one Ray)."""
    settings = {HEALTH_CHECK_ENV: constants.DEFAULT_HEALTH_CHECK_INTERVAL_S}
    if not compat.dashboard_url():
        settings[compat.PREEMPTION_WATCHER_ENV] = "0"
    ours = {k: v for k, v in settings.items() if k not in os.environ}
    os.environ.update(ours)
    try:
        yield
    finally:
        for k in ours:
            os.environ.pop(k, None)


def trainer(**kwargs):
    """A ``TorchTrainer`` (``kwargs`` as its own) less two of Ray Train's default callbacks
    where they can do nothing:
    - its placement-group cleaner on a Ray without a dashboard (the local Ray rayeval starts, a
      cluster started without one). The cleaner is a detached actor, started per fit, that asks
      the state API each second whether the controller still lives, to free the group's
      resources if it died. That API is served by the dashboard; without one every question
      fails (its log: "Failed to query Ray Train Controller actor state"), so it can never
      clean up, and it costs a process per fit and up to a second at the fit's end, while the
      fit waits for its check to wake and stop: a 2-worker fit took 6.0-7.3 s without it and
      8.0-9.2 s with it on the 2-core machine, its end 0.1-0.6 s against 0.98 s;
    - its datasets callback when the fit is given no Ray Data datasets: it starts a
      DatasetManager actor per fit all the same (see ``controller_env`` for what the two
      cost together).
    Both hooks are ``compat``'s."""
    no_data = () if kwargs.get("datasets") else (compat.DATASETS_CALLBACK,)

    def defaults(callbacks: list) -> list:
        cleaner = () if compat.dashboard_url() else (compat.PLACEMENT_GROUP_CLEANER,)
        return compat.without(callbacks, *no_data, *cleaner)

    return compat.trainer_class(defaults)(**kwargs)


def follow(ledger, fit, callbacks=None, on_cell=None, done=None, keys=None,
           since: int = 0) -> None:
    """Follow a fit (``driver.Fit``) every 0.5 s until it ends or ``done()`` says so: the
    ledger's progress (of its cells from the ``since``-th on) to ``callbacks.on_progress``,
    each finished cell (of ``keys``, else
    any) once to ``callbacks.on_cell`` (and to ``on_cell``, a plain function), between
    ``on_fit_start`` and ``on_fit_end``. ``callbacks``: a ``RunCallback`` or several (the
    parameter ``driver.run_plan`` calls ``display``). SIGINT or SIGTERM winds the worker group
    down (``_wind_down``) and is raised again."""
    ledger = DriverLedger.of(ledger)
    callbacks = Callbacks.of(callbacks)
    if on_cell is not None:
        callbacks = Callbacks([*callbacks.callbacks, OnCell(on_cell)])
    began, handed = time.monotonic(), set()
    try:
        callbacks.on_fit_start()
        try:
            finished = False
            while not finished:
                signals.ensure()           # a handler set mid-run (a library's) is replaced
                finished = _wait(fit, 0.5) or (done is not None and done())
                snap = ledger.snapshot(since)
                callbacks.on_progress(snap, time.monotonic() - began, finished)
                if not callbacks.wants_cells or snap["done"] <= len(handed):
                    continue
                for key, o in ledger.results().items():
                    if key not in handed and (keys is None or key in keys):
                        handed.add(key)
                        callbacks.on_cell(o)
        finally:
            callbacks.on_fit_end()
    except KeyboardInterrupt as e:
        raise _wind_down(e, ledger, fit) from None


def _wait(fit, seconds: float) -> bool:
    """Wait up to ``seconds`` for the fit to end; whether it has. The fit's thread is joined
    in slices of 0.1 s with the signals held, and a signal takes effect between two slices:
    CPython 3.11's ``Thread.join`` (and ``is_alive``), interrupted by a signal handler that
    raises, marks a thread that still runs as stopped (python/cpython#90882:
    ``_wait_for_tstate_lock`` releases the lock the running thread holds). A Ctrl-C during
    the join made ``_wind_down`` see the fit as over at once: it did not wait for the workers
    to stop at their sync point, and Ray was shut down under the fit."""
    deadline = time.monotonic() + seconds
    while True:
        with signals.held():
            fit.thread.join(max(0.0, min(0.1, deadline - time.monotonic())))
            over = not fit.alive
        if over or time.monotonic() >= deadline:
            return over


def _wind_down(interrupt: KeyboardInterrupt, ledger, fit) -> KeyboardInterrupt:
    """After SIGINT/SIGTERM: ask the workers to stop (they agree at their next sync point,
    publishing nothing half-done) and wait for the fit to return, so Ray is shut down with no
    thread inside it. ``group_stopped`` says whether that happened in time; a second signal
    while waiting gives up at once."""
    stopped = False
    try:
        stopped = _wait(fit, 0)
        if not stopped:
            DriverLedger.of(ledger).stop(timeout=5)
            stopped = _wait(fit, STOP_GRACE_S)
    except KeyboardInterrupt:
        pass
    except Exception:           # noqa: BLE001 - Ray itself may be going down
        pass
    interrupt.group_stopped = stopped
    return interrupt
