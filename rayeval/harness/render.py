"""Rendering lm-evaluation-harness tasks while planning: the driver's half.

An ``evals:`` entry with ``lm_eval: {task: T, ...}`` is rendered here, before Ray starts, with
lm-eval as a library for everything it defines: the task's documents (``process_docs``
included), few-shot sampling, templates, chat formatting and the requests (``Instance``
objects). Each task becomes a *request table* of plain columns, one row per document
(``requests.py``), kept in the result store under a digest of the table's content and the
task's configuration (``store.py``): the same task renders to the same place and is written
once. The table is an ordinary parquet data set to the rest of rayeval, so its documents are
split over the workers exactly once like any other rows; the worker's half (``task.py``)
tokenizes and scores the requests, applies the task's filters and calls its
``process_results``, with the task object the driver sends it through Ray.

Metrics keep lm-eval's names (``acc``; ``exact_match,strict`` where a task has more than one
filter, ``names.py``). lm-eval aggregations that are functions of sums (mean, perplexity,
weighted_perplexity, bits_per_byte) become exact sum states; any other (median, F1, BLEU, a
YAML's ``!function``) is the task's own function over every document's value
(``items.py``).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import json
import logging
import math
import os
import sys

import pyarrow as pa

from rayeval import compat
from rayeval.config.schema import LmEvalSpec
from rayeval.errors import SpecError
from rayeval.config import names
from rayeval.harness.groups import Group
from rayeval.harness.store import LIMITED_FROM
from rayeval.harness.requests import Rendered, encode, filter_names, layout, table_schema

# The request table's format: a new one renders to new folders, so a table an older rayeval
# wrote (with pickled requests) is never read.
TABLE_FORMAT = "requests-v2"
GENERATION_KEYS = {"until", "max_gen_toks", "do_sample", "temperature", "top_p", "num_beams",
                   "max_new_tokens"}


def _fail(path: str, problem: str):
    raise SpecError(f"{path}: {problem}")


def task_manager(spec: LmEvalSpec, path: str):
    """lm-eval's TaskManager: ``include_path``'s YAMLs alone when the task is among them
    (indexing lm-eval's own thousands of YAMLs takes seconds), else lm-eval's registry too."""
    try:
        from lm_eval.tasks import TaskManager
    except ImportError:
        _fail(path, "lm-evaluation-harness is not installed; pip install 'rayeval[lm-eval]'")
    if spec.include_path is not None:
        if not os.path.isdir(spec.include_path):
            _fail(f"{path}.include_path", f"no folder at {spec.include_path}; give a folder of "
                                          "task YAMLs (relative to the sweep file)")
        manager = TaskManager(include_path=spec.include_path, include_defaults=False)
        if spec.task in manager.all_tasks:
            return manager
        return TaskManager(include_path=spec.include_path)
    return TaskManager()


def build_failure(error: BaseException) -> str:
    """Why lm-eval (or lmms-eval) could not build a task, in one line: the error under a
    tenacity ``RetryError`` (lmms-eval retries its dataset loads; issue 56: it said
    "RetryError[<Future ...>]"), and for a missing file the folder a relative ``data_files``
    path is taken from (the one rayeval runs in, not the YAML's)."""
    last = getattr(error, "last_attempt", None)
    if last is not None and last.exception() is not None:
        error = last.exception()
    said = f"{type(error).__name__}: {(str(error).splitlines() or [''])[0][:300]}"
    if isinstance(error, FileNotFoundError):
        said += (f"; a relative path in the task's data_files is taken from the folder "
                 f"rayeval runs in ({os.getcwd()})")
    return said


def check_known(manager, task: str, path: str, tool: str, what: str) -> None:
    """One line, with the nearest name it knows, where ``tool``'s (lm-eval's or lmms-eval's)
    TaskManager knows no ``what`` (a task, or a task or group) of the name ``task``."""
    if task not in manager.all_tasks:
        from difflib import get_close_matches
        near = get_close_matches(task, manager.all_tasks, n=1)
        hint = f" (did you mean {near[0]!r}?)" if near else ""
        _fail(f"{path}.task", f"{tool} knows no {what} {task!r}{hint}; check the name or set "
                              "include_path to the folder of its YAML")


def load_tasks(spec: LmEvalSpec, path: str) -> tuple[dict, list[Group]]:
    """{task name: Task} with the overrides simple_evaluate applies, and the groups (the one
    asked for first)."""
    manager = task_manager(spec, path)
    check_known(manager, spec.task, path, "lm-eval", "task or group")
    try:
        loaded = manager.load([spec.task])
    except Exception as error:                        # lm-eval's own message says what
        _fail(f"{path}.task", f"lm-eval could not build {spec.task!r}: {build_failure(error)}")
    tasks = dict(loaded["tasks"])
    found = []
    for name, group in (loaded.get("groups") or {}).items():
        aggs = []
        for agg in getattr(group, "aggregate_metric_list", None) or []:
            if agg.aggregation != "mean":
                _fail(f"{path}.task", f"lm-eval group {name!r} aggregates {agg.metric} with "
                                      f"{agg.aggregation!r}; lm-eval itself supports mean only")
            aggs.append((agg.metric, list(agg.filter_list) if agg.filter_list else None,
                         bool(agg.weight_by_size)))
        found.append(Group(str(name), [t.task_name for t in group.get_all_tasks()], aggs))
    found.sort(key=lambda g: g.name != spec.task)
    for name, task in tasks.items():
        if task.get_config("output_type") == "generate_until" and spec.gen_kwargs:
            task.set_config(key="generation_kwargs", value=dict(spec.gen_kwargs), update=True)
        refused = refusal(task, name)
        if refused:
            _fail(f"{path}.{refused[0]}", refused[1])
        if spec.num_fewshot is not None:
            if task.get_config("num_fewshot") != 0:       # lm-eval keeps a task's explicit 0
                task.set_config(key="num_fewshot", value=spec.num_fewshot)
        elif task.get_config("num_fewshot") is None:
            task.set_config(key="num_fewshot", value=0)
        task.set_fewshot_seed(seed=spec.fewshot_seed)
    return tasks, found


def refusal(task, name: str) -> tuple[str, str] | None:
    """The first reason rayeval cannot run lm-eval task ``name`` as lm-eval does, from what
    the task object holds before its documents are loaded (its class, output type,
    generation_kwargs): (the entry's key at fault, the message), or None.
    A run applies it to every task it loads; ``rayeval tasks --check`` to every task of the
    registry (``coverage``), so the two never disagree. A task that samples runs on every
    backend (each document's repeats seeded by its id: ``core.backends.base.Sampler``)."""
    if getattr(task, "UNSAFE_CODE", False) or getattr(task, "MULTIMODAL", False):
        return "task", f"lm-eval task {name!r} runs code or needs images; rayeval scores " \
                       "text requests only"
    if task.get_config("output_type") == "generate_until":
        kwargs = dict(task.get_config("generation_kwargs") or {})
        unknown = sorted(set(kwargs) - GENERATION_KEYS)
        if unknown:
            return "gen_kwargs", f"lm-eval task {name!r} sets generation_kwargs {unknown} " \
                                 "that rayeval cannot honour; until, max_gen_toks, " \
                                 "do_sample, temperature, top_p, num_beams: 1 and " \
                                 "max_new_tokens equal to max_gen_toks apply"
        problem = _beams_and_budget(kwargs, name)
        if problem:
            return "gen_kwargs", problem
    return None


def _beams_and_budget(kwargs: dict, name: str) -> str | None:
    """lm-eval's Hugging Face model hands a task's other generation_kwargs to transformers'
    ``generate``: ``num_beams: 1`` is its greedy default (more is beam search, which rayeval
    does not run), and ``max_new_tokens`` replaces the token budget while the prompt is still
    cut to leave ``max_gen_toks`` (default 256) free; rayeval has one budget for both, so the
    two must agree."""
    beams = int(kwargs.get("num_beams", 1) or 1)
    if beams > 1:
        return f"lm-eval task {name!r} searches {beams} beams (num_beams), which rayeval " \
               "does not run; decode greedily: gen_kwargs: {num_beams: 1}"
    budget, kept = kwargs.get("max_new_tokens"), int(kwargs.get("max_gen_toks", 256))
    if budget is not None and int(budget) != kept:
        return f"lm-eval task {name!r} sets max_new_tokens {budget} beside max_gen_toks " \
               f"{kept}: lm-eval's Hugging Face model generates the first and cuts the " \
               "prompt for the second, and rayeval has one budget; give gen_kwargs: " \
               f"{{max_gen_toks: {budget}}}"
    return None


def limit_count(task, limit: float | None) -> int | None:
    """lm-eval's get_sample_size (lmms-eval's --limit is the same): a share below 1.0 of the
    documents, else a count. Where that leaves documents out, the task keeps how many it has
    (``store.LIMITED_FROM``), so that its cells are stored as n of N, not as the task."""
    if limit is None:
        return None
    n = len(task.eval_docs)
    count = int(math.ceil(n * limit)) if limit < 1.0 else int(limit)
    if count < n:
        setattr(task, LIMITED_FROM, n)
    return count


def chat_template(tokenizer):
    """What lm-eval's Hugging Face model passes as ``chat_template``: the tokenizer's own
    template applied to a chat history, as text."""
    import jinja2

    def apply(history: list[dict], add_generation_prompt: bool = True) -> str:
        kwargs = dict(tokenize=False, add_generation_prompt=add_generation_prompt,
                      continue_final_message=not add_generation_prompt)
        try:
            return tokenizer.apply_chat_template(history, **kwargs)
        except jinja2.exceptions.TemplateError:      # as lm-eval: again without the system turn
            return tokenizer.apply_chat_template(
                [m for m in history if m["role"] != "system"], **kwargs)
    return apply


@contextlib.contextmanager
def quiet():
    """lm-eval and the datasets library log and draw progress bars while a task is built;
    rayeval's own display is the run's, and its errors are one line."""
    import threading

    loggers = [logging.getLogger(n)
               for n in ("lm_eval", "lm-eval", "lmms_eval", "datasets", "filelock")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    # Off the main thread (a cached rendering rendered again while a run's display draws),
    # the streams are the display's: progress bars are turned off instead of swallowed.
    main = threading.current_thread() is threading.main_thread()
    bars = os.environ.get("TQDM_DISABLE")
    try:
        if main:
            with contextlib.redirect_stderr(io.StringIO()), \
                    contextlib.redirect_stdout(io.StringIO()):
                yield
        else:
            os.environ["TQDM_DISABLE"] = "1"
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)
        if not main:
            if bars is None:
                os.environ.pop("TQDM_DISABLE", None)
            else:
                os.environ["TQDM_DISABLE"] = bars


def render(spec: LmEvalSpec, path: str, tokenizer=None) -> tuple[list[Rendered], list[Group]]:
    """Every task ``spec`` names (a group: each member), rendered as its request table, and
    the groups (the one asked for first; none for a single task)."""
    with quiet():
        return _render(spec, path, tokenizer)


def _render(spec: LmEvalSpec, path: str, tokenizer):
    tasks, found = load_tasks(spec, path)
    if spec.apply_chat_template and tokenizer is None:
        _fail(f"{path}.apply_chat_template", "a chat template needs the model's tokenizer: set "
                                             "model.tokenizer, or give Hugging Face folders")
    if spec.apply_chat_template and not getattr(tokenizer, "chat_template", None):
        _fail(f"{path}.apply_chat_template", "the model's tokenizer has no chat template; drop "
                                             "apply_chat_template or use a chat model's tokenizer")
    out = []
    for name, task in tasks.items():
        out.append(_render_task(spec, path, name, task, tokenizer))
    return out, found


def _render_task(spec, path, name, task, tokenizer) -> Rendered:
    from importlib.metadata import version

    try:
        task.build_all_requests(
            limit=limit_count(task, spec.limit), rank=0, world_size=1,
            system_instruction=spec.system_instruction,
            apply_chat_template=spec.apply_chat_template,
            fewshot_as_multiturn=spec.fewshot_as_multiturn,
            chat_template=chat_template(tokenizer) if spec.apply_chat_template else None,
            tokenizer_name=getattr(tokenizer, "name_or_path", "") if spec.apply_chat_template
            else "")
    except SpecError:
        raise
    except Exception as error:
        _fail(f"{path}.task", f"lm-eval could not render the requests of {name!r}: "
                              f"{type(error).__name__}: {str(error).splitlines()[0][:300]}")
    output_type = task.OUTPUT_TYPE
    by_doc: dict[int, list] = {}
    for inst in task.instances:
        by_doc.setdefault(inst.doc_id, []).append(inst)
    rows = {"doc_id": [], "context": [], "target": [], "choices": [], "instances": []}
    for doc_id in sorted(by_doc):
        instances = sorted(by_doc[doc_id], key=lambda i: i.idx)
        doc = instances[0].doc
        rows["doc_id"].append(int(doc_id))
        first = instances[0].args[0]
        rows["context"].append(first if isinstance(first, str) else json.dumps(first))
        rows["target"].append(_text(task.doc_to_target(doc), task, doc, output_type))
        rows["choices"].append([str(c) for c in task.doc_to_choice(doc)]
                               if output_type == "multiple_choice" else None)
        rows["instances"].append(_encode(output_type, instances, path, name))
    table = pa.table(rows, schema=table_schema())
    until, max_gen_toks, sampling = _generation(task, by_doc, path, name)
    metrics = layout(task)
    filters = filter_names(task)
    lm_keys = {names.metric_key(m, f): names.result_key(m, f, len(filters))
               for f in filters for m in task.aggregation()}
    config = json.dumps(task.dump_config(), sort_keys=True, default=config_value)
    digest = hashlib.sha256()
    for part in (TABLE_FORMAT, version("lm_eval"), version("pyarrow"), config,
                 json.dumps([[i.args for i in by_doc[d]] for d in sorted(by_doc)], default=str),
                 json.dumps([i.doc for d in sorted(by_doc) for i in by_doc[d][:1]],
                            sort_keys=True, default=str)):
        digest.update(part.encode("utf-8"))
        digest.update(b"\0")
    compat.forget_instances(task)
    blob = pickle_task(task, spec)
    return Rendered(name, output_type, table, blob, metrics, until, max_gen_toks,
                    digest.hexdigest()[:24], lm_keys, sampling, lm=task)


def config_value(value) -> str:
    """A config value JSON does not know, the same in every process: a function (a YAML's
    ``!function``) by its name and its source (an edit is a new digest), never by its address
    (``str`` of one differs per process, which made each run render to a new folder)."""
    import inspect
    import re

    if callable(value) and hasattr(value, "__qualname__"):
        try:
            source = inspect.getsource(value)
        except (OSError, TypeError):
            source = ""
        code = hashlib.sha256(source.encode("utf-8")).hexdigest()[:16]
        return f"{getattr(value, '__module__', '')}.{value.__qualname__}:{code}"
    return re.sub(r" at 0x[0-9a-fA-F]+", "", str(value))


def _encode(kind: str, instances: list, path: str, name: str) -> str:
    try:
        return encode(kind, instances)
    except TypeError as e:
        _fail(f"{path}.task", f"lm-eval task {name!r} has requests that are not plain text "
                              f"({e}); rayeval scores text requests only")


def pickle_task(task, spec: LmEvalSpec) -> bytes:
    """The task, with the code of its YAMLs' ``!function`` modules (``utils.py`` beside them,
    which lm-eval imports under its file path, not a name a worker can import) pickled by
    value, so that a worker on any node can run them."""
    import cloudpickle

    local = []
    # a copy in one call: list(items()) failed with "dictionary changed size during
    # iteration" while another thread (Ray's, in a run on a standing group) imported
    for name, module in sys.modules.copy().items():
        where = getattr(module, "__file__", None) or ""
        if os.sep in name or (spec.include_path and where.startswith(spec.include_path)):
            local.append(module)
    for module in local:
        cloudpickle.register_pickle_by_value(module)
    try:
        out = io.BytesIO()
        _task_pickler()(out).dump(task)
        return out.getvalue()
    finally:
        for module in local:
            cloudpickle.unregister_pickle_by_value(module)


@functools.lru_cache(maxsize=None)
def _task_pickler():
    import cloudpickle

    class TaskPickler(cloudpickle.Pickler):
        """cloudpickle's, with an API client a task module made at import (an ``openai``
        client: its connection pool holds locks, which do not pickle) sent as the arguments
        that make it again on the worker (whose requests go to the served judge:
        ``lmms.judge_server.redirected``)."""

        def reducer_override(self, obj):
            made = _api_client(obj)
            return made if made is not None else super().reducer_override(obj)

    return TaskPickler


def _api_client(obj):
    """How to make an ``openai`` client again (its class and its key, base URL and, for
    Azure, API version), or None for anything else."""
    openai = sys.modules.get("openai")
    clients = tuple(getattr(openai, n, None) for n in ("OpenAI", "AsyncOpenAI"))
    if openai is None or None in clients or not isinstance(obj, clients):
        return None
    kwargs = {"api_key": obj.api_key, "base_url": str(obj.base_url)}
    if getattr(obj, "_api_version", None):
        kwargs["api_version"] = obj._api_version
    return _make_client, (type(obj), kwargs)


def _make_client(cls, kwargs: dict):
    return cls(**kwargs)


def _text(target, task, doc, output_type) -> str:
    """The target as text: a multiple-choice index names its choice."""
    if output_type == "multiple_choice" and isinstance(target, int):
        choices = task.doc_to_choice(doc)
        if 0 <= target < len(choices):
            return str(choices[target])
    return json.dumps(target) if isinstance(target, (list, dict)) else str(target)


def _generation(task, by_doc, path, name) -> tuple[tuple[str, ...], int, tuple]:
    """A generate_until task's stop strings, token budget (lm-eval's HF defaults: 256
    tokens) and sampling: (temperature, top_p, repeats), temperature 0 when greedy (lm-eval's
    HF model samples when do_sample is true, at temperature 1 unless one is given). Whether
    the backend can sample is the loader's to say."""
    if task.OUTPUT_TYPE != "generate_until":
        return (), 0, (0.0, 1.0, 1)
    kinds = {json.dumps(i.args[1], sort_keys=True, default=str)
             for insts in by_doc.values() for i in insts}
    if len(kinds) != 1:
        _fail(f"{path}.task", f"lm-eval task {name!r} asks for different generation_kwargs per "
                              "document; rayeval decodes one way per task")
    first = next(iter(by_doc.values()))[0]
    kwargs = dict(first.args[1])
    sampling = sampling_of(kwargs, first.repeats)
    until = kwargs.get("until") or []
    until = [until] if isinstance(until, str) else list(until)
    return tuple(until), int(kwargs.get("max_gen_toks", 256)), sampling


def sampling_of(kwargs: dict, repeats) -> tuple[float, float, int]:
    """(temperature, top_p, repeats) of lm-eval generation_kwargs; temperature 0 when greedy
    (lm-eval's HF model samples when do_sample is true, at temperature 1 unless one is given)."""
    temperature = float(kwargs.get("temperature", 0.0) or 0.0)
    if kwargs.get("do_sample") and temperature == 0:
        temperature = 1.0
    elif kwargs.get("do_sample") is False:
        temperature = 0.0
    return (temperature, float(kwargs.get("top_p", 1.0) or 1.0),
            max(1, int(repeats or 1)) if temperature > 0 else 1)

