"""Judged evaluations (docs/judges.md) against a plain transformers loop, on a real local Ray.

tests/judge_support.py builds the data set, two tiny checkpoints and a hand-built judge whose
verdicts vary with the response ("yes", "no" or no verdict at all). The loop generates each
item's answer on its own, renders the same template with jinja2, applies the judge
tokenizer's chat template, decodes the judge greedily and reads the verdict with its own
regular expression. rayeval's figures (exact_match, judge, judge_failed), every item's record
(response, judge prompt, judge text, score or failure) and the intervals must equal it, for 2
and 3 workers with batch sizes 1 and 16; an edited judge prompt is then judged again, by 1
worker with batch size 16, from the generations the 3-worker run kept, without loading the
evaluated checkpoints, and a pairwise judge against the first checkpoint from the 2-worker
run's; a worker killed as the judge stage begins is survived (five Ray runs in all, ~3
minutes on the 2-core machine).
"""

from __future__ import annotations

import math
import os
import shutil

import pytest

pytest.importorskip("transformers")

import judge_support  # noqa: E402
from support import local_ray  # noqa: E402

import rayeval  # noqa: E402
from rayeval.io.store import ResultStore, latest_rows  # noqa: E402

# the plain loops run on one torch thread (tests/conftest.py): 2.3 s instead of 17 s beside Ray
pytestmark = [pytest.mark.ray, pytest.mark.usefixtures("one_torch_thread")]
RUNS = ((2, 1), (3, 16))        # (workers, batch size)
EDITED = judge_support.PROMPT.replace("Answer:", "Their answer:")
PAIRWISE = "Question: {{ question }}\nA: {{ response_a }}\nB: {{ response_b }}"


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return judge_support.build(str(tmp_path_factory.mktemp("judged")), items=40)


@pytest.fixture(scope="module")
def loop(built):
    return judge_support.plain_loop(built)


@pytest.fixture(scope="module")
def runs(built, standing):
    """The three runs, and the edited prompt judged again on the 3-worker run's store."""
    reports = {}
    with local_ray():
        for workers, batch in RUNS:
            path = judge_support.sweep(built, workers=workers, batch_size=batch,
                                       name=f"sweep{workers}.yaml", output=f"out{workers}")
            reports[workers] = rayeval.run(path, standing=standing)
        # the 3-worker run's store, copied: its generations serve the edited judge
        shutil.copytree(os.path.join(built["folder"], "out3"),
                        os.path.join(built["folder"], "edited"))
        edited = judge_support.sweep(built, workers=1, batch_size=16, prompt=EDITED,
                                     name="edited.yaml", output="edited")
        reports["edited"] = rayeval.run(edited, standing=standing)
        # pairwise against the first checkpoint, from the 2-worker run's generations
        shutil.copytree(os.path.join(built["folder"], "out2"),
                        os.path.join(built["folder"], "pairwise"))
        pairwise = judge_support.sweep(built, workers=2, batch_size=3, prompt=PAIRWISE,
                                       name="pairwise.yaml", output="pairwise",
                                       baseline=built["checkpoints"][0])
        reports["pairwise"] = rayeval.run(pairwise, standing=standing)
        # a worker killed as the judge stage begins: the restarted group judges the
        # generations its first attempt kept
        killed = judge_support.sweep(built, workers=2, batch_size=16, name="killed.yaml",
                                     output="killed")
        os.environ["RAYEVAL_TEST_KILL"] = "judge:1:1"
        try:
            reports["killed"] = rayeval.run(killed)      # its own fit: restarted
        finally:
            del os.environ["RAYEVAL_TEST_KILL"]
    return reports


def _rows(built, store: str) -> dict:
    rows = latest_rows(ResultStore(os.path.join(built["folder"], store)).read())
    return {(r["checkpoint"], r["metric"]): r for r in rows}


def _records(built, store: str, row: dict) -> dict:
    table = ResultStore(os.path.join(built["folder"], store)).read_samples(row["cell"],
                                                                            row["samples"])
    return {r["id"]: r for r in table.to_pylist()}


def test_figures_and_records_equal_the_plain_loop_on_any_workers_and_batch(built, loop, runs):
    kinds = set()
    for workers, _ in RUNS:
        report = runs[workers]
        assert not report.failures, report.failures
        rows = _rows(built, f"out{workers}")
        for ckpt, items in loop.items():
            scores = [s for _, _, _, s in items.values()]
            given = [s for s in scores if s is not None]
            kinds |= {"fail" if s is None else s for s in scores}
            judge, failed = rows[(ckpt, "judge")], rows[(ckpt, "judge_failed")]
            assert judge["value"] == pytest.approx(sum(given) / len(given), abs=1e-12)
            assert failed["value"] == scores.count(None)
            assert failed["higher_is_better"] is False
            hits = [float(r.strip() == str(i % 7)) for i, (r, _, _, _) in items.items()]
            assert rows[(ckpt, "exact_match")]["value"] == pytest.approx(
                sum(hits) / len(hits))
            assert judge["ci_low"] <= judge["value"] <= judge["ci_high"]
            records = _records(built, f"out{workers}", judge)
            assert sorted(records) == sorted(items)
            for ident, (response, prompt, said, score) in items.items():
                rec = records[ident]
                assert rec["response"] == response
                assert rec["judge_prompt"] == prompt
                assert rec["judge_output"] == said
                assert rec["judge"] == score
                assert (rec["judge_failed"] is None) == (score is not None)
                assert rec["exact_match"] == float(response.strip() == str(ident % 7))
    # the judge's verdicts vary: yes, no and unreadable all occur
    assert kinds == {0.0, 1.0, "fail"}, kinds


def test_intervals_do_not_depend_on_workers_or_batch_size(built, runs):
    stores = [_rows(built, f"out{w}") for w, _ in RUNS]
    for key, row in stores[0].items():
        for other in stores[1:]:
            assert other[key]["value"] == row["value"] or (
                math.isnan(row["value"]) and math.isnan(other[key]["value"]))
            assert other[key]["ci_low"] == row["ci_low"]
            assert other[key]["ci_high"] == row["ci_high"]
            assert other[key]["replicates"] == row["replicates"]


def test_an_edited_prompt_is_judged_again_from_the_stored_generations(built, runs):
    report = runs["edited"]
    assert not report.failures, report.failures
    # both cells pending (a new judge key), both judged from the generations out3 kept:
    # no checkpoint loaded (the outcome's layout says "judge", not the checkpoint's layout)
    assert len(report.outcomes) == 2 and not report.plan.cached
    assert all(c.generated for c in report.plan.cells)
    assert {o.layout for o in report.outcomes} == {"judge"}
    edited = judge_support.plain_loop(built, prompt=EDITED)
    rows = _rows(built, "edited")
    for ckpt, items in edited.items():
        records = _records(built, "edited", rows[(ckpt, "judge")])
        for ident, (response, prompt, said, score) in items.items():
            assert records[ident]["judge_prompt"] == prompt
            assert "Their answer:" in prompt
            assert records[ident]["judge_output"] == said
            assert records[ident]["judge"] == score
        given = [s for _, _, _, s in items.values() if s is not None]
        assert rows[(ckpt, "judge")]["value"] == pytest.approx(sum(given) / len(given))
        # the generation's figure is the one the first judge's run stored
        assert rows[(ckpt, "exact_match")]["value"] == \
            _rows(built, "out2")[(ckpt, "exact_match")]["value"]
        assert rows[(ckpt, "judge")]["world_size"] == 1


def test_samples_show_what_the_judge_said(built, loop, runs):
    from support import rayeval_main

    store = os.path.join(built["folder"], "out2")
    ckpt = built["checkpoints"][0]
    items = loop[ckpt]
    failed = next(i for i, v in items.items() if v[3] is None)
    proc = rayeval_main("samples", store, "--checkpoint", ckpt, "--format", "json")
    assert proc.returncode == 0, proc.stderr
    records = {r["id"]: r for r in __import__("json").loads(proc.stdout)}
    assert records[failed]["judge"] is None
    assert records[failed]["judge_failed"] == "no verdict in the judge's text"
    assert records[failed]["judge_output"] == items[failed][2]
    proc = rayeval_main("samples", store, "--checkpoint", ckpt)
    assert proc.returncode == 0, proc.stderr
    assert "judge_output" in proc.stdout and "judge_failed" in proc.stdout
    assert "judge_prompt" not in proc.stdout           # long: json, csv and html only
    proc = rayeval_main("samples", store, "--checkpoint", ckpt, "--format", "html")
    assert proc.returncode == 0, proc.stderr
    assert "failed: no verdict in the judge&#x27;s text" in proc.stdout
    assert "<summary>judge prompt</summary>" in proc.stdout


def test_a_pairwise_judge_equals_the_loop_in_both_orders(built, runs):
    report = runs["pairwise"]
    assert not report.failures, report.failures
    assert {o.layout for o in report.outcomes} == {"judge"}      # from stored generations
    base = built["checkpoints"][0]
    loop = judge_support.pairwise_loop(built, base, PAIRWISE)
    rows = _rows(built, "pairwise")
    for ckpt, items in loop.items():
        records = _records(built, "pairwise", rows[(ckpt, "judge")])
        for ident, (score, first, second) in items.items():
            assert records[ident]["judge"] == score
            assert records[ident]["judge_output"] == first
            assert records[ident]["judge_output_swapped"] == second
        given = [s for s, _, _ in items.values() if s is not None]
        rate = sum(given) / len(given)
        assert rows[(ckpt, "judge")]["value"] == pytest.approx(rate, abs=1e-12)
        assert rows[(ckpt, "judge_failed")]["value"] == len(items) - len(given)
        strength = rows[(ckpt, "judge_bt")]["value"]
        if 0 < rate < 1:
            assert strength == pytest.approx(400 * math.log10(rate / (1 - rate)))
    # the baseline against itself: every item a draw once both orders are counted
    assert rows[(base, "judge")]["value"] == 0.5 and rows[(base, "judge_bt")]["value"] == 0
    assert rows[(built["checkpoints"][1], "judge")]["value"] != 0.5


def test_a_worker_lost_while_judging_is_survived_without_generating_again(built, runs):
    report = runs["killed"]
    # the cells' own errors (a CellOutcome's repr cuts them off): it failed once in three full
    # runs of the suite, with attempt 1 and no error text to read
    assert not report.failures, [(o.attempt, o.error) for o in report.failures]
    assert {o.attempt for o in report.outcomes} == {2}          # the restarted group's
    # it judged what the first attempt generated, loading no checkpoint again
    assert {o.layout for o in report.outcomes} == {"judge"}
    assert [o.step for o in report.outcomes] == [100, 200]      # kept with the generations
    rows, plain = _rows(built, "killed"), _rows(built, "out2")
    for key, row in plain.items():
        assert rows[key]["value"] == row["value"] or math.isnan(row["value"])
        assert rows[key]["replicates"] == row["replicates"]


def test_a_verdict_rule_that_never_matches_is_a_warning_naming_it(built, loop, runs, standing):
    """The judge says " yes", " no" or " maybe"; a verdict of {sure, nope} never matches. The
    run still succeeds (exit 0: every item was judged), but says, after its board, how many
    verdicts could not be read, the rule, and one judge text (tests/unit/test_judge_rules.py:
    none when at most half are unread)."""
    from rich.console import Console

    from rayeval.plan.loader import load_sweep
    from rayeval.reporting.samples import judge_warnings
    from rayeval.ui import cli

    shutil.copytree(os.path.join(built["folder"], "out2"), os.path.join(built["folder"], "never"))
    path = judge_support.sweep(built, workers=2, batch_size=16, name="never.yaml",
                               output="never", verdict={"sure": 1, "nope": 0})
    out, err = Console(record=True, width=200), Console(record=True, width=400)
    with local_ray():
        code = cli.dispatch(cli.parse(["run", path]), out, err, standing=standing)
    said = err.export_text()
    assert code == 0, said
    lines = [line for line in said.splitlines() if line.startswith("warning:")]
    items = sum(len(v) for v in loop.values())
    assert len(lines) == 1 and lines[0].startswith(
        f"warning: nq: the judge's verdict could not be read in "
        f"{items} of {items} items"), said
    assert "the first of the words 'sure', 'nope' (any case, whole word)" in lines[0]
    text = lines[0].split("one judge text: ", 1)[1].rsplit(" (docs/judges.md", 1)[0]
    assert text.strip("'") in {s for v in loop.values() for _, _, s, _ in v.values()}
    # the runs with the matching rule: this judge says " maybe" (no verdict) to most items,
    # so they are warned of too, with the count their stored judge_failed holds
    normal = load_sweep(judge_support.sweep(built, workers=2, batch_size=1, name="sweep2.yaml",
                                            output="out2"))
    rows = latest_rows(ResultStore(normal.output).read())
    unread = int(sum(r["value"] for r in rows if r["metric"] == "judge_failed"))
    # a count, stored without a resampled interval
    assert all(r["ci_low"] is None and r["ci_high"] is None
               for r in rows if r["metric"] == "judge_failed")
    (line,) = judge_warnings(normal, rows, normal.output)
    assert f"could not be read in {unread} of {items} items" in line and \
        "the first of the words 'yes', 'no'" in line


# --- the shipped example: configs/judge as docs/judges.md prints it ------------------------------

def test_the_judged_example_runs_as_its_page_prints_it(tmp_path, standing):
    """docs/judges.md prints configs/judge/sweep.yaml as the file holds it, and its commands
    run from a copy of the examples as printed (the run handed to the session's standing
    group, as a service takes it; the build line is the script that made the shipped judge,
    ~1 minute of training, not run again here). The board's judge and judge_failed equal a
    plain transformers loop's on the same checkpoints, items and judge, and ``rayeval
    samples`` shows each item's judge text."""
    import yaml

    from support import REPO_ROOT, commands, printed, rayeval_main

    page, sweep = "judges.md", "configs/judge/sweep.yaml"
    shown = dict(printed(page, "file"))
    with open(os.path.join(REPO_ROOT, sweep), encoding="utf-8") as f:
        assert shown == {sweep: f.read()}
    argvs = commands(page)
    assert argvs[0] == ["python", "scripts/make_judge_example.py"]
    assert [a[:2] for a in argvs[1:]] == [["rayeval", "run"], ["rayeval", "samples"]]
    for part in ("lm/ckpts", "lm/data", "judge"):
        shutil.copytree(os.path.join(REPO_ROOT, "configs", part), tmp_path / "configs" / part,
                        ignore=shutil.ignore_patterns("results"))
    done = [rayeval_main(*argv[1:], cwd=str(tmp_path), standing=standing) for argv in argvs[1:]]
    for proc in done:
        assert proc.returncode == 0, (proc.args, proc.stdout[-2000:], proc.stderr[-2000:])
    board = done[0].stdout
    assert "judge_failed" in board and "exact_match" in board, board

    with open(tmp_path / sweep) as f:
        raw = yaml.safe_load(f)
    judge = raw["evals"][0]["judge"]
    ckpts = sorted(str(p) for p in (tmp_path / "configs" / "lm" / "ckpts").iterdir())
    paths = {"data": str(tmp_path / "configs" / "lm" / "data" / "gen.parquet"),
             "checkpoints": ckpts,
             "judge": str(tmp_path / "configs" / "judge" / judge["model"])}
    want = judge_support.plain_loop(paths, judge["prompt"], judge["verdict"],
                                    judge["max_new_tokens"],
                                    raw["evals"][0]["generation"]["max_new_tokens"])
    rows = {(os.path.basename(r["checkpoint"]), r["metric"]): r for r in
            latest_rows(ResultStore(str(tmp_path / "configs" / "judge" / "results")).read())}
    scored = 0
    for ckpt, items in want.items():
        name = os.path.basename(ckpt)
        given = [s for *_, s in items.values() if s is not None]
        assert rows[(name, "judge")]["value"] == pytest.approx(sum(given) / len(given),
                                                               abs=1e-12)
        assert rows[(name, "judge_failed")]["value"] == len(items) - len(given)
        scored += len(given)
    assert scored > 0
    said = {text for items in want.values() for *_, text, _ in items.values()}
    assert any(text.strip() and text.strip() in done[1].stdout for text in said), \
        done[1].stdout[-2000:]
