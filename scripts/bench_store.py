"""Benchmark: the result store at a lab's scale (issue 34), old layout and code vs new.

Builds synthetic stores from a REAL cell (the digits example is run once for it, or
``--cell FILE`` names a stored cell file): its three metric rows with their 1,000 bootstrap
replicates, copied to 100 evaluations x N/100 checkpoints (100 checkpoints per sweep), each
copy with its own keys and its values (and replicates) shifted by a per-checkpoint amount.
Each size is written twice: as the old code writes it (one file per cell, ``results/``) and as
the new code leaves it after a run or a ``store compact`` (``parts/``). Then, per size:

- ``rayeval leaderboard STORE --format json`` of the old code (``--old``: a checkout of the
  code before, default /work/main) on the old store, and of this code on the new store,
  interleaved (old, new, old, new ...), with the driver's peak memory (max RSS); the two
  outputs are compared (byte for byte) on sizes up to ``--compare-up-to``;
- ``rayeval store compact`` of a copy of the old store (up to ``--compact-up-to`` cells);
- planning: which of a 100-cell sweep's keys are stored, on the store and on an empty one
  (old: one ``has`` per cell; new: ``stored``);
- with ``--s3``, the same leaderboards on moto's S3 server on loopback (old up to
  ``--s3-old-up-to`` cells: one GET per cell).

    python scripts/bench_store.py --cells 1000 10000 100000 [--s3] [--json FILE]

Disk: a 100,000-cell old store is ~3.4 GB (check ``df -h``); stores are deleted at the end
unless ``--keep``. The machine's load (``uptime``) is printed with the figures.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchkit  # noqa: E402

REPO = benchkit.REPO
sys.path.insert(0, REPO)
EVALUATIONS = 100
PER_SWEEP = 100              # checkpoints per sweep


def real_cell(path: str | None, work: str) -> pa.Table:
    """A stored cell's rows: the file given, or one of the digits example run here."""
    if path is None:
        out = os.path.join(work, "digits-out")
        example = shutil.copytree(os.path.join(REPO, "configs", "digits"),
                                  os.path.join(work, "digits"),
                                  ignore=shutil.ignore_patterns("out"))
        env = {**os.environ, "PYTHONPATH": REPO}
        subprocess.run([sys.executable, "-m", "rayeval", "run",
                        os.path.join(example, "sweep.yaml"), "--output", out], check=True,
                       env=env, stdout=subprocess.DEVNULL)
        results = os.path.join(out, "results")
        names = sorted(os.listdir(results))
        if not names:                  # a run moves its cells into a part: take one cell
            from rayeval.io.store import ResultStore

            store = ResultStore(out)
            table = store.read()
            first = table["cell"][0].as_py()
            return table.filter(pa.compute.equal(table["cell"], first))
        path = os.path.join(results, names[0])
    return pq.read_table(path)


def synth(cell: pa.Table, cells: int):
    """Batches of rows: (sweep, table) with up to ~10,000 cells a batch."""
    base = cell.combine_chunks()
    reps = np.stack([np.asarray(r, dtype=np.float64) for r in base["replicates"].to_pylist()])
    rows_per = base.num_rows
    rng = np.random.default_rng(0)
    checkpoints = max(1, cells // EVALUATIONS)
    for start in range(0, checkpoints, PER_SWEEP):
        sweep = f"sweep-{start // PER_SWEEP:03d}"
        ckpts = range(start, min(start + PER_SWEEP, checkpoints))
        n = len(ckpts) * EVALUATIONS
        ck = np.repeat(np.array(list(ckpts)), EVALUATIONS)
        ev = np.tile(np.arange(EVALUATIONS), len(ckpts))
        delta = ((ck * 7919) % 1000) / 1e5 - 0.005           # per checkpoint
        idx = np.tile(np.arange(rows_per), n)
        d_rows = np.repeat(delta, rows_per)
        keys = [hashlib.sha256(f"{sweep}|{c}|{e}".encode()).hexdigest()[:24]
                for c, e in zip(ck, ev)]
        cols = {}
        for name in base.column_names:
            cols[name] = base[name].take(pa.array(idx))
        cols["sweep"] = pa.array([sweep] * (n * rows_per))
        cols["checkpoint"] = pa.array(np.repeat([f"/ckpts/{sweep}/step_{c:06d}.pt" for c in ck],
                                                rows_per))
        cols["step"] = pa.array(np.repeat(ck * 100, rows_per), pa.int64())
        cols["evaluation"] = pa.array(np.repeat([f"eval-{e:03d}" for e in ev], rows_per))
        cols["cell"] = pa.array(np.repeat(keys, rows_per))
        for name in ("value", "ci_low", "ci_high"):
            cols[name] = pa.array(base[name].to_numpy()[idx] + d_rows)
        # each row its own replicates (a real store's do not repeat, so none compress away)
        noise = rng.normal(0.0, 1e-3, size=(len(idx), reps.shape[1]))
        flat = (reps[idx] + d_rows[:, None] + noise).ravel()
        offsets = np.arange(0, flat.size + 1, reps.shape[1], dtype=np.int32)
        cols["replicates"] = pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat))
        yield sweep, pa.table([cols[c] for c in base.column_names], schema=base.schema), \
            rows_per


def build(cell: pa.Table, cells: int, old_dir: str | None, new_dir: str) -> float:
    """Both layouts of one size; returns the seconds taken."""
    from rayeval.ranking.suite import summaries
    from rayeval.io.store import layout
    from rayeval.io.store.compact import PART_ROWS, _publish, _with_ordinals
    import pyarrow.fs as pafs

    fs = pafs.LocalFileSystem()
    with benchkit.Stopwatch() as took:
        if old_dir:
            os.makedirs(os.path.join(old_dir, "results"), exist_ok=True)
        os.makedirs(new_dir, exist_ok=True)
        layout.mark_format(fs, new_dir)
        for sweep, table, rows_per in synth(cell, cells):
            for i in range(0, table.num_rows if old_dir else 0, rows_per):   # old: file a cell
                one = table.slice(i, rows_per)
                pq.write_table(one, os.path.join(old_dir, "results",
                                                 one["cell"][0].as_py() + ".parquet"))
            table = table.append_column(layout.ORDINAL, pa.array(
                np.tile(np.arange(rows_per, dtype=np.int32), table.num_rows // rows_per)))
            for i in range(0, table.num_rows, PART_ROWS):
                _publish(fs, new_dir, sweep, _with_ordinals(table.slice(i, PART_ROWS)),
                         summaries)
    return took.s


def timed(cmd: list[str], env: dict, out: str | None = None) -> tuple[float, float]:
    """Seconds and peak RSS (MB) of a command, its output to ``out`` (default: nowhere)."""
    ran = benchkit.run(cmd, env=env, out=out or os.devnull, rss=True)
    return ran.seconds, ran.rss_mb


def leaderboard(code: str, store: str, env: dict, out: str | None = None):
    return timed([sys.executable, "-m", "rayeval", "leaderboard", store, "--format", "json"],
                 {**env, "PYTHONPATH": code}, out)


PLAN = """
import sys, time
sys.path.insert(0, sys.argv[1])
from rayeval.io.store import ResultStore
store, sweep, keys = ResultStore(sys.argv[2]), sys.argv[3], sys.argv[4].split(",")
began = time.perf_counter()
if hasattr(store, "stored"):
    found = store.stored(keys, sweep)
else:
    found = {k for k in keys if store.has(k)}
print(time.perf_counter() - began, len(found))
"""


def planning(code: str, store: str, sweep: str, keys: list[str], env: dict) -> tuple[float, int]:
    done = benchkit.run([sys.executable, "-c", PLAN, code, store, sweep, ",".join(keys)],
                        env={**env, "PYTHONPATH": code}, what=f"planning on {store}")
    seconds, found = done.stdout.split()
    return float(seconds), int(found)


def plan_keys(cells: int) -> tuple[str, list[str]]:
    """A 100-cell sweep's keys: one checkpoint x 100 evaluations of the store's middle sweep."""
    checkpoints = max(1, cells // EVALUATIONS)
    c = checkpoints // 2
    sweep = f"sweep-{c // PER_SWEEP:03d}"
    return sweep, [hashlib.sha256(f"{sweep}|{c}|{e}".encode()).hexdigest()[:24]
                   for e in range(EVALUATIONS)]


def main(argv=None) -> int:
    p = benchkit.parser(__doc__, repeats=2)
    p.add_argument("--cells", type=int, nargs="+", default=[1000, 10000, 100000])
    p.add_argument("--old", default="/work/main", help="a checkout of the code before")
    p.add_argument("--cell", help="a stored cell's parquet file (default: run the example)")
    p.add_argument("--work", help="where to build the stores (default: a temporary folder)")
    p.add_argument("--compare-up-to", type=int, default=10000)
    p.add_argument("--compact-up-to", type=int, default=10000)
    p.add_argument("--s3", action="store_true", help="also on moto's S3 server on loopback")
    p.add_argument("--s3-old-up-to", type=int, default=10000)
    p.add_argument("--old-up-to", type=int, default=10 ** 9,
                   help="build and time the old layout and code only up to this many cells")
    p.add_argument("--keep", action="store_true")
    args = p.parse_args(argv)
    env = dict(os.environ)
    figures: dict = {"uptime": [benchkit.uptime()], "sizes": {}}
    print(figures["uptime"][-1], flush=True)
    with benchkit.workdir("rayeval-bench-store-", args.work, args.keep) as work:
        cell = real_cell(args.cell, work)
        print(f"real cell: {cell.num_rows} rows, "
              f"{len(cell['replicates'][0].as_py() or [])} replicates a row", flush=True)
        s3 = S3(work) if args.s3 else None
        try:
            for n in args.cells:
                figures["sizes"][n] = one_size(args, n, cell, work, env, s3)
                figures["uptime"].append(benchkit.uptime())
                print(figures["uptime"][-1], flush=True)
        finally:
            if s3 is not None:
                s3.stop()
    benchkit.record(args.json, figures)
    return 0


def one_size(args, n: int, cell: pa.Table, work: str, env: dict, s3) -> dict:
    old_dir, new_dir = os.path.join(work, f"old-{n}"), os.path.join(work, f"new-{n}")
    with_old = n <= args.old_up_to
    out: dict = {"build_s": round(build(cell, n, old_dir if with_old else None, new_dir), 1),
                 "old_mb": benchkit.folder_mb(old_dir) if with_old else None,
                 "new_mb": benchkit.folder_mb(new_dir)}
    print(f"\n== {n:,} cells: old store {out['old_mb'] or 0:,.0f} MB, new "
          f"{out['new_mb']:,.0f} MB (built in {out['build_s']} s)", flush=True)
    pairs = []
    for i in range(args.repeats if n < 100_000 else 1):
        if not with_old:
            w = leaderboard(REPO, new_dir, env, os.path.join(work, "new.json"))
            pairs.append({"new_s": round(w[0], 2), "new_rss_mb": round(w[1])})
            print(f"leaderboard --format json, local: new {w[0]:.2f} s ({w[1]:.0f} MB)",
                  flush=True)
            continue
        o = leaderboard(args.old, old_dir, env, os.path.join(work, "old.json"))
        w = leaderboard(REPO, new_dir, env, os.path.join(work, "new.json"))
        pairs.append({"old_s": round(o[0], 2), "new_s": round(w[0], 2),
                      "ratio": round(o[0] / w[0], 1),
                      "old_rss_mb": round(o[1]), "new_rss_mb": round(w[1])})
        print(f"leaderboard --format json, local: old {o[0]:.2f} s ({o[1]:.0f} MB), "
              f"new {w[0]:.2f} s ({w[1]:.0f} MB): {o[0] / w[0]:.1f}x", flush=True)
    out["local"] = pairs
    if with_old and n <= args.compare_up_to:
        same = _same(os.path.join(work, "old.json"), os.path.join(work, "new.json"))
        out["same_output"] = same
        print(f"same output, old code on the old store vs new code on the new: {same}")
    if with_old and n <= args.compact_up_to:
        copy = shutil.copytree(old_dir, os.path.join(work, f"compact-{n}"))
        s, rss = timed([sys.executable, "-m", "rayeval", "store", "compact", copy],
                       {**env, "PYTHONPATH": REPO})
        w = leaderboard(REPO, copy, env, os.path.join(work, "compacted.json"))
        same = _same(os.path.join(work, "old.json"), os.path.join(work, "compacted.json"))
        out["compact"] = {"s": round(s, 2), "rss_mb": round(rss), "board_s": round(w[0], 2),
                          "same_output": same}
        print(f"store compact of the old store: {s:.2f} s ({rss:.0f} MB); its board "
              f"{w[0]:.2f} s, same output: {same}", flush=True)
        shutil.rmtree(copy)
    sweep, keys = plan_keys(n)
    empty = os.path.join(work, "empty")
    os.makedirs(os.path.join(empty, "results"), exist_ok=True)
    plan = {}
    for label, code, store in (("old", args.old, old_dir), ("new", REPO, new_dir),
                               ("old_empty", args.old, empty), ("new_empty", REPO, empty)):
        if with_old or not label.startswith("old"):
            plan[label] = planning(code, store, sweep, keys, env)
    out["planning"] = {k: {"s": round(v[0], 3), "found": v[1]} for k, v in plan.items()}
    print("planning 100 cells (store look-up): " + ", ".join(
        f"{k} {v[0]:.3f} s ({v[1]} found)" for k, v in plan.items()), flush=True)
    if s3 is not None:
        out["s3"] = s3.measure(args, n, old_dir, new_dir, env, work)
    if not args.keep:
        shutil.rmtree(old_dir, ignore_errors=True)
        shutil.rmtree(new_dir, ignore_errors=True)
    return out


def _same(a: str, b: str) -> bool:
    with open(a, "rb") as fa, open(b, "rb") as fb:
        return fa.read() == fb.read()


class S3:
    """moto's server on loopback (tests/s3server.py), the stores uploaded with pyarrow."""

    def __init__(self, work: str):
        sys.path.insert(0, os.path.join(REPO, "tests"))
        from s3server import CREDENTIALS, MotoServer

        self.server = MotoServer()
        try:
            self._connect(CREDENTIALS)
        except BaseException:
            self.server.stop()
            raise

    def _connect(self, credentials: dict) -> None:
        self.env = {**credentials, "AWS_ENDPOINT_URL": self.server.url}
        os.environ.update(self.env)
        import pyarrow.fs as pafs

        self.fs = pafs.S3FileSystem(endpoint_override=self.server.url, region="us-east-1",
                                    access_key="testing", secret_key="testing",
                                    allow_bucket_creation=True)
        self.fs.create_dir("bench")

    def upload(self, local: str, prefix: str) -> str:
        import pyarrow.fs as pafs

        pafs.copy_files(local, f"bench/{prefix}", destination_filesystem=self.fs,
                        use_threads=True)
        return f"s3://bench/{prefix}"

    def measure(self, args, n, old_dir, new_dir, env, work) -> dict:
        env = {**env, **self.env}
        with benchkit.Stopwatch() as took:
            new = self.upload(new_dir, f"new-{n}")
        out = {"upload_new_s": round(took.s, 1)}
        w = leaderboard(REPO, new, env, os.path.join(work, "s3-new.json"))
        out["new_s"], out["new_rss_mb"] = round(w[0], 2), round(w[1])
        line = f"leaderboard --format json, S3: new {w[0]:.2f} s ({w[1]:.0f} MB)"
        if n <= min(args.s3_old_up_to, args.old_up_to):
            old = self.upload(old_dir, f"old-{n}")
            o = leaderboard(args.old, old, env, os.path.join(work, "s3-old.json"))
            out["old_s"], out["old_rss_mb"] = round(o[0], 2), round(o[1])
            line += f", old {o[0]:.2f} s ({o[1]:.0f} MB): {o[0] / w[0]:.1f}x"
            self.fs.delete_dir(f"bench/old-{n}")
        sweep, keys = plan_keys(n)
        plan = planning(REPO, new, sweep, keys, env)
        out["planning_new_s"] = round(plan[0], 3)
        line += f"; planning 100 cells {plan[0]:.3f} s ({plan[1]} found)"
        print(line, flush=True)
        self.fs.delete_dir(f"bench/new-{n}")
        return out

    def stop(self):
        self.server.stop()


if __name__ == "__main__":
    sys.exit(main())
