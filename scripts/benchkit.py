"""What every ``scripts/bench_*.py`` shares, so that a benchmark is its workload alone.

A benchmark builds its inputs, runs its sides and says what the figures mean; this module gives
the rest: the argument parser (the docstring as the help, ``--json FILE``, the repeat count),
timing (a block; a subprocess with its CPU time and peak memory; calls interleaved, so that a
machine busy with other work slows every side alike), medians and spreads, the side-by-side
table, the machine's load, a working folder, and the JSON record of the figures with the
command line, the date and the load that make them comparable later (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import os
import resource
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Hugging Face's libraries offline and quiet: a benchmark downloads nothing, and tokenizers'
# threads would compete with the workers for the cores being measured.
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_DATASETS_DISABLE_PROGRESS_BARS": "1", "TOKENIZERS_PARALLELISM": "false"}


def parser(doc: str, repeats: int | None = None, flag: str = "--repeats"
           ) -> argparse.ArgumentParser:
    """The script's parser: its docstring as the help (what it measures, its targets, its
    command lines), ``--json FILE`` and, with ``repeats``, ``flag N`` (default ``repeats``):
    the flag's name is the script's own (``--runs``, ``--repeat``) so documented lines work."""
    p = argparse.ArgumentParser(description=doc,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", metavar="FILE", help="also write the figures to FILE as JSON, "
                   "with the command line, the date and the machine's load")
    if repeats is not None:
        p.add_argument(flag, type=int, default=repeats, metavar="N",
                       help=f"measurements of each side, interleaved (default {repeats})")
    return p


def env(*first: str, **extra: str) -> dict:
    """This environment for a benchmarked command: ``first`` (rayeval checkouts, the code to
    run; None: none) at the head of PYTHONPATH, ``extra`` set, no RAY_ADDRESS: each run
    starts its own local Ray (another job's cluster on this machine must not be joined)."""
    out = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    first = [path for path in first if path]
    if first:
        out["PYTHONPATH"] = os.pathsep.join(filter(None, [*first, out.get("PYTHONPATH")]))
    return {**out, **extra}


class RunFailed(SystemExit):
    """A benchmarked command exited non-zero or ran past its timeout. A SystemExit: unless
    caught (``retrying``), it ends the benchmark with its message, as ``sys.exit`` would."""


@dataclasses.dataclass
class Ran:
    """One command's run: wall and CPU seconds, exit status (None past the timeout), captured
    output ("" where it went to a file), peak RSS in MB."""
    seconds: float
    cpu_s: float
    code: int | None
    stdout: str
    stderr: str
    rss_mb: float | None = None


def _text(output) -> str:
    """A timed-out command's output so far: bytes, whatever ``text=`` asked for."""
    return output.decode(errors="replace") if isinstance(output, bytes) else output or ""


def run(cmd: list[str], *, cwd: str | None = None, env: dict | None = None,
        log: str | None = None, out: str | None = None, timeout: float | None = None,
        check: bool = True, rss: bool = False, what: str | None = None) -> Ran:
    """``cmd`` to its end, timed from launch to exit. Its output is captured, or goes to a
    file (a chatty process is then never slowed by a reader): ``log`` takes both streams,
    ``out`` stdout alone. ``rss``: the peak from GNU time, which starts the command itself (a
    child forked from this process reports this process's RSS as its own peak when that is
    larger: every board "took" 550 MB, bench_store.py's size at the time). With ``check`` a
    failure raises RunFailed, with the output's tail."""
    what = what or " ".join(map(str, cmd))
    with contextlib.ExitStack() as stack:
        sink = stack.enter_context(open(log or out, "w")) if log or out else subprocess.PIPE
        if rss:
            peak = stack.enter_context(tempfile.NamedTemporaryFile("r", suffix=".rss"))
            cmd = ["/usr/bin/time", "-f", "%M", "-o", peak.name, *cmd]
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        began = time.perf_counter()
        try:
            done = subprocess.run(cmd, cwd=cwd, env=env, timeout=timeout, text=True,
                                  stdout=sink, stderr=subprocess.STDOUT if log else
                                  subprocess.PIPE)
            code, stdout, stderr = done.returncode, done.stdout or "", done.stderr or ""
        except subprocess.TimeoutExpired as e:
            code, stdout, stderr = None, _text(e.stdout), _text(e.stderr)
        seconds = time.perf_counter() - began
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        peak_mb = float(peak.read().split()[-1]) / 1024 if rss and code == 0 else None
    ran = Ran(seconds, after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime,
              code, stdout, stderr, peak_mb)
    if check and code != 0:
        if log:
            with open(log, errors="replace") as f:
                tail = f"--- {log} ---\n" + "".join(f.readlines()[-40:])
        else:
            tail = f"{stdout[-4000:]}\n{stderr[-4000:]}".strip()
        raise RunFailed(f"{what} ran past {timeout} s" if code is None else
                        f"{what} failed (exit {code})" + (f":\n{tail}" if tail else ""))
    return ran


FAILED_ATTEMPTS: list[str] = []     # runs that failed and were tried again (in the JSON)


def retrying(fn, *args, retries: int = 1):
    """``fn(*args)``, tried again up to ``retries`` times when its command fails: on a busy
    machine a local Ray sometimes fails to start ("The current node timed out during
    startup"). Each failure is kept in FAILED_ATTEMPTS; the last one ends the benchmark."""
    for attempt in range(retries + 1):
        try:
            return fn(*args)
        except RunFailed as e:
            last = next((ln for ln in reversed(str(e).splitlines()) if ln.strip()), str(e))
            FAILED_ATTEMPTS.append(f"{str(e).splitlines()[0]} ... {last}")
            if attempt == retries:
                raise
            print(f"[bench] {FAILED_ATTEMPTS[-1]}; trying again", file=sys.stderr, flush=True)


class Stopwatch:
    """``with Stopwatch() as took: ...``, then ``took.s``: the block's wall seconds."""

    def __enter__(self) -> Stopwatch:
        self.began = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.s = time.perf_counter() - self.began


def rotated(names, r: int) -> tuple:
    """``names`` turned by ``r`` places: round r of a comparison starts with another side
    (A, B; B, A; ...), so that a drift in the machine's load falls on every side alike."""
    names = tuple(names)
    return names[r % len(names):] + names[:r % len(names)]


def interleaved(calls: dict, repeats: int, rotate: bool = True) -> tuple[dict, dict]:
    """Each of ``calls`` (name: a function of no arguments) called in turn, ``repeats``
    rounds (with ``rotate``, each round starting one side further): (each name's seconds,
    what each name's last call returned)."""
    times: dict = {name: [] for name in calls}
    last: dict = {}
    for r in range(repeats):
        for name in rotated(calls, r) if rotate else calls:
            with Stopwatch() as took:
                last[name] = calls[name]()
            times[name].append(took.s)
    return times, last


def median(values):
    """The median of the values that are not None (a run that measured nothing), or None."""
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def spread(values, digits: int = 3) -> dict:
    """Median, min and max of the values that are not None, rounded; {} if none are left."""
    values = [v for v in values if v is not None]
    if not values:
        return {}
    return {"median": round(statistics.median(values), digits),
            "min": round(min(values), digits), "max": round(max(values), digits)}


def _figure(cell: str) -> bool:
    try:
        float(cell.split()[0])
        return True
    except (ValueError, IndexError):
        return False


def table(rows, headers) -> None:
    """Print rows side by side under ``headers``, columns two spaces apart: a column of
    figures (each cell's first word a number: "3.61 s") right-aligned, others left. Floats
    are shown with 2 decimals; give a string for any other form."""
    cells = [[f"{c:.2f}" if isinstance(c, float) else str(c) for c in row]
             for row in [headers, *rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    right = [all(_figure(row[i]) for row in cells[1:]) for i in range(len(headers))]
    for row in cells:
        print("  ".join(c.rjust(w) if r else c.ljust(w)
                        for c, w, r in zip(row, widths, right)).rstrip())


def uptime() -> str:
    """``uptime``'s line, printed with the figures: on a shared machine, others' work moves
    wall times."""
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def load() -> list[float]:
    """The 1, 5 and 15-minute load averages; [] where the system has none."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def cores() -> int:
    """The cores this process may use (a container may give it fewer than os.cpu_count())."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def machine() -> dict:
    """The machine and the versions a language-model benchmark's figures depend on."""
    import platform
    from importlib.metadata import version

    import torch

    versions = {}
    for name in ("torch", "transformers", "ray", "lm_eval", "rayeval"):
        try:
            versions[name] = version(name if name != "lm_eval" else "lm-eval")
        except Exception:
            versions[name] = "?"
    return {"platform": platform.platform(), "python": platform.python_version(),
            "cpu_count": os.cpu_count(), "usable_cores": cores(),
            "torch_threads": torch.get_num_threads(), "versions": versions}


def folder_mb(folder: str) -> float:
    """The files under ``folder``, in MB (2**20 bytes)."""
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(folder)
               for f in fs) / 2 ** 20


@contextlib.contextmanager
def workdir(prefix: str, path: str | None = None, keep: bool = False, parent: str | None = None):
    """The folder a benchmark builds in: ``path`` (made if missing, never removed), or a new
    temporary one (under ``parent``) removed at the end unless ``keep``."""
    folder = os.path.abspath(path) if path else tempfile.mkdtemp(prefix=prefix, dir=parent)
    os.makedirs(folder, exist_ok=True)
    try:
        yield folder
    finally:
        if path is None and not keep:
            shutil.rmtree(folder, ignore_errors=True)
        elif path is None:
            print(f"[bench] kept {folder}", file=sys.stderr)


def record(path: str | None, figures: dict) -> None:
    """``figures`` as JSON in ``path`` (nothing without one: the scripts' ``--json``), with
    under "recorded" what a later reader needs to compare them: the command line, the date,
    the cores and the machine's load."""
    if not path:
        return
    recorded = {"command": shlex.join(["python", *sys.argv]),
                "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
                "cpu_count": os.cpu_count(), "usable_cores": cores(), "load": load()}
    with open(path, "w") as f:
        json.dump({**figures, "recorded": recorded}, f, indent=2, default=str)
        f.write("\n")
