"""Benchmark: the results report at issue 45's scale, in headless Chromium.

Two synthetic stores, built as ``scripts/bench_store.py`` builds them (its ``real_cell``,
``synth`` and ``build``: a REAL cell of the digits example, its three metric rows with their
1,000 bootstrap replicates, copied to every checkpoint x evaluation with values shifted per
checkpoint; 100 checkpoints a sweep):

- ``report``: ``--checkpoints`` x ``--evaluations`` (1,000 x 10). ``rayeval report STORE
  --output report.html`` is timed (wall, a fresh process) and the file's size taken; then the
  file is opened in Chromium (``page.goto(file://...)``): first contentful paint
  (``performance.getEntriesByName('first-contentful-paint')``: in a big file, the header
  painted while the page is still parsed, before the board), ``body[data-ready]`` (set when
  meta and board are loaded, a moment BEFORE the board's table is built), the board view's
  ``body[data-rendered="#"]`` (its table built) and the next frame after it: the board
  painted. Target: the board painted <= 2 s after navigation.
- ``view``: ``--cells`` (100,000: 1,000 checkpoints x 100 evaluations, bench_store's shape),
  with per-item records of one evaluation (eval-000, ``--items`` items, multiple choice with
  4 choices: id, context, choices, target, response, loglikelihoods, acc, acc_norm) for
  ``--record-checkpoints`` checkpoints, written with ``ResultStore.write_samples`` (2 worker
  files a cell) and named by those cells' rows (``samples``). ``rayeval view STORE --port 0``
  is started (timed until it prints its URL: the server's start), then the page: navigation to
  ``body[data-ready]`` and to the board drawn (``data-rendered="#"``: only once the marks of
  the columns shown have come back) and painted; target 2 s. A board not painted within
  ``--board-timeout`` (60 s) counts as not painted (infinite, in the median); as the server
  computes one view at a time and would answer the items only after those marks, the items
  are then timed on a fresh server, from the page opened on ``#about`` (meta and board, no
  marks). Then ``#items?evaluation=eval-000&entry=0`` (the app shows the first checkpoint
  with records when entry 0 has none) until its ``data-rendered`` and the next frame, and
  another checkpoint's items (its records not yet read by the server); target 1 s.

Every figure is the median of ``--repeats`` (3) runs, each in a fresh browser context (and,
for ``view``, a fresh server). All page times are on the page's clock from the start of the
navigation (``performance.now()``), taken by a MutationObserver injected before the page's
own script; the wall time Playwright saw is printed beside. Where it helps to see where the
time goes, the server's time per request (the page's Resource Timing: request start to first
byte, bytes) and Chromium's own counters (``Performance.getMetrics``: script, layout, style
recalculation, DOM nodes) are printed too, and ``--breakdown`` times the Python side view by
view in this process (the view store's marks and paired take minutes).

    python scripts/bench_report.py                  # issue 45's sizes (~12 minutes)
    python scripts/bench_report.py --quick          # small sizes (~25 s; first run ~55 s)
    python scripts/bench_report.py --only view --cell CELL.parquet --work /tmp/br --keep

``--cell FILE`` names a stored cell's parquet file; else the digits example is run once (~20 s)
and its cell kept as ``rayeval-bench-report-cell.parquet`` in ``--work`` or, without it, in the
temporary folder (/tmp), and used again by later runs (delete it to run the example again).
Stores kept with ``--keep`` in ``--work`` are used again where their shape is the same. Disk:
the 100,000-cell store is ~2.4 GB (its replicates do not compress; ~1 minute to build). The
machine's load (``uptime``) is printed with the figures.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_store  # noqa: E402 - its real_cell, synth and build
import benchkit  # noqa: E402

REPO = benchkit.REPO

CHROMIUM = os.environ.get("RAYEVAL_CHROMIUM", "/usr/bin/chromium")
CELL_FILE = "rayeval-bench-report-cell.parquet"    # the digits example's cell, kept
RECORDS_EVALUATION = "eval-000"
TAG = "bench"
BOARD_TARGET_S, ITEMS_TARGET_S = 2.0, 1.0

# Injected before the page's own script: when body[data-ready] and each body[data-rendered]
# value appear (page clock, ms from the start of the navigation), and the frame after each
# (requestAnimationFrame, then a task: after that frame was painted).
PROBE = """
(() => {
  const t = window.__bench = { rendered: {}, painted: {}, lcp: null, readyPainted: null };
  const after = (set) => requestAnimationFrame(() => setTimeout(() => set(performance.now()), 0));
  const seen = () => {
    const b = document.body;
    if (!b) return;
    const now = performance.now();
    if (b.hasAttribute('data-ready') && t.ready === undefined) {
      t.ready = now; after((v) => { t.readyPainted = v; });
    }
    const r = b.getAttribute('data-rendered');
    if (r !== null && !(r in t.rendered)) {
      t.rendered[r] = now; after((v) => { t.painted[r] = v; });
    }
  };
  new MutationObserver(seen).observe(document, { subtree: true, attributes: true,
    attributeFilter: ['data-ready', 'data-rendered'] });
  try {
    new PerformanceObserver((list) => {
      for (const e of list.getEntries()) t.lcp = e.startTime;
    }).observe({ type: 'largest-contentful-paint', buffered: true });
  } catch (e) {}
})();
"""


# --- stores --------------------------------------------------------------------------------

@contextlib.contextmanager
def shaped(evaluations: int, records: dict | None = None):
    """bench_store's ``synth`` with ``evaluations`` evaluations a checkpoint, no row naming
    per-item records and, with ``records`` ({"items": n, "checkpoints": {number: None}}), the
    rows of RECORDS_EVALUATION at those checkpoints naming TAG as theirs (their cell keys are
    filled in), every row of that evaluation counting n items."""
    saved = bench_store.EVALUATIONS, bench_store.synth
    original = bench_store.synth

    def synth(cell, cells):
        for sweep, table, rows_per in original(cell, cells):
            yield sweep, _name_records(table, records), rows_per

    bench_store.EVALUATIONS, bench_store.synth = evaluations, synth
    try:
        yield
    finally:
        bench_store.EVALUATIONS, bench_store.synth = saved


def _name_records(table: pa.Table, records: dict | None) -> pa.Table:
    """No row names per-item records (the real cell's tag, where it kept some, names files
    that no copy has) but, with ``records``, RECORDS_EVALUATION's at its checkpoints."""
    import pyarrow.compute as pc

    at = table.column_names.index("samples")
    if records is None:
        return table.set_column(at, "samples", pa.nulls(table.num_rows, pa.string()))
    steps = table["step"].to_numpy()
    mine = pc.equal(table["evaluation"], RECORDS_EVALUATION).to_numpy(zero_copy_only=False)
    chosen = mine & np.isin(steps // 100, list(records["checkpoints"]))
    samples = np.where(chosen, TAG, None)
    table = table.set_column(at, "samples", pa.array(samples, pa.string()))
    n = np.where(mine, records["items"], table["num_samples"].to_numpy())
    table = table.set_column(table.column_names.index("num_samples"), "num_samples",
                             pa.array(n, pa.int64()))
    for c, key in zip(steps[chosen] // 100, pc.filter(table["cell"], pa.array(chosen)).to_pylist()):
        records["checkpoints"][int(c)] = key
    return table


def build_store(cell: pa.Table, checkpoints: int, evaluations: int, folder: str,
                records: dict | None = None, context_chars: int = 0) -> float:
    """The store (and its records); one built before in ``folder`` with the same shape (a
    ``--work`` folder kept with ``--keep``) is used again: 0 s."""
    marker = os.path.join(folder, "bench_report.json")
    shape = {"checkpoints": checkpoints, "evaluations": evaluations,
             "items": records and records["items"], "context_chars": context_chars,
             "record_checkpoints": records and sorted(records["checkpoints"])}
    if os.path.exists(marker):
        with open(marker) as f:
            kept = json.load(f)
        if kept["shape"] == shape:
            if records is not None:
                records["checkpoints"] = {int(k): v for k, v in kept["cells"].items()}
            return 0.0
    shutil.rmtree(folder, ignore_errors=True)
    with shaped(evaluations, records):
        seconds = bench_store.build(cell, checkpoints * evaluations, None, folder)
    if records is not None:
        with benchkit.Stopwatch() as took:
            write_records(folder, records, context_chars)
        seconds += took.s
    with open(marker, "w") as f:
        json.dump({"shape": shape, "cells": records and records["checkpoints"]}, f)
    return seconds


WORDS = ("the of a which following is most likely when an in to that best describes "
         "following statement true false about energy cell market law theorem function "
         "population gene court contract reaction velocity ratio value patient symptom "
         "treaty policy income demand supply enzyme circuit current charge argument").split()


def item_fields(items: int, context_chars: int, seed: int = 0) -> dict:
    """What describes an MMLU-like item (the same at every checkpoint): id, a prompt of about
    ``context_chars`` characters (0-shot question with its lettered choices), 4 choices."""
    rng = np.random.default_rng(seed)
    words = np.array(WORDS)
    lengths = np.clip(rng.normal(context_chars, context_chars / 3, items), 80, None).astype(int)
    contexts, choices = [], []
    for k in range(items):
        n = max(4, lengths[k] // 7)
        body = " ".join(words[rng.integers(0, len(words), n)])
        opts = [" ".join(words[rng.integers(0, len(words), rng.integers(1, 8))]) + f" ({j})"
                for j in range(4)]
        contexts.append(f"The following are multiple choice questions (with answers).\n\n"
                        f"{body}?\n" + "".join(f"{'ABCD'[j]}. {o}\n" for j, o in enumerate(opts))
                        + "Answer:")
        choices.append(opts)
    target = rng.integers(0, 4, items)
    return {"id": np.arange(items, dtype=np.int64), "context": contexts, "choices": choices,
            "target": [choices[k][target[k]] for k in range(items)], "target_index": target}


def records_table(fields: dict, checkpoint: int) -> pa.Table:
    """One checkpoint's records: what it picked (loglikelihoods' argmax), acc, acc_norm."""
    from rayeval.core.samples import COLUMNS

    rng = np.random.default_rng(1000 + checkpoint)
    n = len(fields["id"])
    ll = rng.normal(-8.0, 2.0, (n, 4))
    right = rng.random(n) < 0.45 + 0.2 * rng.random()          # this checkpoint's accuracy
    t = fields["target_index"]
    ll[right, t[right]] = ll[right].max(axis=1) + rng.random(right.sum())
    pick = ll.argmax(axis=1)
    lengths = np.array([[len(c) for c in cs] for cs in fields["choices"]])
    pick_norm = (ll / lengths).argmax(axis=1)
    acc = (pick == t).astype(np.float64)
    acc_norm = (pick_norm == t).astype(np.float64)
    order = rng.permutation(n)          # workers write in their own order; the report sorts
    return pa.table({
        "id": pa.array(fields["id"][order]),
        "context": pa.array([fields["context"][k] for k in order], COLUMNS["context"]),
        "choices": pa.array([fields["choices"][k] for k in order], COLUMNS["choices"]),
        "target": pa.array([fields["target"][k] for k in order], COLUMNS["target"]),
        "response": pa.array([fields["choices"][k][pick[k]] for k in order],
                             COLUMNS["response"]),
        "loglikelihoods": pa.array(ll[order].tolist(), COLUMNS["loglikelihoods"]),
        "acc": pa.array(acc[order]),
        "acc_norm": pa.array(acc_norm[order]),
    })


def write_records(store: str, records: dict, context_chars: int) -> None:
    from rayeval.io.store import ResultStore

    opened = ResultStore(store)
    fields = item_fields(records["items"], context_chars)
    for checkpoint, cell in records["checkpoints"].items():
        table = records_table(fields, checkpoint)
        half = table.num_rows // 2                   # two workers' files, as a run writes
        opened.write_samples(cell, TAG, 0, 2, table.slice(0, half))
        opened.write_samples(cell, TAG, 1, 2, table.slice(half))


def record_checkpoints(checkpoints: int, count: int) -> dict:
    """``count`` checkpoints spread over the store (first, ..., last)."""
    picks = sorted({round(k * (checkpoints - 1) / max(1, count - 1)) for k in range(count)})
    return {c: None for c in picks}


# --- the browser ---------------------------------------------------------------------------

class Browser:
    def __init__(self, executable: str):
        from playwright.sync_api import sync_playwright

        self._pw = sync_playwright().start()
        self.browser = self._pw.chromium.launch(executable_path=executable,
                                                args=["--no-sandbox"])

    def page(self):
        context = self.browser.new_context(viewport={"width": 1400, "height": 900})
        context.add_init_script(PROBE)
        page = context.new_page()
        errors: list[str] = []
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: errors.append(str(e)))
        cdp = context.new_cdp_session(page)
        cdp.send("Performance.enable")
        return context, page, cdp, errors

    def close(self):
        self.browser.close()
        self._pw.stop()


def chrome_metrics(cdp) -> dict:
    got = {m["name"]: m["value"] for m in cdp.send("Performance.getMetrics")["metrics"]}
    return {"script_s": got.get("ScriptDuration"), "layout_s": got.get("LayoutDuration"),
            "style_s": got.get("RecalcStyleDuration"), "task_s": got.get("TaskDuration"),
            "nodes": got.get("Nodes"), "heap_mb": (got.get("JSHeapUsedSize") or 0) / 2 ** 20}


def metrics_delta(before: dict, after: dict) -> dict:
    return {k: (after[k] - before[k] if k.endswith("_s") else after[k]) for k in after}


def open_page(page, url: str, timeout_ms: int = 120_000, view: str = "#") -> dict:
    """Navigate; the page's own times (ms from the navigation's start) of first contentful
    paint, data-ready, the first view drawn (``data-rendered``: "#" for the board) and
    painted. Where that view has not painted within ``timeout_ms``: its times are None."""
    from playwright.sync_api import TimeoutError as PageTimeout

    began = time.perf_counter()
    page.goto(url + (view if view != "#" else ""), wait_until="commit", timeout=timeout_ms)
    page.wait_for_selector("body[data-ready]", state="attached", timeout=timeout_ms)
    ready_wall = time.perf_counter() - began
    try:
        page.wait_for_function("(h) => window.__bench.painted[h] !== undefined", arg=view,
                               timeout=max(1, timeout_ms - ready_wall * 1000))
        wall = time.perf_counter() - began
    except PageTimeout:
        wall = None
    got = page.evaluate("""(h) => {
      const t = window.__bench;
      const fcp = performance.getEntriesByName('first-contentful-paint')[0];
      return { fcp: fcp ? fcp.startTime : null, ready: t.ready, ready_painted: t.readyPainted,
               board: t.rendered[h] === undefined ? null : t.rendered[h],
               board_painted: t.painted[h] === undefined ? null : t.painted[h], lcp: t.lcp,
               rows: document.querySelectorAll('table.board tbody tr').length,
               cells: document.querySelectorAll('table.board tbody td').length,
               elements: document.getElementsByTagName('*').length };
    }""", view)
    got["ready_wall"] = ready_wall * 1000
    got["board_wall"] = None if wall is None else wall * 1000
    got["timed_out"] = wall is None
    return got


def show(page, hash_: str, timeout_ms: int = 120_000) -> dict:
    """Go to a view by its hash; ms until it rendered and painted (page clock)."""
    began = time.perf_counter()
    start = page.evaluate("(h) => { const s = performance.now(); location.hash = h; return s; }",
                          hash_)
    page.wait_for_function("(h) => window.__bench.painted[h] !== undefined", arg=hash_,
                           timeout=timeout_ms)
    wall = time.perf_counter() - began
    got = page.evaluate("""(h) => {
      const t = window.__bench;
      return { rendered: t.rendered[h], painted: t.painted[h],
               cards: document.querySelectorAll('.items .item').length,
               elements: document.getElementsByTagName('*').length,
               error: (document.querySelector('#main .error') || {}).textContent || null,
               entry: (document.querySelector('select[name=entry]') || {}).value || null,
               holders: Array.from(document.querySelectorAll('select[name=entry] option'))
                 .map(o => o.value) };
    }""", hash_)
    got["rendered"] -= start
    got["painted"] -= start
    got["wall"] = wall * 1000
    return got


def api_timings(page, since: float = 0.0) -> list[dict]:
    """The page's requests to the server: ms to first byte (the server's work), to the last
    byte, and the body's size."""
    return page.evaluate("""(since) => performance.getEntriesByType('resource')
      .filter(e => e.name.indexOf('/api/') >= 0 && e.startTime >= since)
      .map(e => ({ view: decodeURIComponent(e.name.split('/api/')[1]),
                   start: e.startTime, first_byte: e.responseStart - e.startTime,
                   done: e.responseEnd - e.startTime, mb: e.encodedBodySize / 1e6 }))""", since)


# --- the two benchmarks ----------------------------------------------------------------------

def bench_report(args, cell: pa.Table, work: str, browser: Browser) -> dict:
    store = os.path.join(work, f"report-store-{args.checkpoints}x{args.evaluations}")
    build_s = build_store(cell, args.checkpoints, args.evaluations, store)
    print(f"\n== report: {args.checkpoints:,} checkpoints x {args.evaluations} evaluations "
          f"({args.checkpoints * args.evaluations:,} cells; store "
          f"{benchkit.folder_mb(store):,.0f} MB, built in {build_s:.1f} s)", flush=True)
    output = os.path.join(work, "report.html")
    runs = []
    for i in range(args.repeats):
        write_s = benchkit.run([sys.executable, "-m", "rayeval", "report", store, "--output",
                                output], env=benchkit.env(REPO), what="rayeval report").seconds
        size = os.path.getsize(output) / 1e6
        context, page, cdp, errors = browser.page()
        try:
            got = open_page(page, "file://" + output)
            got.update(chrome_metrics(cdp))
        finally:
            context.close()
        got.update(write_s=write_s, mb=size, errors=errors[:3])
        runs.append(got)
        print(f"run {i + 1}: write {write_s:.2f} s, {size:.1f} MB; page: first contentful paint "
              f"{_ms(got['fcp'])}, data-ready {_ms(got['ready'])} (seen {_ms(got['ready_wall'])}), "
              f"board drawn {_ms(got['board'])}, painted {_ms(got['board_painted'])} (seen "
              f"{_ms(got['board_wall'])}); {got['rows']} rows x "
              f"{got['cells'] // max(1, got['rows'])} cells, {got['elements']:,} elements; "
              f"Chromium: script {got['script_s']:.2f} s, layout {got['layout_s']:.2f} s, "
              f"style {got['style_s']:.2f} s"
              + (f"; ERRORS {errors[:3]}" if errors else ""), flush=True)
    out = {"checkpoints": args.checkpoints, "evaluations": args.evaluations,
           "build_s": round(build_s, 1), "runs": runs}
    for key in ("write_s", "mb", "fcp", "ready", "board", "board_painted", "script_s",
                "layout_s", "style_s"):
        out[f"median_{key}"] = benchkit.median(r.get(key) for r in runs)
    painted = out["median_board_painted"] / 1000
    out["met"] = painted <= BOARD_TARGET_S
    print(f"report, median of {len(runs)}: write {out['median_write_s']:.2f} s, "
          f"{out['median_mb']:.1f} MB; first contentful paint {_ms(out['median_fcp'])}; "
          f"data-ready {_ms(out['median_ready'])}; board painted {painted:.2f} s "
          f"(target <= {BOARD_TARGET_S} s: {'met' if out['met'] else 'MISSED'})", flush=True)
    if args.breakdown:
        out["breakdown"] = breakdown_report(store)
    if not args.keep:
        shutil.rmtree(store, ignore_errors=True)
    return out


def bench_view(args, cell: pa.Table, work: str, browser: Browser) -> dict:
    evaluations = bench_store.EVALUATIONS
    checkpoints = max(1, args.cells // evaluations)
    store = os.path.join(work, f"view-store-{args.cells}")
    records = {"items": args.items,
               "checkpoints": record_checkpoints(checkpoints, args.record_checkpoints)}
    build_s = build_store(cell, checkpoints, evaluations, store, records, args.context_chars)
    print(f"\n== view: {checkpoints * evaluations:,} cells ({checkpoints:,} checkpoints x "
          f"{evaluations} evaluations; store {benchkit.folder_mb(store):,.0f} MB, built in "
          f"{build_s:.1f} s with its records: {args.items:,} items of {RECORDS_EVALUATION} at "
          f"checkpoints {sorted(records['checkpoints'])})", flush=True)
    evaluation = RECORDS_EVALUATION
    limit_ms = args.board_timeout * 1000
    runs = []
    for i in range(args.repeats):
        server, url, start_s = start_server(store)
        context, page, cdp, errors = browser.page()
        try:
            got = open_page(page, url, limit_ms)
            board_metrics = chrome_metrics(cdp)
            got["board_api"] = api_timings(page)
            got.update(start_s=start_s, **{f"board_{k}": v for k, v in board_metrics.items()})
            print(f"run {i + 1}: server start {start_s:.2f} s; page: data-ready "
                  f"{_ms(got['ready'])}, board drawn {_ms(got['board'], limit_ms)}, painted "
                  f"{_ms(got['board_painted'], limit_ms)} (seen {_ms(got['board_wall'], limit_ms)})"
                  f"; {got['rows']} rows x {got['cells'] // max(1, got['rows'])} cells, "
                  f"{got['elements']:,} elements; Chromium: script "
                  f"{got['board_script_s']:.2f} s, layout {got['board_layout_s']:.2f} s, style "
                  f"{got['board_style_s']:.2f} s", flush=True)
            print("  requests: " + _requests(got["board_api"], pending=got["timed_out"]),
                  flush=True)
            since = got["board_painted"] or 0.0
            if got["timed_out"]:
                # the server computes one view at a time: the items would wait for the marks.
                # A fresh server, and the page opened on the provenance view (meta and board,
                # no marks), is where the items are asked for instead.
                context.close()
                stop_server(server)
                server, url, _ = start_server(store)
                context, page, cdp, errors2 = browser.page()
                about = open_page(page, url, limit_ms, view="#about")
                since = about["board_painted"]
                got["items_from"] = "#about (a fresh server: the board's marks were pending)"
            else:
                got["items_from"] = "the board"
            before = chrome_metrics(cdp)
            first = f"#items?evaluation={evaluation}&entry=0"
            items = show(page, first)
            items["metrics"] = metrics_delta(before, chrome_metrics(cdp))
            items["api"] = api_timings(page, since)
            other = [h for h in items["holders"] if h != items["entry"]]
            second = None
            if other:
                mark_ = page.evaluate("performance.now()")
                second = show(page, f"#items?evaluation={evaluation}&entry={other[-1]}")
                second["api"] = api_timings(page, mark_)
        finally:
            context.close()
            stop_server(server)
        got.update(items=items, other_items=second, errors=errors[:3])
        runs.append(got)
        m = items["metrics"]
        print(f"  items (entry {items['entry']}, {first} from {got['items_from']}): drawn "
              f"{_ms(items['rendered'])}, painted {_ms(items['painted'])} (seen "
              f"{_ms(items['wall'])}); {items['cards']} cards, {items['elements']:,} elements; "
              f"Chromium: script {m['script_s']:.2f} s, layout {m['layout_s']:.2f} s, style "
              f"{m['style_s']:.2f} s" + (f"; ERROR {items['error']}" if items["error"] else ""),
              flush=True)
        print("  requests: " + _requests(items["api"]), flush=True)
        if second:
            print(f"  another checkpoint's items (entry {second['entry']}, records not yet "
                  f"read): painted {_ms(second['painted'])}; requests: "
                  + _requests(second["api"]), flush=True)
        if errors:
            print(f"  ERRORS in the page: {errors[:3]}", flush=True)
    out = {"cells": checkpoints * evaluations, "checkpoints": checkpoints,
           "evaluations": evaluations, "items": args.items,
           "record_checkpoints": sorted(records["checkpoints"]), "build_s": round(build_s, 1),
           "board_timeout_s": args.board_timeout, "runs": runs}
    for key in ("start_s", "ready"):
        out[f"median_{key}"] = benchkit.median(r.get(key) for r in runs)
    for key in ("board", "board_painted"):   # a run past the timeout counts as infinite
        out[f"median_{key}"] = benchkit.median(
            math.inf if r[key] is None else r[key] for r in runs)
    out["median_items_painted"] = benchkit.median(r["items"]["painted"] for r in runs)
    seconds = [r["other_items"]["painted"] for r in runs if r["other_items"]]
    out["median_other_items_painted"] = benchkit.median(seconds)
    out["board_met"] = out["median_board_painted"] / 1000 <= BOARD_TARGET_S
    out["items_met"] = out["median_items_painted"] / 1000 <= ITEMS_TARGET_S
    print(f"view, median of {len(runs)}: server start {out['median_start_s']:.2f} s (until it "
          f"prints its URL); data-ready {_ms(out['median_ready'])}; board painted "
          f"{_ms(out['median_board_painted'], limit_ms)} (target <= {BOARD_TARGET_S} s: "
          f"{'met' if out['board_met'] else 'MISSED'}); {args.items:,} items painted "
          f"{out['median_items_painted'] / 1000:.2f} s (target <= {ITEMS_TARGET_S} s: "
          f"{'met' if out['items_met'] else 'MISSED'})"
          + (f"; another checkpoint's items {out['median_other_items_painted'] / 1000:.2f} s"
             if seconds else ""), flush=True)
    for key in ("median_board", "median_board_painted"):
        if out[key] == math.inf:
            out[key] = None                    # JSON: not painted within the timeout
    if args.breakdown:
        out["breakdown"] = breakdown_view(store, evaluation, sorted(records["checkpoints"]))
    if not args.keep:
        shutil.rmtree(store, ignore_errors=True)
    return out


def start_server(store: str):
    began = time.perf_counter()
    server = subprocess.Popen([sys.executable, "-m", "rayeval", "view", store, "--port", "0"],
                              env=benchkit.env(REPO), stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True)
    for line in server.stderr:
        if line.startswith("rayeval view: http"):
            return server, line.split()[2], time.perf_counter() - began
    server.wait()
    raise SystemExit(f"rayeval view exited ({server.returncode}) before serving")


def stop_server(server) -> None:
    server.terminate()
    try:
        server.wait(timeout=10)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()


# --- where the time goes (Python side, in this process) --------------------------------------

def _timed(label: str, fn, out: dict, size=None):
    with benchkit.Stopwatch() as took:
        value = fn()
    out[label] = {"s": round(took.s, 3)}
    line = f"  {label}: {took.s:.3f} s"
    if size is not None:
        from rayeval.reporting.report_page import embedded_json

        with benchkit.Stopwatch() as took:
            text = embedded_json(value)
        out[label].update(json_s=round(took.s, 3), mb=round(len(text) / 1e6, 2))
        line += f" (+ JSON {out[label]['json_s']:.3f} s, {out[label]['mb']:.2f} MB)"
    print(line, flush=True)
    return value


def breakdown_report(store: str) -> dict:
    from rayeval.reporting.report import Report
    from rayeval.reporting.report_page import page

    print("where rayeval report's time goes (this process):", flush=True)
    out: dict = {}
    report = _timed("Report(store) (the board, marked)", lambda: Report(store), out)
    _timed("meta", report.meta, out, size=True)
    _timed("board", report.board_view, out, size=True)
    refs = report.references()
    one = _timed(f"paired?ref={refs[0]} (the file holds {len(refs)} references: x "
                 f"{len(refs)})", lambda: report.paired(refs[0]), out, size=True)
    views = {"meta": report.meta(), "board": report.board_view(),
             **{f"paired?ref={r}": one for r in refs}}     # as big as the file's, made once
    _timed("page(views) (the JSON and the page)", lambda: page(views), out)
    return out


def breakdown_view(store: str, evaluation: str, record_checkpoints: list[int]) -> dict:
    from rayeval.reporting.report import Report

    print("where rayeval view's time goes (this process, the views the page asks for):",
          flush=True)
    out: dict = {}
    report = _timed("Report(store, marks=False) (the server's start)",
                    lambda: Report(store, marks=False), out)
    _timed("meta", report.meta, out, size=True)
    board = _timed("board", report.board_view, out, size=True)
    shown = [c["name"] for c in board["columns"] if c["name"] not in board["marked"]]
    _timed(f"marks of the {len(shown)} columns shown", lambda: report.marks(shown), out,
           size=True)
    holders = report.items_entries(evaluation)
    _timed(f"items?evaluation={evaluation}", lambda: report.items(evaluation), out, size=True)
    _timed(f"cell?entry={holders[0]} (records read by the board)",
           lambda: report.cell(evaluation, holders[0]), out, size=True)
    if len(holders) > 1:
        _timed(f"cell?entry={holders[-1]} (records not read before)",
               lambda: report.cell(evaluation, holders[-1]), out, size=True)
    _timed("paired?ref=0", lambda: report.paired(0), out, size=True)
    return out


# --- main ----------------------------------------------------------------------------------

def _ms(v, limit_ms: float | None = None) -> str:
    """Milliseconds as seconds; None or infinite past ``limit_ms``: "> N s"."""
    if v is None or v == math.inf:
        return f"> {limit_ms / 1000:.0f} s" if limit_ms is not None else "-"
    return f"{v / 1000:.2f} s"


def _short(view: str) -> str:
    if view.startswith("marks?columns="):
        return f"marks ({len(json.loads(view.split('=', 1)[1]))} columns)"
    return view


def _requests(rows: list[dict], pending: bool = False) -> str:
    done = "; ".join(f"{_short(r['view'])} first byte {r['first_byte'] / 1000:.2f} s, done "
                     f"{r['done'] / 1000:.2f} s, {r['mb']:.2f} MB" for r in rows) or "none"
    return done + ("; a request still pending (marks?columns=...: the page's requests "
                   "that had not finished are not listed)" if pending else "")


def main(argv=None) -> int:
    p = benchkit.parser(__doc__, repeats=3)
    p.add_argument("--checkpoints", type=int, default=1000, help="report: checkpoints")
    p.add_argument("--evaluations", type=int, default=10, help="report: evaluations")
    p.add_argument("--cells", type=int, default=100_000,
                   help=f"view: cells ({bench_store.EVALUATIONS} evaluations a checkpoint)")
    p.add_argument("--items", type=int, default=14_000,
                   help=f"view: items of {RECORDS_EVALUATION}'s per-item records")
    p.add_argument("--record-checkpoints", type=int, default=3,
                   help="view: how many checkpoints kept per-item records")
    p.add_argument("--context-chars", type=int, default=600,
                   help="view: an item's prompt, characters on average (a 0-shot MMLU "
                        "question with its choices)")
    p.add_argument("--board-timeout", type=float, default=60.0,
                   help="view: seconds to wait for the board to paint (a run past it counts "
                        "as not painted; its items are then timed on a fresh server)")
    p.add_argument("--quick", action="store_true",
                   help="small sizes (100 x 4 report; 1,000 cells, 1,400 items)")
    p.add_argument("--only", choices=("report", "view"))
    p.add_argument("--breakdown", action="store_true",
                   help="also time the Python side view by view, in this process")
    p.add_argument("--cell", help="a stored cell's parquet file (default: the digits "
                                  f"example's, run once and kept as {CELL_FILE})")
    p.add_argument("--work", help="where to build the stores (default: a temporary folder)")
    p.add_argument("--keep", action="store_true", help="keep the stores")
    p.add_argument("--chromium", default=CHROMIUM)
    args = p.parse_args(argv)
    if args.quick:
        args.checkpoints, args.evaluations = 100, 4
        args.cells, args.items, args.record_checkpoints = 1_000, 1_400, 2
    figures: dict = {"uptime": [benchkit.uptime()], "args": vars(args)}
    print(figures["uptime"][0], flush=True)
    browser = None
    with benchkit.workdir("rayeval-bench-report-", args.work, args.keep) as work:
        kept = os.path.join(work if args.work else tempfile.gettempdir(), CELL_FILE)
        if args.cell:
            cell = pq.read_table(args.cell)
        elif os.path.exists(kept):
            cell = pq.read_table(kept)
        else:
            cell = bench_store.real_cell(None, work)
            pq.write_table(cell, kept + ".partial")
            os.replace(kept + ".partial", kept)
        print(f"real cell: {cell.num_rows} rows, "
              f"{len(cell['replicates'][0].as_py() or [])} replicates a row"
              + ("" if args.cell else f" ({kept}; delete it to run the example again)"),
              flush=True)
        try:
            browser = Browser(args.chromium)
            if args.only in (None, "report"):
                figures["report"] = bench_report(args, cell, work, browser)
                figures["uptime"].append(benchkit.uptime())
                print(figures["uptime"][-1], flush=True)
            if args.only in (None, "view"):
                figures["view"] = bench_view(args, cell, work, browser)
                figures["uptime"].append(benchkit.uptime())
                print(figures["uptime"][-1], flush=True)
        finally:
            if browser is not None:
                browser.close()
    benchkit.record(args.json, figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
