"""The sweep file's rules between fields: what no single field's declaration can say.

A value's own rules (its type, bounds, choices, form) are declared on its field in
``config.schema`` and checked by ``config.reader``; what is left here relates one field to
another (kwargs need a factory, a tensor-parallel engine needs vLLM) or to the registries of
tasks (which keys a task needs). Each rule fails with one line naming the key path and the fix.
"""

from __future__ import annotations

from rayeval.config.entries import kinds
from rayeval.config.reader import Reader, field_of, show
from rayeval.config.schema import EvalSpec, Generation, ModelSpec, Sweep, WatchSpec
from rayeval.core.backends import BACKENDS
from rayeval.core.tasks import TASKS
from rayeval.errors import SpecError
from rayeval.ranking.rules import sweep_headline


def evaluation_name(r: Reader, name: str, path: str) -> None:
    if "/" in name or name == "aggregate":
        r.fail(path, f"{name!r} cannot name an evaluation ('/' separates the evaluation from "
                     "the metric, 'aggregate' is the suite's mean); choose another name")


def unique_name(r: Reader, name: str, path: str, seen: dict[str, int], index: int) -> None:
    if name in seen:
        r.fail(path, f"{name!r} is used twice (also evals[{seen[name]}].name); give each "
                     "evaluation its own name")
    seen[name] = index


def one_form(r: Reader, top: dict, single_form_keys: set[str]) -> None:
    """The evaluations come as ``evals:`` or as one top-level dataset/task/metrics."""
    if "evals" in top:
        both = sorted(k for k in single_form_keys if k in top)
        if both:
            r.fail(both[0], "give the evaluations either as evals: or as one top-level "
                            "dataset/task/metrics, not both; move it into an entry of evals")
        return
    for kind in kinds():                   # lm_eval, lmms_eval: the slices' entry kinds
        if top.get(kind) is not None:
            r.fail(kind, f"give an {kinds().get(kind).library} task as an entry of evals: "
                         f"(evals: [{{name: N, {kind}: {{task: T}}}}])")
    missing = [k for k in ("dataset", "task", "metrics") if top.get(k) is None]
    if missing:
        r.fail(missing[0], "missing required key (or list the evaluations under evals:)")


def evals_list(r: Reader, raw) -> None:
    if not isinstance(raw, list) or not raw:
        r.fail("evals", f"expected a non-empty list of evaluations, got {show(raw)}")


def entry_kind(m: dict) -> str | None:
    """The kind of rendered entry ``m`` is (``lm_eval``, ``lmms_eval``: a key of the slices'
    entry kinds, ``config.entries``), or None for an evaluation given in full."""
    return next((kind for kind in kinds() if m.get(kind) is not None), None)


def rendered_entry(r: Reader, m: dict, path: str, kind: str) -> None:
    """A rendered entry (``lm_eval:``, ``lmms_eval:``) takes its data, metrics and decoding from
    its library (lm-eval, lmms-eval)."""
    library = kinds().get(kind).library
    for key in ("task", "dataset", "metrics", "generation", *kinds()):
        if key != kind and m.get(key) is not None:
            r.fail(f"{path}.{key}", f"an {kind} entry takes its data, metrics and decoding "
                                    f"from {library}; remove the key")


def task_name(r: Reader, task: str, path: str) -> None:
    if task in kinds():                    # a rendered entry's task is named for its kind
        r.fail(path, f"an {kinds().get(task).title} task is given as {task}: {{task: NAME}} "
                     "(without task, dataset and metrics)")
    if task not in TASKS:
        r.fail(path, f"unknown task {task!r}; choose one of: {', '.join(TASKS)}")


def dataset_required(task: str, m: dict) -> set[str]:
    """The dataset keys a task needs: its target, and its inputs unless a transform makes
    them."""
    needs = set()
    if TASKS[task].needs_target:
        needs.add("target")
    if m.get("transform") is None and TASKS[task].needs_inputs:
        needs.add("inputs")
    return needs


def dataset(r: Reader, spec, task: str, path: str) -> None:
    if len(set(spec.inputs)) != len(spec.inputs):
        r.fail(f"{path}.inputs", f"a column is listed twice in {list(spec.inputs)}")
    problem = TASKS[task].spec_problem(spec)
    if spec.images is not None and not getattr(TASKS[task], "takes_images", False):
        problem = ("images", f"task {task} takes no images column (generation and "
                             "multiple_choice do)")
    if problem:
        r.fail(f"{path}.{problem[0]}", problem[1])


def generation_allowed(r: Reader, task: str, path: str) -> None:
    if not TASKS[task].generates:
        r.fail(path, f"only a generation task decodes; task {task} takes no generation: key")


def generation(r: Reader, g: Generation, path: str) -> None:
    if g.repeats > 1 and g.temperature == 0:
        r.fail(f"{path}.repeats", f"{g.repeats} greedy generations are {g.repeats} copies of "
                                  "one; set generation.temperature above 0 to sample them")


def samples(r: Reader, given: bool, task: str, path: str) -> None:
    if given and not TASKS[task].keeps_records:
        r.fail(path, f"task {task} keeps no per-item records (the text tasks and "
                     "classification do); remove the key")


def model(r: Reader, spec: ModelSpec) -> None:
    if spec.backend not in BACKENDS:          # the built-ins and any plugin's, by name
        r.fail("model.backend", BACKENDS.unknown(spec.backend))
    if spec.factory is None and spec.kwargs:
        r.fail("model.kwargs", "kwargs are for model.factory; a Hugging Face folder's model "
                               "comes from its config.json (or set model.factory)")
    if spec.vllm and spec.backend != "vllm":
        r.fail("model.vllm", "engine arguments are for model.backend: vllm; set it, or "
                             "remove model.vllm")
    if spec.backend == "vllm" and spec.factory is not None:
        r.fail("model.backend", "vllm serves Hugging Face checkpoint folders (config.json); "
                                "remove model.factory, or use backend: hf")


def settings(r: Reader, given: dict) -> None:
    """The sweep's own settings against each other: GPUs, and how workers split a model."""
    resources = dict(given["resources_per_worker"])
    if given["use_gpu"] and resources.get("GPU", 1) == 0:
        r.fail("resources_per_worker", "GPU: 0 with use_gpu: true; give each worker a GPU")
    workers, p = given["workers"], given["parallelism"]
    if workers % p.shard:
        r.fail("parallelism.shard", f"{p.shard} does not divide workers: {workers}; make "
                                    "workers a multiple of parallelism.shard (each replica "
                                    "of the model takes shard workers)")
    if p.tensor > 1 and p.shard > 1:
        r.fail("parallelism.tensor", "a vLLM engine shards its own weights; give "
                                     "parallelism.tensor or parallelism.shard, not both")
    if workers % p.tensor:
        r.fail("parallelism.tensor", f"{p.tensor} does not divide workers: {workers}; make "
                                     "workers a multiple of parallelism.tensor (each engine "
                                     "takes tensor workers)")


def watch(r: Reader, spec: WatchSpec, prefix: str) -> None:
    """A ready marker is a file name, or a pattern with one * for the checkpoint's name."""
    ready = spec.ready
    if ready is not None and (not ready.strip() or "/" in ready or ready.count("*") > 1):
        r.wrong(field_of(WatchSpec, "ready"), ready, f"{prefix}ready", "")


def tokenizer(r: Reader, spec: ModelSpec, evals: tuple[EvalSpec, ...]) -> None:
    text = [e for e in evals if TASKS[e.task].uses_text]
    if text and not spec.hugging_face and spec.tokenizer is None:
        r.fail("model.tokenizer", f"task {text[0].task} ({text[0].key_path}) needs a tokenizer:"
                                  " set model.tokenizer to a folder holding one, or drop "
                                  "model.factory to read Hugging Face folders")


def backend_fits(r: Reader, sweep: Sweep) -> None:
    """What only vLLM does: tensor-parallel engines; and its engine arguments, checked
    against the installed vLLM's own (before Ray starts)."""
    vllm = sweep.model.backend == "vllm"
    if sweep.parallelism.tensor > 1 and not vllm:
        r.fail("parallelism.tensor", "tensor-parallel engines are vLLM's: set model.backend: "
                                     "vllm, or remove parallelism.tensor")
    if vllm:
        from rayeval import compat
        from rayeval.io import vllm_preflight

        compat.check("vllm")        # a vLLM its hooks were not written for: that line first
        problem = vllm_preflight.check_arguments(sweep.model.vllm)
        if problem:
            r.fail(*problem)


RACE_BUCKETS = 64     # fewer bootstrap buckets than this leave too few rounds to race


def select(r: Reader, sweep: Sweep) -> None:
    """``select.metric`` names an evaluation of the suite and one of its metrics that is a
    mean of bounded per-item values; rounds are taken over its bootstrap buckets."""
    spec = sweep.select
    if spec is None:
        return
    judged = [e for e in sweep.evals if e.judge is not None]
    if judged:
        r.fail(f"{judged[0].key_path}.judge", "a race cannot judge: racing scores rounds of "
                                              "items and a judge grades after every "
                                              "generation; remove select: or the judge")
    from rayeval.core.metrics import build

    for e in sweep.evals:
        own = [m.key or m.name for m in e.metrics if getattr(build(m), "from_items", False)]
        if own:
            r.fail("select", f"{e.name}/{own[0]} aggregates with its task's own function "
                             "over every item's value, which a race's rounds do not keep; "
                             "remove select: or race a sweep without that evaluation")
    names = [e.name for e in sweep.evals]
    if spec.suite:
        chosen = [(e, None) for e in sweep.suite_evaluations()]
        if len(chosen) < 2:
            r.fail("select.metric", "aggregate averages two evaluations or more, and the suite "
                                    "has one: name the evaluation instead")
        if sweep.groups:
            r.fail("select.metric", "racing the aggregate of a suite with lm-eval groups is "
                                    "not supported: race one evaluation (GROUP/TASK)")
    else:
        target = spec.target(names)
        if target is None:
            r.fail("select.metric", f"{spec.metric!r} names no evaluation of the suite "
                                    f"({', '.join(names)}); write EVALUATION, "
                                    "EVALUATION/METRIC or aggregate")
        chosen = [target]
    for name, metric in chosen:
        _raceable(r, sweep.evaluation(name), metric)


def _raceable(r: Reader, ev, metric: str | None) -> None:
    name = ev.name
    keys = [m.key or m.name for m in ev.metrics]
    key = metric or sweep_headline(keys)
    if key not in keys:
        r.fail("select.metric", f"{name} has no metric {key!r} ({', '.join(keys)})")
    from rayeval.core.metrics import build

    built = build(next(m for m in ev.metrics if (m.key or m.name) == key))
    if built.race_bounds(key) is None:
        what = f"{name}/{key}" + (" (its first metric, which the aggregate averages)"
                                  if metric is None else "")
        r.fail("select.metric", f"{what} is not a mean of bounded per-item values and "
                                "cannot be raced (accuracy, acc, acc_norm and exact_match can)")
    if ev.bootstrap.k < RACE_BUCKETS:
        where = "bootstrap" if ev.key_path.startswith("(") else f"{ev.key_path}.bootstrap"
        r.fail(where, f"racing takes its rounds from the bootstrap's row buckets, and {name} "
                      f"has {ev.bootstrap.k}: keep the bootstrap on with at least "
                      f"{RACE_BUCKETS} buckets")


def judge(r: Reader, spec, task: str, path: str, listed: bool, gen: Generation,
          metrics_path: str) -> None:
    """A ``judge:`` section: on a task that generates, listed in the metrics, a usable
    verdict and a template that parses."""
    from rayeval.core import judge as judging
    from rayeval.core.tasks import TASKS

    if not getattr(TASKS[task], "generates", False):
        r.fail(path, f"task {task} does not generate; a judge grades the answers of a "
                     "generation evaluation")
    if not listed:
        r.fail(metrics_path, "a judge: section is given but the metrics do not list 'judge'; "
                             "add it (metrics: [..., judge])")
    for key in ("prompt", "verdict"):
        if getattr(spec, key) is None:
            r.fail(f"{path}.{key}", "missing required key: a judge of a generation evaluation "
                                    "needs a prompt and a verdict (docs/judges.md)")
    problem = judging.verdict_problem(spec.verdict)
    if problem:
        r.fail(f"{path}.verdict", problem)
    if spec.baseline is not None and spec.pattern is None:
        outside = [w for w, v in spec.verdict.items() if not 0 <= v <= 1]
        if outside:
            r.fail(f"{path}.verdict", f"a pairwise verdict's score says how much the first "
                                      f"answer wins, from 0 to 1; {outside[0]!r} has "
                                      f"{spec.verdict[outside[0]]}")
    if gen.repeats != 1:
        r.fail(f"{path}", f"a judge grades one answer per item; generation.repeats is "
                          f"{gen.repeats}: set it to 1")
    try:
        judging.Prompts(spec.prompt, f"{path}.prompt")
    except SpecError as e:
        r.fail(f"{path}.prompt", e.message.split(": ", 1)[1])
