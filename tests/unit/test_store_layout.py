"""Tier 1: the store at scale: parts, compaction beside running writers, filters in the scan,
SQL, and the one-line errors (a newer format, a damaged file, a failing query)."""

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from datetime import datetime, timedelta, timezone

import numpy as np
import pytest

from rayeval.errors import StoreError
from rayeval.io.store import SCHEMA, ResultStore, newest
from rayeval.io.store.layout import sweep_folder
from rayeval.reporting.render import dumps_indented
from rayeval.ui import cli

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)


def cell(sweep, checkpoint, dataset, step, value, reps=8, seed=0):
    r = np.random.default_rng(seed).normal(value, 0.01, reps).tolist()
    return [{"sweep": sweep, "checkpoint": checkpoint, "step": step, "evaluation": dataset,
             "metric": m, "value": value * k, "ci_low": value * k - 0.01,
             "ci_high": value * k + 0.01, "num_samples": 50, "world_size": 1,
             "higher_is_better": m != "nll", "replicates": [x * k for x in r],
             "bootstrap": "seed=0;buckets=64;replicates=8;confidence=0.95",
             "created_at": T0 + timedelta(seconds=step)}
            for m, k in (("accuracy", 1.0), ("nll", 2.0))]


def old_store(root, sweeps=("a", "b")):
    """A store as the code before wrote it: one file per cell, in results/."""
    store = ResultStore(str(root))
    n = 0
    for s in sweeps:
        for step in (1, 2, 3):
            for d in ("val", "ood"):
                n += 1
                store.write_cell(f"{s}{step}{d}", cell(s, f"/ck/{s}/step_{step}", d, step,
                                                       0.1 * step + (d == "ood") * 0.05, seed=n))
    return store


def board(capsys, *argv):
    code = cli.main(["leaderboard", *argv, "--format", "json"])
    got = capsys.readouterr()
    assert code == 0, got.err
    return got.out


def test_compaction_keeps_every_board_and_filter_the_same(tmp_path, capsys):
    store = old_store(tmp_path)
    flags = [(), ("--sweep", "b"), ("--dataset", "ood"), ("--checkpoint", "*/step_2"),
             ("--metric", "ood/nll"), ("--replicates",)]
    before = {f: board(capsys, str(tmp_path), *f) for f in flags}
    moved = store.compact()
    assert (moved.cells, moved.parts_written) == (12, 2)           # one part per sweep
    assert os.listdir(tmp_path / "results") == []
    assert json.loads((tmp_path / "store.json").read_text()) == {"format": 2}
    for f in flags:
        assert board(capsys, str(tmp_path), *f) == before[f], f
    got = json.loads(before[("--checkpoint", "*/step_2")])
    assert {r["checkpoint"] for r in got} == {"/ck/a/step_2", "/ck/b/step_2"}
    # planning asks one sweep's parts only: another sweep's part, damaged, is never opened
    files_a = list((tmp_path / "parts" / sweep_folder("a")).glob("part-*"))
    assert len(files_a) == 2                          # the part and its figures
    for f in files_a:
        f.write_bytes(b"damaged")
    assert store.stored(["b1val", "b9val", "a1val"], "b") == {"b1val"}


def test_two_runs_and_a_compaction_at_once_lose_no_cell_and_duplicate_none(tmp_path):
    """Two writers (one file per cell, then their cells into a part, as a run does) and a
    compaction beside them, as separate processes: the compaction moves the runs' first
    halves while they are still writing (markers make sure of it), then compacts again
    while they write and consolidate the rest."""
    writer = textwrap.dedent("""
        import os, sys, time
        sys.path.insert(0, sys.argv[1])
        sys.path.insert(0, sys.argv[1] + "/tests/unit")
        from test_store_layout import cell, wait_for
        from rayeval.io.store import ResultStore
        store, run, marks = ResultStore(sys.argv[2]), sys.argv[3], sys.argv[4]
        keys = [f"{run}-{i}" for i in range(40)]
        for i, key in enumerate(keys):
            if i == 20:
                open(f"{marks}/half-{run}", "w").close()
                wait_for(f"{marks}/compacted")
            store.write_cell(key, cell(run, f"/ck/{run}/{i}", "val", i, 0.5))
        assert not store.consolidate(keys, wait_s=60).locked
        open(f"{marks}/done-{run}", "w").close()
    """)
    compactor = textwrap.dedent("""
        import os, sys, time
        sys.path.insert(0, sys.argv[1])
        sys.path.insert(0, sys.argv[1] + "/tests/unit")
        from test_store_layout import wait_for
        from rayeval.io.store import ResultStore
        store, marks = ResultStore(sys.argv[2]), sys.argv[3]
        wait_for(f"{marks}/half-r1", f"{marks}/half-r2")
        assert store.compact(wait_s=60).cells >= 40       # both runs' first halves
        open(f"{marks}/compacted", "w").close()
        deadline = time.monotonic() + 120
        while not all(os.path.exists(f"{marks}/done-{r}") for r in ("r1", "r2")):
            assert time.monotonic() < deadline
            store.compact(wait_s=60)
    """)
    root, marks = str(tmp_path / "store"), str(tmp_path)
    ResultStore(root).check(write=True)
    procs = [subprocess.Popen([sys.executable, "-c", writer, REPO, root, run, marks])
             for run in ("r1", "r2")]
    procs.append(subprocess.Popen([sys.executable, "-c", compactor, REPO, root, marks]))
    try:
        for p in procs:
            assert p.wait(timeout=240) == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    rows = ResultStore(root).read(["cell", "metric"]).to_pylist()
    counts = {}
    for r in rows:
        counts[(r["cell"], r["metric"])] = counts.get((r["cell"], r["metric"]), 0) + 1
    expected = {(f"{run}-{i}", m) for run in ("r1", "r2") for i in range(40)
                for m in ("accuracy", "nll")}
    assert set(counts) == expected
    assert set(counts.values()) == {1}                # none duplicated in the files
    assert not os.path.exists(os.path.join(root, "parts", ".lock"))


def wait_for(*files, timeout=120.0):
    import time

    deadline = time.monotonic() + timeout
    while not all(os.path.exists(f) for f in files):
        assert time.monotonic() < deadline, f"waited {timeout} s for {files}"
        time.sleep(0.02)


def test_a_newer_store_a_damaged_file_and_a_failing_query_are_one_line(tmp_path, capsys):
    pytest.importorskip("duckdb")
    store = old_store(tmp_path, sweeps=("a",))
    (tmp_path / "store.json").write_text('{"format": 99}')
    with pytest.raises(StoreError, match=r"newer rayeval \(store format 99; this one reads "
                                         r"up to 2\); upgrade"):
        newest(str(tmp_path))
    with pytest.raises(StoreError, match="newer rayeval"):
        store.check(write=True)                     # a run refuses before writing a cell
    (tmp_path / "store.json").unlink()
    bad = tmp_path / "results" / "zz-damaged.parquet"
    bad.write_bytes(b"PAR1 not really")
    code = cli.main(["leaderboard", str(tmp_path)])
    err = capsys.readouterr().err
    assert code != 0 and "damaged file in the result store" in err and str(bad) in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert cli.main(["query", str(tmp_path), "SELECT count(*) AS n FROM results"]) != 0
    assert str(bad) in capsys.readouterr().err
    assert cli.main(["query", str(tmp_path), "SELECT count(*) AS n FROM latest",
                     "--skip-damaged"]) == 0
    got = capsys.readouterr()
    assert got.out == "n\n12\n" and f"skipped a damaged file: {bad}" in got.err
    moved = store.compact()                          # compaction leaves it where it is
    assert moved.damaged == [str(bad)] and bad.exists() and moved.cells == 6
    assert cli.main(["query", str(tmp_path), "SELECT nope FROM latest", "--skip-damaged"]) != 0
    err = capsys.readouterr().err
    assert "SQL: Binder Error" in err and len(err.strip().splitlines()) == 2   # + the skip


def test_query_answers_as_the_rows_say(tmp_path):
    pytest.importorskip("duckdb")
    from rayeval.io.store.query import query

    store = old_store(tmp_path)
    store.write_cell("a1val", cell("a", "/ck/a/step_1", "val", 9, 0.9))   # written again
    store.compact()
    table = query(str(tmp_path), "SELECT evaluation, avg(value) AS mean, count(*) AS n FROM latest "
                                 "WHERE metric = 'accuracy' GROUP BY evaluation ORDER BY evaluation")
    rows = newest(str(tmp_path), metric="accuracy").to_pylist()
    for d in ("ood", "val"):
        values = [r["value"] for r in rows if r["evaluation"] == d]
        got = next(r for r in table.to_pylist() if r["evaluation"] == d)
        assert got["n"] == len(values) == 6 and got["mean"] == pytest.approx(np.mean(values))
    assert 0.9 in [r["value"] for r in rows]        # the newest write of a cell


def test_json_boards_are_the_text_json_dumps_writes():
    tricky = ['a, "b', '}, {"x', "\u00e9", "\\", "\x00", ',\x00"', "},\x00{", "", "x, "]
    rows = [{f"k{i}": v, "n": i, "f": -2.5e-7, "nan": float("nan"), "none": None, "t": True}
            for i, v in enumerate(tricky)]
    rows.insert(3, {"matrix": [[1, 2], [3, 4]], "names": ["val", 'o, "d']})
    assert dumps_indented(rows) == json.dumps(rows, indent=2)
    assert dumps_indented([]) == json.dumps([], indent=2)


def test_a_file_moved_into_a_part_while_a_reader_lists_is_read_from_the_part(tmp_path):
    """A reader lists the cell files; a mover publishes them in a part and removes them; the
    reader's scan then finds them gone, lists again and reads every cell once (a test polling
    a store while `watch` consolidated failed with 'damaged file')."""
    from rayeval.io.store import layout
    from rayeval.io.store import SCHEMA

    store = old_store(tmp_path)
    stale = layout.list_files(store.fs, store.root).all
    assert len(stale) == 12
    store.consolidate([os.path.basename(f)[:-len(".parquet")] for f in stale])
    table, damaged = layout.read_files(
        store.fs, stale, SCHEMA, str(tmp_path), ["cell", "metric"],
        relist=lambda: layout.list_files(store.fs, store.root).all)
    assert damaged == [] and table.num_rows == 24 and len(set(table["cell"].to_pylist())) == 12
    with pytest.raises(StoreError, match="cannot read result store"):
        layout.read_files(store.fs, stale, SCHEMA, str(tmp_path), ["cell"])
    assert len(store.read(["cell"])) == 24


def test_zeroed_bytes_inside_a_part_are_found_and_named(tmp_path, capsys):
    """Every page of a part carries a checksum that a read verifies: 200 zeroed bytes inside
    the part's pages (which decoded as other numbers, unnoticed, without one) fail the read in
    one line that names the file and says truthfully what moving it away does."""
    from rayeval.io.store import layout

    store = ResultStore(str(tmp_path))
    for n in range(40):
        store.write_cell(f"c{n:02d}", cell("a", f"/ck/a/step_{n}", "val", n, 0.5, reps=1000,
                                           seed=n))
    assert store.compact().cells == 40
    (part,) = [i.path for i in layout.list_parts(store.fs, store.root)]
    figures = layout.figures_of(part)
    want = {r["cell"]: r["value"] for r in store.read().to_pylist()}
    for path, said in ((part, "its cells are evaluated again on the next run"),
                       (figures, "a copy of its part's figures: the part is read instead, "
                                 "nothing is evaluated again")):
        whole = open(path, "rb").read()
        damaged = bytearray(whole)
        middle = len(whole) // 2
        damaged[middle:middle + 200] = bytes(200)
        with open(path, "wb") as f:
            f.write(damaged)
        with pytest.raises(StoreError) as e:
            layout.read_files(store.fs, [path], SCHEMA, str(tmp_path))
        assert e.value.message.startswith(f"damaged file in the result store: {path} (") and \
            e.value.message.endswith(f"; move it away ({said})"), e.value.message
        with open(path, "wb") as f:
            f.write(whole)
    assert {r["cell"]: r["value"] for r in store.read().to_pylist()} == want


def legacy_cell(store, name, rows):
    """A cell file as rayeval wrote it before 2026-12-02: the evaluation's name in a column
    named ``dataset``."""
    import pyarrow as pa

    from rayeval.io.store import layout

    table = pa.Table.from_pylist([{**r, "cell": name} for r in rows], schema=SCHEMA)
    old = table.rename_columns(["dataset" if n == "evaluation" else n for n in table.column_names])
    with open(os.path.join(store.dir, f"{name}.parquet"), "wb") as f:
        f.write(layout.to_parquet(old))


def test_files_that_name_the_evaluation_dataset_read_beside_new_ones(tmp_path, capsys):
    """A store written before the rename (and added to after it) reads as one: every read,
    filter, replicate lookup, board, compaction and SQL query gives the same answers as a store
    written whole today; queries that still say ``dataset`` run."""
    import pyarrow.parquet as pq

    new, mixed = ResultStore(str(tmp_path / "new")), ResultStore(str(tmp_path / "mixed"))
    mixed.check(write=True)
    os.makedirs(mixed.dir, exist_ok=True)
    n = 0
    for step in (1, 2, 3):
        for d in ("val", "ood"):
            n += 1
            rows = cell("a", f"/ck/a/step_{step}", d, step, 0.1 * step + (d == "ood") * 0.05,
                        seed=n)
            new.write_cell(f"a{step}{d}", rows)
            if step < 3:
                legacy_cell(mixed, f"a{step}{d}", rows)
            else:
                mixed.write_cell(f"a{step}{d}", rows)
    assert "dataset" in pq.read_schema(os.path.join(mixed.dir, "a1val.parquet")).names

    def answers(root):
        out = {"read": ResultStore(root).read().to_pylist(),
               "ood": ResultStore(root).read(evaluation="ood").to_pylist(),
               "newest": newest(root, columns=["evaluation", "metric", "value"]).to_pylist(),
               "replicates": {k: v.tolist() for k, v in ResultStore(root).replicates(
                   {("a1ood", "ood", "nll"), ("a3val", "val", "accuracy")}).items()}}
        for flags in [(), ("--eval", "ood"), ("--replicates",)]:
            out[flags] = board(capsys, root, *flags)
        return out

    want = answers(str(tmp_path / "new"))
    assert len(want["ood"]) == 6 and len(want["replicates"]) == 2
    assert answers(str(tmp_path / "mixed")) == want
    mixed.compact()                       # old and new files into one part
    assert not [n for n in os.listdir(mixed.dir) if n.endswith(".parquet")]
    assert answers(str(tmp_path / "mixed")) == want
    if importlib.util.find_spec("duckdb") is not None:
        from rayeval.io.store.query import query

        legacy_cell(mixed, "a9val", cell("a", "/ck/a/step_9", "val", 9, 0.9))
        sql = "SELECT {0}, count(*) AS n FROM latest GROUP BY {0} ORDER BY {0}"
        for column in ("evaluation", "dataset"):
            got = query(str(tmp_path / "mixed"), sql.format(column)).to_pylist()
            assert got == [{column: "ood", "n": 6}, {column: "val", "n": 8}]
