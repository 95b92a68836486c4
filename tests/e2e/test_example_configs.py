"""The offline examples of ``lm_eval:`` and ``lmms_eval:`` entries, run as their pages print them.

docs/language-models.md prints configs/lm_eval/ and docs/vision-language.md prints
configs/lmms_eval/: the sweep, every task YAML and ``utils.py``, each in a fenced block right
after a ``<!-- file: PATH -->`` line, and the commands that run them in the block after
``<!-- commands: ... -->``. Here:

- every printed file equals the file, and every file of an example's ``tasks/`` is printed
  (a page and its config cannot drift apart);
- the commands run as a user runs them (``rayeval`` in a subprocess, from the root of a
  temporary copy of the repository's examples) and exit 0;
- the language-model example's figures equal lm-eval 0.4.13's own ``simple_evaluate`` on the
  same checkpoints (configs/lm, as shipped), YAMLs and items: the multiple-choice members of the
  group, the group's aggregate and the few-shot generation task (both filters), per document too
  (context, generated text, acc); the figures the page prints and its example request are the
  run's;
- the vision-language example's figures and every document's generated text equal lmms-eval
  0.7.3's own command line (``--model huggingface``, batch size 1, tests/lmms_reference.py)
  on the same task. The page's build command (``python scripts/make_vlm_example.py``, minutes
  of training) is replaced by a smaller build of the same layout: the script's own
  ``write_items`` with 32 items, and the session's tiny untrained Idefics3 (``tiny_vlm``) as
  the one checkpoint (its generations differ document by document, so equal texts mean
  something).

Each run starts its own local Ray, as ``rayeval run`` does for a user; most of a sweep's time
is the worker group's start. Measured on the shared 2-core machine: the module 5.4 min at a load
falling from 9 to 2 (lm-eval example 87 s with its 3 references, lmms-eval example 228 s with
the tiny model's build and lmms-eval's run), 12 min under a load of 15-35.
"""

import contextlib
import os
import shutil
import subprocess
import sys

import pytest

from support import OFFLINE_ENV, commands, offline_env, printed, rayeval_cli, script

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TESTS = os.path.join(REPO, "tests")
LM_PAGE, VLM_PAGE = "language-models.md", "vision-language.md"
BUILD_VLM = ["python", "scripts/make_vlm_example.py"]     # the page's build line, as printed
VLM_ITEMS = 32

def run_commands(page: str, root, build=None) -> list[subprocess.CompletedProcess]:
    """Each of the page's commands, run in ``root`` as a user would: ``rayeval ...`` as a
    subprocess; the VLM build line through ``build`` (the test's smaller build)."""
    done = []
    for argv in commands(page):
        if argv == BUILD_VLM and build is not None:
            build()
            continue
        assert argv[0] == "rayeval", f"{page}: a command this test does not know: {argv}"
        proc = rayeval_cli(*argv[1:], cwd=str(root), timeout=600, env=offline_env())
        assert proc.returncode == 0, (argv, proc.stdout[-3000:], proc.stderr[-3000:])
        done.append(proc)
    return done


def copy_example(root, name: str) -> None:
    """configs/``name`` into root/configs/``name``, without a results folder a local run left."""
    shutil.copytree(os.path.join(REPO, "configs", name), root / "configs" / name,
                    ignore=shutil.ignore_patterns("results", "__pycache__"))


def store_rows(store) -> dict:
    from rayeval.io.store import ResultStore
    from rayeval.ranking import latest_rows

    return {(os.path.basename(r["checkpoint"]), r["evaluation"], r["metric"]): r
            for r in latest_rows(ResultStore(str(store)).read())}


def lm_key(metric: str) -> str:
    """lm-eval's and lmms-eval's key of a stored metric: "acc" is "acc,none"."""
    return metric if "," in metric else f"{metric},none"


# --- the pages print the files -----------------------------------------------------------------

@pytest.mark.parametrize("page,folder", [(LM_PAGE, "lm_eval"), (VLM_PAGE, "lmms_eval")])
def test_the_page_prints_every_file_of_its_example_as_it_is(page, folder):
    shown = dict(printed(page, "file"))
    for path, text in shown.items():
        with open(os.path.join(REPO, path), encoding="utf-8") as f:
            assert text == f.read(), f"docs/{page} prints {path} otherwise than the file holds"
    tasks = os.path.join(REPO, "configs", folder, "tasks")
    shipped = {f"configs/{folder}/sweep.yaml"} | {
        f"configs/{folder}/tasks/{name}" for name in os.listdir(tasks)
        if name.endswith((".yaml", ".py"))}
    assert set(shown) == shipped, f"docs/{page} prints {sorted(shown)}, the example has " \
                                  f"{sorted(shipped)}"
    assert any(argv[:2] == ["rayeval", "run"] and argv[2] == f"configs/{folder}/sweep.yaml"
               for argv in commands(page))


# --- configs/lm_eval against lm-eval ------------------------------------------------------------

LM_TASKS = {"sums_gen": "sums", "facts": "facts", "animals_mc": "facts/animals_mc",
            "sums_mc": "facts/sums_mc"}             # lm-eval's task or group -> the evaluation


@pytest.fixture(scope="module")
def lm_run(tmp_path_factory):
    pytest.importorskip("transformers")
    pytest.importorskip("lm_eval")
    root = tmp_path_factory.mktemp("lm_eval_example")
    shutil.copytree(os.path.join(REPO, "configs", "lm", "ckpts"), root / "configs" / "lm" / "ckpts")
    copy_example(root, "lm_eval")
    procs = run_commands(LM_PAGE, root)
    return root, procs


@pytest.fixture(scope="module")
def lm_reference(lm_run, one_torch_thread):
    """lm-eval's own run of the sweep's tasks on each checkpoint, from the same folder:
    {checkpoint name: {evaluation: {"metrics": {"acc,none": ...}, "samples": [...]}}}."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    root, _ = lm_run
    for key, value in OFFLINE_ENV.items():
        os.environ.setdefault(key, value)
    ckpts = root / "configs" / "lm" / "ckpts"
    out = {}
    with contextlib.chdir(root):                 # the tasks' data_files are relative to it
        for folder in sorted(ckpts.iterdir()):
            results = lm_eval.simple_evaluate(
                model="hf", model_args=f"pretrained={folder},dtype=float32",
                tasks=["sums_gen", "facts"], device="cpu", batch_size=8, log_samples=True,
                bootstrap_iters=0, task_manager=TaskManager(
                    include_path="configs/lm_eval/tasks", include_defaults=False))
            out[folder.name] = {
                LM_TASKS[task]: {"metrics": {k: v for k, v in res.items()
                                             if "," in k and "stderr" not in k},
                                 "samples": results["samples"].get(task, [])}
                for task, res in results["results"].items()}
    return out


@pytest.mark.ray
def test_the_lm_eval_example_equals_lm_eval(lm_run, lm_reference):
    root, (run, board) = lm_run
    rows = store_rows(root / "configs" / "lm_eval" / "results")
    assert sorted(lm_reference) == ["checkpoint-165", "checkpoint-30", "checkpoint-300"]
    compared = 0
    for checkpoint, theirs in lm_reference.items():
        assert sorted(theirs) == sorted(LM_TASKS.values())
        for evaluation, ref in theirs.items():
            mine = {m: r for (c, e, m), r in rows.items() if (c, e) == (checkpoint, evaluation)}
            assert sorted(lm_key(m) for m in mine) == sorted(ref["metrics"]), evaluation
            for metric, r in mine.items():
                # counts: equal exactly; the group's weighted mean to float rounding
                assert r["value"] == pytest.approx(ref["metrics"][lm_key(metric)], abs=1e-12), \
                    (checkpoint, evaluation, metric)
                assert r["world_size"] == 2
                compared += 1
    assert compared == 3 * (2 + 2 + 2 + 2)
    # not degenerate: the checkpoints differ, and something is answered right
    assert rows[("checkpoint-30", "facts", "acc")]["value"] < \
        rows[("checkpoint-300", "facts", "acc")]["value"]
    assert rows[("checkpoint-300", "sums", "exact_match,strict-match")]["value"] > 0
    assert "facts/animals_mc" in board.stdout            # the leaderboard's --members


@pytest.mark.ray
def test_the_lm_eval_example_records_equal_lm_evals_samples(lm_run, lm_reference):
    import rayeval

    root, _ = lm_run
    store = str(root / "configs" / "lm_eval" / "results")
    for checkpoint, theirs in lm_reference.items():
        for evaluation in ("sums", "facts/animals_mc", "facts/sums_mc"):
            samples = theirs[evaluation]["samples"]
            first = samples[0]["filter"]
            by_doc = {s["doc_id"]: s for s in samples if s["filter"] == first}
            records = rayeval.samples(store, checkpoint=checkpoint,
                                      evaluation=evaluation).to_pylist()
            assert len(records) == len(by_doc) and len(by_doc) in (30, 32)
            for r in records:
                s = by_doc[r["id"]]
                assert r["context"] == s["arguments"][0][0], (checkpoint, evaluation, r["id"])
                if evaluation == "sums":
                    assert r["response"] == s["filtered_resps"][0]
                    assert r["exact_match,strict-match"] == s["exact_match"]
                else:
                    assert r["acc"] == s["acc"] and r["acc_norm"] == s["acc_norm"]


@pytest.mark.ray
def test_the_lm_eval_page_prints_the_runs_figures_and_a_request(lm_run):
    """The figures table and the example request of docs/language-models.md are this run's."""
    import rayeval

    root, _ = lm_run
    store = root / "configs" / "lm_eval" / "results"
    rows = store_rows(store)
    [(_, table)] = printed(LM_PAGE, "figures")
    lines = [line for line in table.splitlines() if line.startswith("| checkpoint-")]
    assert len(lines) == 3
    columns = [("facts/animals_mc", "acc"), ("facts/animals_mc", "acc_norm"),
               ("facts/sums_mc", "acc"), ("facts/sums_mc", "acc_norm"),
               ("facts", "acc"), ("facts", "acc_norm")]
    for line in lines:
        cells = [c.strip() for c in line.strip("|").split("|")]
        checkpoint, values = cells[0], [float(v) for c in cells[1:4] for v in c.split(",")]
        for (evaluation, metric), value in zip(columns, values):
            assert value == round(rows[(checkpoint, evaluation, metric)]["value"], 4), \
                (checkpoint, evaluation, metric)
        for metric in ("exact_match,strict-match", "exact_match,flexible-extract"):
            assert float(cells[4]) == round(rows[(checkpoint, "sums", metric)]["value"], 4)
    [(_, request)] = printed(LM_PAGE, "request")
    contexts = rayeval.samples(str(store), checkpoint="checkpoint-300",
                               evaluation="sums").column("context").to_pylist()
    assert request.rstrip("\n") in contexts


# --- configs/lmms_eval against lmms-eval --------------------------------------------------------

@pytest.fixture(scope="module")
def lmms_run(tmp_path_factory, tiny_vlm):
    pytest.importorskip("lmms_eval")
    for key, value in OFFLINE_ENV.items():
        os.environ.setdefault(key, value)
    root = tmp_path_factory.mktemp("lmms_eval_example")
    copy_example(root, "lmms_eval")
    vlm = root / "configs" / "vlm"

    def build():
        """The layout scripts/make_vlm_example.py writes, smaller: 32 of its items, and one
        untrained checkpoint."""
        script("make_vlm_example").write_items(str(vlm), n=VLM_ITEMS)
        shutil.copytree(tiny_vlm, vlm / "ckpts" / "checkpoint-1")

    assert commands(VLM_PAGE)[0] == BUILD_VLM, "the page's first command builds the example"
    run_commands(VLM_PAGE, root, build)
    return root


@pytest.fixture(scope="module")
def lmms_reference(lmms_run):
    """lmms-eval's own command line on the example's task, from the same folder (batch 1)."""
    from lmms_reference import read_output

    root = lmms_run
    output = str(root / "lmms_reference")
    done = subprocess.run(
        [sys.executable, os.path.join(TESTS, "lmms_reference.py"), "--model", "huggingface",
         "--model_args", f"pretrained={root / 'configs/vlm/ckpts/checkpoint-1'},device_map=cpu",
         "--tasks", "easyvqa", "--include_path", str(root / "configs/lmms_eval/tasks"),
         "--batch_size", "1", "--device", "cpu", "--log_samples", "--output_path", output,
         "--verbosity", "WARNING"],
        cwd=str(root), env=offline_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return read_output(output, "easyvqa", filters=("none",))


@pytest.mark.ray
def test_the_lmms_eval_example_equals_lmms_eval(lmms_run, lmms_reference):
    import rayeval

    store = lmms_run / "configs" / "lmms_eval" / "results"
    rows = store_rows(store)
    assert sorted(m for (_, _, m) in rows) == ["exact_match", "valid_answer"]
    for (checkpoint, evaluation, metric), r in rows.items():
        assert (checkpoint, evaluation) == ("checkpoint-1", "easyvqa")
        assert r["num_samples"] == VLM_ITEMS and r["world_size"] == 2
        assert r["value"] == pytest.approx(lmms_reference["results"][lm_key(metric)], abs=1e-12)
    theirs = {s["doc_id"]: s for s in lmms_reference["samples"]["none"]}
    records = rayeval.samples(str(store), checkpoint="checkpoint-1",
                              evaluation="easyvqa").to_pylist()
    assert sorted(r["id"] for r in records) == list(range(VLM_ITEMS))       # each once
    for r in records:
        s = theirs[r["id"]]
        assert r["response"] == s["filtered_resps"], r["id"]                 # the generated text
        assert r["target"] == s["target"]
        for metric in ("exact_match", "valid_answer"):
            assert r[metric] == s[metric], (r["id"], metric)
    texts = {r["response"] for r in records}
    assert len(texts) > VLM_ITEMS // 2, "the texts differ: their equality means something"
