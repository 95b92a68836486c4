"""Rendering lmms-eval tasks while planning: the driver's half.

An ``evals:`` entry with ``lmms_eval: {task: T, ...}`` is rendered here, before Ray starts,
with lmms-eval as a library for everything it defines: the documents (``process_docs``
included), ``doc_to_visual``, ``doc_to_text`` or ``doc_to_messages`` with the task's
``lmms_eval_specific_kwargs`` for ``model_name``, the target, the generation kwargs. The task
is loaded as lmms-eval loads it for a chat model (``ConfigurableMessagesTask``), and each
document's chat is the one lmms-eval's generic ``huggingface`` model would template: the
messages in Hugging Face form, each image a placeholder, the images themselves PNG-encoded in
prompt order (``requests.py``). The table goes to the result store under a digest of its
content and the task's configuration (``harness.store``: written once, checked before a run
reads it); the task object travels to the workers through Ray.

A group (or a tag) is rendered as its tasks, each its own request table, and its groups
(``harness.groups.Group``): what each group's aggregate averages is what lmms-eval 0.7.3's
``consolidate_group_results`` averages (``_aggregates``), and the plan stores it as an lm-eval
group's aggregate is stored (``plan.groups``).

A ``multiple_choice`` task is rendered from the requests lmms-eval builds for its models'
``loglikelihood`` (``choice_rows``: the context, each choice's continuation, the images) and
scored as lmms-eval's ``llava_hf`` scores them (``lmms.task``).

What is refused, and why, is ``rules.py``'s (one line naming the task, before any document
is loaded).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
from dataclasses import dataclass, field

import pyarrow as pa

from rayeval import compat
from rayeval.config.schema import LmmsEvalSpec
from rayeval.errors import SpecError, reason
from rayeval.config import names
from rayeval.harness.groups import Group
from rayeval.harness.render import (build_failure, check_known, config_value, limit_count,
                                    pickle_task, quiet)
from rayeval.lmms.requests import (context_of, encode_messages, filter_names, layout,
                                   table_schema)
from rayeval.lmms.rules import check_task, generation_problem
from rayeval.lmms.scoring import repeats_of

TABLE_FORMAT = "lmms-requests-v1"
INSTALL = ("rayeval install lmms-eval (pip install 'rayeval[lmms-eval]' && pip install "
           "--no-deps lmms-eval==0.7.3)")
# lmms-eval's huggingface chat model: max_new_tokens 4096 unless the task says otherwise;
# it stops at the end-of-sequence token and ignores ``until``.
DEFAULT_MAX_NEW_TOKENS = 4096
@dataclass
class Rendered:
    """One lmms-eval task, rendered: the request table and what scoring it needs (the
    attributes ``harness.store`` reads: table, digest, blob, lm)."""
    task: str
    table: pa.Table
    blob: bytes               # the task, pickled (sent through Ray, never stored)
    metrics: list             # [(key, metric name, column, higher_is_better)]
    max_new_tokens: int
    digest: str
    lm_keys: dict             # lmms-eval's "metric,filter" -> the metric's key here
    lm: object = None         # the task itself, in the process that rendered it
    output_type: str = "generate_until"
    judged: str | None = None     # where it asks lmms-eval's judge (None: it asks none)
    # how it samples ({"temperature", "top_p", "repeats"}: Generation's fields; {}: greedy, once)
    decoding: dict = field(default_factory=dict)


def _fail(path: str, problem: str):
    raise SpecError(f"{path}: {problem}")


def task_manager(spec: LmmsEvalSpec, path: str):
    """lmms-eval's TaskManager for ``spec.model_name``: ``include_path``'s YAMLs alone when
    the task is among them (indexing lmms-eval's own hundreds of folders takes seconds)."""
    try:
        from lmms_eval.tasks import TaskManager
    except ImportError as e:
        _fail(path, f"lmms-eval is not installed or cannot be imported ({e}); {INSTALL}")
    if spec.include_path is not None:
        if not os.path.isdir(spec.include_path):
            _fail(f"{path}.include_path", f"no folder at {spec.include_path}; give a folder of "
                                          "task YAMLs (relative to the sweep file)")
        manager = TaskManager("ERROR", include_path=spec.include_path, include_defaults=False,
                              model_name=spec.model_name)
        if spec.task in manager.all_tasks:
            return manager
        return TaskManager("ERROR", include_path=spec.include_path, model_name=spec.model_name)
    return TaskManager("ERROR", model_name=spec.model_name)


@contextlib.contextmanager
def _silent():
    """lmms-eval logs through loguru (not ``logging``) while a task is built; rayeval's
    display is the run's, and its errors are one line."""
    try:
        from loguru import logger
    except ImportError:
        logger = None
    if logger is not None:
        logger.disable("lmms_eval")
    try:
        with quiet():
            yield
    finally:
        if logger is not None:
            logger.enable("lmms_eval")


def load_tasks(spec: LmmsEvalSpec, path: str) -> tuple[dict, list[tuple]]:
    """{task name: the task lmms-eval builds for a chat model (a ``multiple_choice`` one: for a
    simple model, ``_simple``), with the sweep's generation overrides}, and the groups, the one asked for first: [(name, leaf tasks in lmms-eval's
    order, aggregate_metric_list as lmms-eval's group config has it, or None)]. A task alone
    has no groups; a tag has tasks and no groups (lmms-eval aggregates no tag)."""
    manager = task_manager(spec, path)
    check_known(manager, spec.task, path, "lmms-eval", "task")
    try:
        loaded = manager.load_task_or_group([spec.task], task_type="chat")
    except Exception as error:                        # lmms-eval's own message says what
        _fail(f"{path}.task", f"lmms-eval could not build {spec.task!r}: "
                              f"{build_failure(error)}")
    tasks: dict = {}
    groups: list[tuple] = []

    def walk(tree: dict) -> list[str]:               # the leaves under ``tree``, in order
        leaves = []
        for key, value in tree.items():
            if isinstance(value, dict):
                under = walk(value)
                leaves.extend(under)
                name = getattr(key, "group_name", None)
                if name is not None:                   # a ConfigurableGroup (a tag: no key)
                    groups.append((str(name), list(dict.fromkeys(under)),
                                   key.config.get("aggregate_metric_list")))
            else:
                tasks.setdefault(str(key), value)
                leaves.append(str(key))
        return leaves

    walk(loaded)
    for name, task in tasks.items():
        if task.OUTPUT_TYPE == "multiple_choice":
            tasks[name] = _simple(manager, name, path)
    groups.sort(key=lambda g: g[0] != spec.task)
    for task in tasks.values():
        if spec.gen_kwargs:
            task.set_config(key="generation_kwargs", value=dict(spec.gen_kwargs), update=True)
    return tasks, groups


def _simple(manager, name: str, path: str):
    """Task ``name`` as lmms-eval builds it for a simple model (``--force_simple``): its chat
    form builds generation requests only, so lmms-eval runs a ``multiple_choice`` task on a
    simple model's ``loglikelihood`` (``llava_hf``'s)."""
    try:
        loaded = manager.load_task_or_group([name], task_type="simple")
    except Exception as error:
        _fail(f"{path}.task", f"lmms-eval could not build {name!r}: {build_failure(error)}")
    return next(v for k, v in loaded.items() if str(k) == name)


def render(spec: LmmsEvalSpec, path: str, judge: bool = False
           ) -> tuple[list[Rendered], list[Group]]:
    """Every task ``spec`` names (a group or tag: each of its tasks), rendered as its request
    table, and the groups that aggregate (the one asked for first; none for a task).
    ``judge``: the entry serves its tasks a judge (each Rendered says whether it asks one).
    The tasks' modules are imported as lmms-eval's run with ``API_TYPE=local`` imports them:
    a judge a module makes at import is a ``local`` provider (plain data, which a worker
    routes to its served judge); an API client a module makes gets a key that opens nothing
    (a worker sends its requests to the served judge: ``judge_server.redirected``)."""
    from rayeval.lmms import judge_server

    with _silent(), judge_server.rendering():
        tasks, found = load_tasks(spec, path)
        judged = {name: check_task(task, name, path, judge) for name, task in tasks.items()}
        out = [_render_task(spec, path, name, task) for name, task in tasks.items()]
    for rendered in out:
        rendered.judged = judged[rendered.task]
    by_task = {t.task: t for t in out}
    return out, [Group(name, leaves, _aggregates(name, leaves, aggs, by_task, path))
                 for name, leaves, aggs in found if aggs]


def _aggregates(group: str, leaves: list[str], configs: list, by_task: dict,
                path: str) -> list[tuple]:
    """What lmms-eval 0.7.3's ``consolidate_group_results`` aggregates for a group, as
    ``Group.aggregates`` ([(metric, filters, weight_by_size)], which ``group_metrics`` turns
    into the pairs the plan averages). lmms-eval differs from lm-eval here: it takes every
    ``metric,filter`` key of the leaf tasks that contains an aggregate_metric_list entry's
    ``metric`` (a substring test; the entry's filter_list is not applied), the last such entry
    saying whether to weight by size, and averages each key over the leaves that have it."""
    for c in configs:
        if c.get("aggregation", "mean") != "mean":
            _fail(f"{path}.task", f"lmms-eval group {group!r} aggregates {c.get('metric')} with "
                                  f"{c.get('aggregation')!r}; rayeval aggregates groups by mean")
    chosen: dict[tuple, list[str]] = {}              # (metric, weight_by_size) -> its filters
    for key in dict.fromkeys(k for t in leaves if t in by_task for k in by_task[t].lm_keys):
        match = [c for c in configs
                 if c.get("metric") and c["metric"] in key and c.get("filter_list")]
        if match:
            metric, filter_name = names.split_key(key)
            chosen.setdefault((metric, bool(match[-1].get("weight_by_size"))),
                              []).append(filter_name)
    return [(metric, filters, weight) for (metric, weight), filters in chosen.items()]


def _render_task(spec, path, name, task) -> Rendered:
    from importlib.metadata import version

    try:
        task.build_all_requests(limit=limit_count(task, spec.limit), rank=0, world_size=1)
    except Exception as error:
        _fail(f"{path}.task", f"lmms-eval could not render the requests of {name!r}: "
                              f"{reason(error, typed=True)}")
    instances = sorted(task.instances, key=lambda i: (i.doc_id, i.idx))
    choices = task.OUTPUT_TYPE == "multiple_choice"
    rows = choice_rows(task, instances, name, path) if choices else \
        chat_rows(task, instances, name, path)
    digest = hashlib.sha256()
    for i in range(len(rows["doc_id"])):
        for part in (rows["messages"][i], rows["target"][i], *rows["images"][i],
                     *(rows["choices"][i] if choices else ())):
            digest.update(part if isinstance(part, bytes) else part.encode("utf-8"))
            digest.update(b"\0")
    table = pa.table(rows, schema=table_schema(choices))
    max_new_tokens, decoding = (0, {}) if choices else _generation(task, instances, path, name)
    metrics = layout(task)
    filters = filter_names(task)
    lm_keys = {names.metric_key(m, f): names.result_key(m, f, len(filters))
               for f in filters for m in task.aggregation()}
    config = json.dumps(_config(task), sort_keys=True, default=config_value)
    for part in (TABLE_FORMAT, version("lmms_eval"), version("pyarrow"), config,
                 spec.model_name, str(max_new_tokens), json.dumps(decoding, sort_keys=True)):
        digest.update(part.encode("utf-8"))
        digest.update(b"\0")
    compat.forget_instances(task)
    blob = pickle_task(task, spec)
    return Rendered(name, table, blob, metrics, max_new_tokens, digest.hexdigest()[:24],
                    lm_keys, lm=task, output_type=task.OUTPUT_TYPE, decoding=decoding)


def chat_rows(task, instances, name: str, path: str) -> dict:
    """A ``generate_until`` task's rows: each document's chat (``doc_to_messages``) and its
    images."""
    rows = {"doc_id": [], "messages": [], "images": [], "context": [], "target": []}
    for inst in instances:
        ctx, doc_to_messages, gen_kwargs, doc_id, _, split = inst.args
        doc = task.dataset[split][doc_id]
        messages, images = chat_of(doc_to_messages(doc), name, doc_id, path)
        rows["doc_id"].append(int(doc_id))
        rows["messages"].append(encode_messages(messages))
        rows["images"].append(images)
        rows["context"].append(context_of(messages))
        rows["target"].append(_text(task.doc_to_target(doc)))
    return rows


def choice_rows(task, instances, name: str, path: str) -> dict:
    """A ``multiple_choice`` task's rows, from the requests lmms-eval builds for its models'
    ``loglikelihood``: one per choice, (context, delimiter + choice, doc_to_visual, ...). A
    document's row holds the context, its continuations in the requests' order and the images
    ``doc_to_visual`` gives (flattened, as lmms-eval's ``llava_hf`` flattens them; a task
    without ``doc_to_visual``, a text task, has none). ``messages`` is the one user turn of
    the images and the context, for the record; the worker renders what ``llava_hf`` renders
    (``lmms.task``)."""
    rows = {"doc_id": [], "messages": [], "images": [], "context": [], "target": [],
            "choices": []}
    for inst in instances:
        ctx, continuation, doc_to_visual, doc_id, _, split = inst.args
        if rows["doc_id"] and rows["doc_id"][-1] == int(doc_id):
            rows["choices"][-1].append(continuation)
            continue
        doc = task.dataset[split][doc_id]
        visuals = doc_to_visual(doc) if callable(doc_to_visual) else None
        visuals = [] if visuals is None else \
            list(visuals) if isinstance(visuals, (list, tuple)) else [visuals]
        images = [png_bytes(v, name, doc_id, path) for v in visuals]
        content = [{"type": "image"} for _ in images] + [{"type": "text", "text": ctx}]
        rows["doc_id"].append(int(doc_id))
        rows["messages"].append(encode_messages([{"role": "user", "content": content}]))
        rows["images"].append(images)
        rows["context"].append(ctx)
        rows["target"].append(_text(task.doc_to_target(doc)))
        rows["choices"].append([continuation])
    return rows


def _config(task) -> dict:
    """The task's configuration as lmms-eval's ``dump_config`` gives it (its fields that are
    set), with its functions kept as functions, which ``config_value`` names by their source.
    ``dump_config`` writes ``str(fn)``, an address that differs in every process: the digest
    differed from run to run, so a re-run rendered to a new request table and found none of
    its cells in the store."""
    from dataclasses import asdict

    return {k: v for k, v in asdict(task.config).items() if v is not None}


def chat_of(messages: list[dict], name: str, doc_id: int, path: str) -> tuple[list, list]:
    """lmms-eval's chat for one document, as its huggingface model templates it
    (``ChatMessages.to_hf_messages``), with each image a placeholder, and the images as PNG
    bytes in prompt order; a video or audio part is a one-line error."""
    from lmms_eval.protocol import ChatMessages

    try:
        chat = ChatMessages(messages=messages)
    except Exception as error:
        _fail(f"{path}.task", f"lmms-eval task {name!r}: document {doc_id}'s messages are not "
                              f"a chat ({reason(error, typed=True)})")
    out, images = [], []
    for message in chat.to_hf_messages():
        content = []
        for part in message["content"]:
            kind = part.get("type")
            if kind == "text":
                content.append({"type": "text", "text": part["text"]})
            elif kind == "image":
                images.append(png_bytes(part["image"], name, doc_id, path))
                content.append({"type": "image"})
            else:
                _fail(f"{path}.task", f"lmms-eval task {name!r} gives document {doc_id} a "
                                      f"{kind} input; rayeval evaluates images and text "
                                      "(video and audio are not supported)")
        out.append({"role": message["role"], "content": content})
    return out, images


def png_bytes(image, name: str, doc_id: int, path: str) -> bytes:
    """An image ``doc_to_visual`` gave (a PIL image, or a path to one) as PNG bytes."""
    from PIL import Image

    try:
        if isinstance(image, str):
            with Image.open(image) as opened:
                image = opened.copy()
        buf = io.BytesIO()
        image.save(buf, format="PNG")
    except Exception as error:
        _fail(f"{path}.task", f"lmms-eval task {name!r}: document {doc_id}'s image cannot be "
                              f"encoded ({type(error).__name__}: {error})")
    return buf.getvalue()


def _text(target) -> str:
    return json.dumps(target) if isinstance(target, (list, dict)) else str(target)


def _generation(task, instances, path, name) -> tuple[int, dict]:
    """The task's token budget and how it samples, as lmms-eval's huggingface model decodes:
    greedily, or sampled when the temperature is above 0 (at ``top_p``, 1 unless given), each
    document the task's ``repeats`` times. A draw is rayeval's own, seeded per
    document and repeat (``generation.seed``): the same on any worker and in any batch."""
    kinds = {json.dumps(i.args[2], sort_keys=True, default=str) for i in instances}
    if len(kinds) != 1:
        _fail(f"{path}.task", f"lmms-eval task {name!r} asks for different generation_kwargs "
                              "per document; rayeval decodes one way per task")
    kwargs = dict(instances[0].args[2] or {})
    problem = generation_problem(kwargs, name)
    if problem:                 # a document's own kwargs, where the task sets them per item
        _fail(f"{path}.gen_kwargs", problem)
    decoding = {}
    temperature = float(kwargs.get("temperature", 0) or 0)
    if temperature > 0:
        decoding.update(temperature=temperature, top_p=float(kwargs.get("top_p") or 1.0),
                        repeats=repeats_of(task))
    return int(kwargs.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)), decoding

