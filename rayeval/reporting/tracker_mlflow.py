"""The MLflow tracker: a sweep's own run (found again by its ``rayeval.sweep`` tag) or a given
one, each point logged once, the leaderboard as an artifact, and MLflow's manners held in
bounds (its retries, its log lines). ``mlflow`` is imported when the tracker opens."""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os

from rayeval.config.schema import MlflowTracker
from rayeval.reporting.tracker_sinks import (EXPERIMENT, LIMIT_TAG, SWEEP_TAG, TABLE, Point, Say,
                                             _Problem, _Sink, _UNSAFE)


class MlflowSink(_Sink):
    name = "mlflow"

    def __init__(self, spec: MlflowTracker, sweep: str, warn: Say):
        super().__init__(sweep, warn)
        self.spec = spec
        self.uri = spec.uri or os.environ.get("MLFLOW_TRACKING_URI")
        self.client = None
        self.own = spec.run_id is None       # the sweep's own run: this command finishes it
        self.history: dict[str, set[tuple[int, float]]] = {}

    def where(self) -> str:
        return f"({self.uri})" if self.spec.run_id else \
            f"({self.uri}, experiment {self.spec.experiment or EXPERIMENT})"

    def quiet(self):
        return _bounded_mlflow()

    def open(self) -> bool:
        if not self.uri:
            self.dead = True
            self.warn(f"[rayeval] warning: mlflow: no tracking URI: set {self.spec.key_path}"
                      ".uri (or MLFLOW_TRACKING_URI); nothing is sent to mlflow in this "
                      "command (the result store has every result)")
            return False
        return self.guard(f"cannot use {self.uri}", self._open)

    def _open(self) -> None:
        _probe(self.uri)
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=self.uri)
        if self.spec.run_id:
            run = _get_run(self.client, self.spec.run_id)
            self.run_id = run.info.run_id
            return
        name = self.spec.experiment or EXPERIMENT
        experiment = self.client.get_experiment_by_name(name)
        if experiment is None:
            experiment_id = self.client.create_experiment(name)
        elif experiment.lifecycle_stage != "active":
            raise _Problem(f"experiment {name!r} is deleted; restore it or name another "
                           "experiment")
        else:
            experiment_id = experiment.experiment_id
        quote = '"' if "'" in self.sweep else "'"
        found = self.client.search_runs(
            [experiment_id], filter_string=f"tags.`{SWEEP_TAG}` = {quote}{self.sweep}{quote}",
            max_results=1, order_by=["attributes.start_time DESC"])
        if found:
            self.run_id = found[0].info.run_id
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            self.run_id = self.client.create_run(experiment_id, run_name=self.sweep,
                                                 tags={SWEEP_TAG: self.sweep}).info.run_id

    def _log(self, pts: list[Point]) -> None:
        from mlflow.entities import Metric

        fresh = []
        for p in pts:        # a point the run already holds (a second push) is not doubled
            if p.key not in self.history:
                self.history[p.key] = {(m.step, m.value) for m in
                                       self.client.get_metric_history(self.run_id, p.key)}
            if (p.step, p.value) not in self.history[p.key]:
                fresh.append(p)
        for i in range(0, len(fresh), 1000):              # MLflow's limit per batch
            self.client.log_batch(self.run_id, metrics=[
                Metric(p.key, p.value, p.timestamp_ms, p.step) for p in fresh[i:i + 1000]])
        for p in fresh:
            self.history[p.key].add((p.step, p.value))
        self.values += sum(p.figure for p in fresh)

    def _tag_limits(self, found: dict[str, str]) -> None:
        for evaluation, text in found.items():
            self.client.set_tag(self.run_id, f"{LIMIT_TAG}/{_UNSAFE.sub('_', evaluation)}",
                                text)

    def _table(self, columns: list[str], data: list[list]) -> None:
        import csv
        import io

        text = io.StringIO()
        w = csv.writer(text)
        w.writerow(columns)
        w.writerows([["" if v is None else v for v in line] for line in data])
        self.client.log_text(self.run_id, text.getvalue(), f"{TABLE}.csv")
        if importlib.util.find_spec("pandas") is not None:   # MLflow's table view needs it
            import warnings

            with warnings.catch_warnings():      # pandas' deprecation notes on MLflow's code
                warnings.simplefilter("ignore")
                self.client.log_table(self.run_id, {c: [line[i] for line in data]
                                                    for i, c in enumerate(columns)},
                                      f"{TABLE}.json")

    def _close(self) -> None:
        if self.own and self.run_id:             # never the status of a training run
            self.client.set_terminated(self.run_id, "FINISHED")


# --- MLflow's manners ------------------------------------------------------------------------

def _probe(uri: str, timeout: float = 5.0) -> None:
    """Nothing listening at an http(s) tracking URI is found at once, with a plain message,
    instead of after MLflow's retries."""
    import socket
    import urllib.request
    from urllib.parse import urlsplit

    u = urlsplit(uri)
    if u.scheme not in ("http", "https") or not u.hostname:
        return
    if urllib.request.getproxies().get(u.scheme) and not urllib.request.proxy_bypass(u.hostname):
        return                          # reached through a proxy: MLflow's requests will say
    port = u.port or (443 if u.scheme == "https" else 80)
    try:
        with socket.create_connection((u.hostname, port), timeout=timeout):
            pass
    except OSError as e:
        raise _Problem(f"nothing answers at {uri} ({e.strerror or e}); start the tracking "
                       "server or fix the URI") from None


def _get_run(client, run_id: str):
    try:
        run = client.get_run(run_id)
    except Exception as e:                # noqa: BLE001 - MLflow's exception types vary
        if "RESOURCE_DOES_NOT_EXIST" in str(getattr(e, "error_code", "")) or \
                "not found" in str(e).lower():
            raise _Problem(f"no run {run_id!r} there; check the run id") from None
        raise
    if run.info.lifecycle_stage != "active":
        raise _Problem(f"run {run_id!r} is deleted; restore it or check the run id")
    return run


# MLflow retries a failed request 7 times with a backoff factor of 2 (minutes) before a call
# fails; a tracker must not hold an evaluation that long. Used unless the user set them.
# It also prints "View run ... at" on stdout when a run ends, into `leaderboard --format json`'s
# output: rayeval says where the run is on stderr itself.
_RETRIES = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
            "MLFLOW_HTTP_REQUEST_TIMEOUT": "20", "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true"}


@contextlib.contextmanager
def _bounded_mlflow():
    """Bounded retries, and MLflow's and urllib3's own log lines held back (the one warning
    line says what failed)."""
    added = [k for k in _RETRIES if k not in os.environ]
    for k in added:
        os.environ[k] = _RETRIES[k]
    loggers = [logging.getLogger(n) for n in ("mlflow", "urllib3")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)
        for k in added:
            os.environ.pop(k, None)
