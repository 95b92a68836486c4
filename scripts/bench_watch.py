"""Benchmark: how soon `rayeval watch` has a result after a checkpoint is ready.

Copies the digits example without its checkpoints, starts `rayeval watch --ready '*.done'
--interval 0.5` on it, then plays a training run: writes one checkpoint and its `.done` marker,
waits for its results in the store, and so on for each checkpoint. Prints, per checkpoint, the
seconds from the marker to its last result, and the worker groups the watch started (one: the
group stays up between checkpoints). The first checkpoint also pays Ray's and the group's
start; the later ones only the poll, the load and the passes.

    python scripts/bench_watch.py [--json FILE]
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchkit  # noqa: E402


def main(argv=None) -> int:
    p = benchkit.parser(__doc__)
    p.add_argument("--timeout", type=float, default=300.0, help="per checkpoint, seconds")
    args = p.parse_args(argv)
    from rayeval.io.store import ResultStore

    source = os.path.join(benchkit.REPO, "configs", "digits")
    names = sorted(n for n in os.listdir(os.path.join(source, "ckpts")))
    figures = {"checkpoints": []}
    with tempfile.TemporaryDirectory(prefix="rayeval-watch-") as root:
        example = shutil.copytree(source, os.path.join(root, "digits"),
                                  ignore=shutil.ignore_patterns("out", "ckpts"))
        ckpts = os.path.join(example, "ckpts")
        os.makedirs(ckpts)
        store = ResultStore(os.path.join(example, "out"))
        log_path = os.path.join(root, "watch.log")
        with open(log_path, "w") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "rayeval", "watch", os.path.join(example, "sweep.yaml"),
                 "--interval", "0.5", "--ready", "*.done"], stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            for n, name in enumerate(names, start=1):
                src = os.path.join(source, "ckpts", name)
                if os.path.isdir(src):
                    shutil.copytree(src, os.path.join(ckpts, name))
                else:
                    shutil.copy(src, os.path.join(ckpts, name))
                ready = time.monotonic()
                open(os.path.join(ckpts, name + ".done"), "w").close()
                deadline = ready + args.timeout
                while time.monotonic() < deadline:
                    cells = {r["cell"] for r in store.read().to_pylist()} \
                        if os.path.isdir(os.path.join(example, "out")) else set()
                    if len(cells) >= 2 * n:          # two evaluations per checkpoint
                        break
                    time.sleep(0.1)
                else:
                    raise SystemExit(f"no result for {name} within {args.timeout:.0f} s; see "
                                     f"{log_path}:\n" + open(log_path).read()[-3000:])
                seconds = time.monotonic() - ready
                figures["checkpoints"].append({"checkpoint": name,
                                               "ready_to_result_s": round(seconds, 2)})
                print(f"{name:26s} ready -> results in {seconds:6.2f} s", flush=True)
        finally:
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        text = open(log_path).read()
        figures["worker_groups_started"] = text.count("worker group started")
        figures["exit_status"] = proc.returncode
    print(f"worker groups started: {figures['worker_groups_started']}; watch exit status "
          f"{figures['exit_status']}")
    benchkit.record(args.json, figures)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
