"""The text tasks of language models against lm-evaluation-harness itself.

A tiny GPT-2 and a BPE tokenizer are trained here (scripts/make_lm_example.py: nothing is
downloaded) and saved as Hugging Face folders; the harness (tests/harness.py: its Python API on
the same folders and parquet files) is the reference. Compared: every item (each choice's
log-likelihood, each document's, each generation) and every metric, in one process and on a real
local Ray with 1 and 3 workers; shared-prefix scoring (model.share_prefixes) both on and off
(one process: both; Ray: the 1-worker run without it, the 3-worker run with it). Bad input is
one line before Ray starts, with nothing written.
"""

import dataclasses
import json
import math
import os
import shutil
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import yaml

import rayeval

pytest.importorskip("transformers")
pytest.importorskip("lm_eval")

from harness import run_harness  # noqa: E402
from support import (record_sets, local_ray, ray_starts, rayeval_cli, rayeval_main,  # noqa: E402
                     single_process_passes)

from rayeval.plan import preflight  # noqa: E402
from rayeval.io.data import read_batches  # noqa: E402
from rayeval.core.evaluate import Decoder, Pass, finalize  # noqa: E402
from rayeval.ranking import latest_rows  # noqa: E402
from rayeval.io.model import ModelSource  # noqa: E402
from rayeval.plan.loader import load_sweep  # noqa: E402
from rayeval.io.store import ResultStore  # noqa: E402
from rayeval.core.tasks.text import rolling_windows  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
REL = 1e-4          # perplexities: float32 kernels differ with the batch's padding
EVALS = {"facts_mc": "mc", "docs": "docs", "sums": "gen"}


@pytest.fixture(scope="module")
def example(tmp_path_factory, lm_example):
    out = tmp_path_factory.mktemp("lm")
    lm_example(out)           # the run's one training of the tiny GPT-2 (tests/conftest.py)
    return out


@pytest.fixture(scope="module")
def checkpoints(example):
    return sorted(str(p) for p in (example / "ckpts").iterdir())


@pytest.fixture(scope="module")
def harness(example, checkpoints):
    return {c: run_harness(c, str(example / "data")) for c in checkpoints}


def reference(sweep_path: str, share: bool = True) -> dict:
    """rayeval's own scoring in one process: {checkpoint: {evaluation: (per-id outputs, metric
    results)}}, batches of 7 rows so that items meet in different batches than in the harness;
    ``share``: model.share_prefixes."""
    out = {}
    sweep = load_sweep(sweep_path)
    sweep = sweep.replace(model=dataclasses.replace(sweep.model, share_prefixes=share))
    for ref, ev, model, decode, p, metrics in single_process_passes(sweep):
        items = {}
        for table in read_batches(ev.data, ev.spec.dataset, 7):
            x, y, buckets = decode(table)
            with torch.inference_mode():
                scored, _ = p.score(x, y)
            for i, row_id in enumerate(table.column("id").to_pylist()):
                items[row_id] = scored[i]
            p.update(x, y, buckets)
        p.finish()
        results = finalize(metrics, p.states, ev.output_size, ev.spec.bootstrap)
        out.setdefault(ref.location, {})[ev.name] = (
            items, results, int(p.states["_tokens"]) if "_tokens" in p.states else None)
    return out


def test_rolling_windows_are_the_harness_windows():
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    for n in (0, 1, 5, 63, 64, 65, 128, 129, 300):
        for length in (1, 2, 8, 64):
            tokens = list(range(100, 100 + n))
            theirs = [make_disjoint_window(w) for w in get_rolling_token_windows(
                tokens, prefix_token=7, max_seq_len=length, context_len=1)]
            ours = rolling_windows(tokens, 7, length)
            assert [tuple(map(list, w)) for w in ours] == [tuple(map(list, w)) for w in theirs]
            assert sum(len(cont) for _, cont in ours) == n      # every token predicted once


@pytest.fixture(scope="module")
def ours(example):
    """rayeval's single-process scoring of the example, shared prefixes on or off: each
    computed once (read by two tests)."""
    done = {}

    def scored(share: bool = True):
        if share not in done:
            done[share] = reference(str(example / "sweep.yaml"), share)
        return done[share]
    return scored


@pytest.mark.parametrize("share", [True, False], ids=["shared", "unshared"])
def test_every_item_and_metric_equals_the_harness(example, checkpoints, harness, ours, share):
    ours = ours(share)
    for c in checkpoints:
        h = harness[c]
        mc_items, mc, _ = ours[c]["facts_mc"]
        for row_id, theirs in h["mc"]["samples"].items():
            lls = mc_items[row_id][:len(theirs["lls"]), 0].tolist()
            assert lls == pytest.approx(theirs["lls"], rel=REL, abs=1e-5)
        assert mc["acc"].value == h["mc"]["acc"]
        assert mc["acc_norm"].value == h["mc"]["acc_norm"]

        doc_items, docs, tokens = ours[c]["docs"]
        for row_id, ll in h["docs"]["samples"].items():
            assert float(doc_items[row_id][0]) == pytest.approx(ll, rel=REL)
        for m in ("word_perplexity", "byte_perplexity", "bits_per_byte"):
            assert docs[m].value == pytest.approx(h["docs"][m], rel=REL)
        assert tokens == sum(int(doc_items[i][1]) for i in doc_items) > 0
        assert docs["token_perplexity"].value == pytest.approx(
            math.exp(-sum(h["docs"]["samples"].values()) / tokens), rel=REL)

        gen_items, gen, _ = ours[c]["sums"]
        answers = dict(zip(*pq.read_table(example / "data" / "gen.parquet",
                                          columns=["id", "answer"]).to_pydict().values()))
        for row_id, text in h["gen"]["samples"].items():
            assert float(gen_items[row_id]) == float(text.strip() == answers[row_id].strip())
        assert gen["exact_match"].value == h["gen"]["exact_match"]
    # the checkpoints differ, so the comparison is not of two identical models
    first, last = checkpoints[0], checkpoints[-1]
    assert harness[first]["docs"]["word_perplexity"] != harness[last]["docs"]["word_perplexity"]


def test_progress_counts_items_as_they_are_scored(example):
    # A real 135M model once showed "67% of rows" for minutes: rows were counted when read,
    # while a text task holds up to group_rows items back to score them together.
    sweep = load_sweep(str(example / "sweep.yaml"))
    for _, ev, model, decode, p, metrics in single_process_passes(sweep):
        if ev.name != "facts_mc":
            continue
        seen = []
        p = Pass(model, metrics, ev.output_size, torch.device("cpu"), ev.spec.task,
                 ev.spec.bootstrap.k, ev.spec.dataset, text=p.text, batch=4,
                 on_rows=seen.append)
        for table in read_batches(ev.data, ev.spec.dataset, 7):
            p.update(*decode(table))
        assert seen == []              # all read, held back to be scored together: none yet
        p.finish()
        assert seen == sorted(seen) and seen[-1] == ev.data.num_rows
        assert len(set(seen)) > 5      # reported while the requests are scored, not at once
        return
    raise AssertionError("no facts_mc evaluation")


@pytest.fixture(scope="module")
def ray_stores(example, tmp_path_factory, standing):
    """The example on a real local Ray with 1 and 3 workers; the 1-worker run keeps no
    per-item records for docs (``evals[1].samples: false``) and shares prefixes
    (``model.share_prefixes: true``), the 3-worker run scores each request on its own."""
    root = tmp_path_factory.mktemp("ray_stores")
    sweep = yaml.safe_load(open(example / "sweep.yaml"))
    sweep["evals"][1]["samples"] = False
    sweep.setdefault("model", {})["share_prefixes"] = True
    one = example / "sweep_no_docs_samples.yaml"     # beside it: the same relative paths
    one.write_text(yaml.safe_dump(sweep))
    stores = {}
    with local_ray():       # one Ray start for both runs (rayeval.run is what `run` calls)
        for workers, sweep_path in ((1, one), (3, example / "sweep.yaml")):
            out = root / f"store{workers}"
            report = rayeval.run(str(sweep_path), workers=workers, output=str(out),
                                 standing=standing)
            assert report.outcomes and not report.failures, report.failures
            stores[workers] = out
    return stores


@pytest.mark.ray
def test_ray_runs_with_1_and_3_workers_equal_the_harness(checkpoints, harness, ray_stores):
    runs = {}
    for workers, out in ray_stores.items():
        rows = latest_rows(ResultStore(str(out)).read())
        assert len(rows) == len(checkpoints) * 7
        for r in rows:
            theirs = harness[r["checkpoint"]][EVALS[r["evaluation"]]]
            assert r["world_size"] == workers
            assert r["ci_low"] <= r["value"] <= r["ci_high"]
            if r["metric"] == "token_perplexity":
                assert r["num_tokens"] > 0
            elif r["metric"] in ("acc", "acc_norm", "exact_match"):
                assert r["value"] == theirs[r["metric"]]
            else:
                assert r["value"] == pytest.approx(theirs[r["metric"]], rel=REL)
        runs[workers] = {(r["checkpoint"], r["evaluation"], r["metric"]): r for r in rows}
    # The intervals do not depend on the world size: exactly for counts, to float rounding for
    # sums of log-likelihoods (the batches' padding differs).
    for key, r in runs[3].items():
        one = runs[1][key]
        for k in ("value", "ci_low", "ci_high"):
            if key[2] in ("acc", "acc_norm", "exact_match"):
                assert r[k] == one[k]
            else:
                assert r[k] == pytest.approx(one[k], rel=1e-6)


@pytest.mark.ray
def test_per_item_records_equal_the_harness_items(example, checkpoints, harness, ray_stores):
    import rayeval

    answers = dict(zip(*pq.read_table(example / "data" / "gen.parquet",
                                      columns=["id", "answer"]).to_pydict().values()))
    for workers, out in ray_stores.items():
        for c in checkpoints:
            h = harness[c]
            mc = rayeval.samples(out, checkpoint=c, evaluation="facts_mc").to_pylist()
            assert sorted(r["id"] for r in mc) == sorted(h["mc"]["samples"])   # each once
            for r in mc:
                theirs = h["mc"]["samples"][r["id"]]
                assert r["loglikelihoods"] == pytest.approx(theirs["lls"], rel=REL, abs=1e-5)
                assert (r["acc"], r["acc_norm"]) == (theirs["acc"], theirs["acc_norm"])
                assert r["target"] in r["choices"] and r["response"] in r["choices"]
            gen = rayeval.samples(out, checkpoint=c, evaluation="sums").to_pylist()
            assert sorted(r["id"] for r in gen) == sorted(h["gen"]["samples"])
            for r in gen:
                assert r["response"].strip() == h["gen"]["samples"][r["id"]]
                assert r["exact_match"] == float(r["response"].strip()
                                                 == answers[r["id"]].strip())
                assert r["target"] == answers[r["id"]]
            if workers == 1:           # samples: false for docs in this run
                with pytest.raises(rayeval.StoreError, match="stored no per-item records"):
                    rayeval.samples(out, checkpoint=c, evaluation="docs")
                continue
            docs = rayeval.samples(out, checkpoint=c, evaluation="docs").to_pylist()
            assert sorted(r["id"] for r in docs) == sorted(h["docs"]["samples"])
            for r in docs:
                assert r["loglikelihoods"][0] == pytest.approx(h["docs"]["samples"][r["id"]],
                                                               rel=REL)
            # the stored corpus figure is the items' total over their total tokens
            stored = {row["metric"]: row for row in latest_rows(ResultStore(str(out)).read())
                      if row["checkpoint"] == c and row["evaluation"] == "docs"}
            assert stored["token_perplexity"]["value"] == pytest.approx(math.exp(
                -sum(r["loglikelihoods"][0] for r in docs) / sum(r["tokens"] for r in docs)),
                rel=1e-9)
    # 3 workers wrote 3 files per cell (per segment of it: an evaluation's first cell is
    # scored in two, ``resume``), none gathered; 1 worker, one
    cells = list((ray_stores[3] / "samples").iterdir())
    assert len(cells) == len(checkpoints) * 3
    for cell in cells:
        sets = record_sets(cell)
        assert all(v == ["0/3", "1/3", "2/3"] for v in sets.values()), sets


@pytest.mark.ray
def test_samples_and_compare_items_on_the_command_line(checkpoints, harness, ray_stores):
    out = str(ray_stores[3])
    first, last = checkpoints[0], checkpoints[-1]
    proc = rayeval_main("samples", out, "--checkpoint", last, "--eval", "facts_mc",
                        "--format", "json")
    assert proc.returncode == 0, proc.stderr
    items = json.loads(proc.stdout)
    assert len(items) == len(harness[last]["mc"]["samples"])
    proc = rayeval_main("samples", out, "--checkpoint", last, "--eval", "facts_mc",
                        "--format", "csv", "--wrong")
    assert proc.returncode == 0, proc.stderr
    wrong = sorted(i for i, s in harness[last]["mc"]["samples"].items() if not s["acc"])
    assert sorted(int(line.split(",", 1)[0]) for line in proc.stdout.splitlines()[1:]) == wrong
    proc = rayeval_main("samples", out, "--checkpoint", last, "--eval", "sums")
    assert proc.returncode == 0 and f"{last} on sums: " in proc.stdout, proc.stderr

    # the items one checkpoint gets right and the other wrong, by the harness's own items
    proc = rayeval_main("compare", out, last, first, "--items", "--dataset", "facts_mc",
                        "--metric", "acc")
    assert proc.returncode == 0, proc.stderr
    a, b = harness[last]["mc"]["samples"], harness[first]["mc"]["samples"]
    a_only = sum(1 for i in a if a[i]["acc"] and not b[i]["acc"])
    b_only = sum(1 for i in a if b[i]["acc"] and not a[i]["acc"])
    assert f"facts_mc (acc, {len(a)} items)" in proc.stdout
    assert f"right in A, wrong in B: {a_only}" in proc.stdout
    assert f"right in B, wrong in A: {b_only}" in proc.stdout
    assert a_only + b_only > 0              # the checkpoints differ

    # bad input: one line, exit 2
    for args, says in ((("samples", out, "--checkpoint", last, "--eval", "nope"),
                        "no evaluation 'nope'"),
                       (("samples", out, "--checkpoint", last), "name the evaluation"),
                       (("compare", out, last, first, "--items", "--dataset", "docs"),
                        "no right-or-wrong metric"),
                       (("samples", out, "--checkpoint", "12345", "--eval", "docs"),
                        "no checkpoint '12345'")):
        proc = rayeval_main(*args)
        assert proc.returncode == 2 and says in proc.stderr, (args, proc.stderr)
        assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr


def test_a_factory_returning_a_transformers_model_scores_the_same(example, tmp_path, ours):
    """model.factory + model.tokenizer instead of the folders' config: the same numbers."""
    ex = _copy(example, tmp_path)
    first = sorted((ex / "ckpts").iterdir())[0]
    (ex / "hf_factory.py").write_text(
        "import transformers\n\n"
        "def gpt2(folder):\n"
        "    return transformers.AutoModelForCausalLM.from_config(\n"
        "        transformers.AutoConfig.from_pretrained(folder))\n")
    _edit_sweep(ex, lambda raw: raw.update(model={
        "factory": "hf_factory:gpt2", "kwargs": {"folder": str(first)},
        "tokenizer": str(first)}))
    by_factory = reference(str(ex / "sweep.yaml"))
    by_folder = ours()
    for (_, evals), (_, theirs) in zip(sorted(by_factory.items()), sorted(by_folder.items())):
        for name, (_, results, _) in evals.items():
            for metric, r in results.items():
                assert r.value == pytest.approx(theirs[name][1][metric].value, rel=1e-9)


# --- bad input: one line, before Ray, nothing written ---------------------------------------

def _copy(example, tmp_path):
    dst = tmp_path / "ex"
    shutil.copytree(example, dst, ignore=shutil.ignore_patterns("results"))
    return dst


def _fails(folder, *, sweep="sweep.yaml", env=None):
    """The one line of a run that fails before Ray; in this process (see rayeval_main), or as
    a subprocess when ``env`` (the whole environment) must differ."""
    if env is None:
        with ray_starts() as started:
            proc = rayeval_main("run", str(folder / sweep), cwd=str(folder))
        assert not started, "failed before Ray starts"
    else:
        proc = rayeval_cli("run", str(folder / sweep), cwd=str(folder), timeout=120, env=env)
    assert proc.returncode != 0
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert not (folder / "results").exists()
    return lines[0]


def _edit_sweep(folder, change):
    raw = yaml.safe_load((folder / "sweep.yaml").read_text())
    change(raw)
    (folder / "sweep.yaml").write_text(yaml.safe_dump(raw))


def _rewrite(path, column, values, typ=None):
    t = pq.read_table(path)
    i = t.schema.get_field_index(column)
    pq.write_table(t.set_column(i, column, pa.array(values, typ)), path)


def test_bad_text_input_is_one_line_before_ray(example, tmp_path):
    ex = _copy(example, tmp_path)
    first = sorted((ex / "ckpts").iterdir())[0]
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (first / name).exists():
            (first / name).unlink()
    line = _fails(ex)
    assert "no tokenizer files" in line and "model.tokenizer" in line

    cases = [
        ("mc.parquet", "prompt", lambda n: list(range(n)), None, "evals[0].dataset.prompt", "strings"),
        ("mc.parquet", "choices", lambda n: [[]] + [["a", "b"]] * (n - 1), pa.list_(pa.string()),
         "evals[0].dataset.choices: no choices", "id = 0"),
        ("mc.parquet", "label", lambda n: [0] * (n - 1) + [7], pa.int64(),
         "evals[0].dataset.target", "outside its"),
        ("gen.parquet", "answer", lambda n: list(range(n)), pa.int64(), "evals[2].dataset.target",
         "string answer"),
        ("docs.parquet", "text", lambda n: [None] + ["x"] * (n - 1), pa.string(),
         "evals[1].dataset.text: a null value", "id = 0"),
    ]
    for file, column, values, typ, where, what in cases:
        ex = _copy(example, tmp_path / column)
        path = ex / "data" / file
        _rewrite(path, column, values(pq.read_metadata(path).num_rows), typ)
        line = _fails(ex)
        assert where in line and what in line, line


def test_spec_errors_name_the_key(example, tmp_path):
    ex = _copy(example, tmp_path)
    _edit_sweep(ex, lambda raw: raw["evals"][1]["dataset"].pop("text"))
    assert "evals[1].dataset.text: missing required key" in _fails(ex)
    ex = _copy(example, tmp_path / "b")
    _edit_sweep(ex, lambda raw: raw["evals"][0].update(generation={"max_new_tokens": 3}))
    assert "evals[0].generation: only a generation task decodes" in _fails(ex)
    ex = _copy(example, tmp_path / "c")
    _edit_sweep(ex, lambda raw: raw.update(model={"factory": "models:build"}))
    assert "model.tokenizer" in _fails(ex)
    ex = _copy(example, tmp_path / "d")         # no model: key, and not a Hugging Face folder
    _edit_sweep(ex, lambda raw: raw.update(checkpoints=["data/mc.parquet"]))
    assert "not a Hugging Face folder (no config.json); set model.factory" in _fails(ex)


def test_without_transformers_one_line_names_the_extra(example, tmp_path):
    ex = _copy(example, tmp_path)
    blocker = tmp_path / "blocker" / "transformers"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('blocked for this test')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(blocker.parent)] + [p for p in sys.path if p]))
    assert "pip install 'rayeval[hf]'" in _fails(ex, env=env)


def test_a_generation_that_never_stops_ends_at_max_new_tokens(example, tmp_path):
    ex = _copy(example, tmp_path)
    _edit_sweep(ex, lambda raw: raw.update(evals=[dict(raw["evals"][2], generation={
        "until": ["never appears"], "max_new_tokens": 5})]))
    sweep = load_sweep(str(ex / "sweep.yaml"))
    plan = preflight.prepare(sweep, force=True)
    ev = plan.evaluations[0]
    source = ModelSource(sweep.model, sweep.base_dir)
    ref = plan.by_checkpoint()[-1][0]
    model, _ = source.loader(torch.device("cpu"), sweep.checkpoint).load(ref.location)
    tok = source.tokenizer(ref.location, model)
    decode = Decoder(ev.spec, ev.data, sweep.base_dir)
    decode.use(tok)
    x, _, _ = decode(next(read_batches(ev.data, ev.spec.dataset, 8)))
    p = Pass(model, [], ev.output_size, torch.device("cpu"), ev.spec.task, text=tok,
             generation=ev.spec.generation, batch=8)
    with torch.inference_mode():
        cached = p.backend.hf_generate(x.rows, p.context)
        plain = p.backend.greedy(x.rows, p.context)
    assert all(0 < len(t) <= 5 for t in cached)
    # the KV-cache path and the plain greedy loop pick the same tokens up to the end token
    eos = tok.eos_id
    trim = (lambda t: t[:t.index(eos)] if eos in t else t)
    assert [trim(t) for t in cached] == [trim(t) for t in plain]
