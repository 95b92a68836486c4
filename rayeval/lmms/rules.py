"""Which lmms-eval tasks rayeval runs as lmms-eval does, read from the task object before its
documents are loaded: the rules a run applies to every task it renders (``render.py``) and
``rayeval tasks --check`` to every task of the registry (``harness.coverage``), so the two never
disagree.

What is refused, in one line naming the task: an output type other than ``generate_until``
and ``multiple_choice``, a choice task asking mutual information or several contexts, a video
or audio in a document, a task judged by an API model whose entry gives no ``judge`` (with
one, the workers serve it to the task, whether the task asks lmms-eval's ``llm_judge`` or
posts with an API client of its own: ``judge_server``), beam search.
"""

from __future__ import annotations

import inspect
import os
import re
import sys

from rayeval.errors import SpecError

# What a task module that asks lmms-eval for its judge contains: such a task is judged by the
# ``local`` provider's requests when the entry gives ``judge: {model: ...}`` (judge_server).
SERVED_MARKS = ("lmms_eval.llm_judge", "lmms_eval.verifiers")
# What a task module that calls an API itself contains (an API client, its key): its
# chat-completions requests go to the served judge too (``judge_server.redirected``).
API_MARKS = ("import openai", "from openai", "OPENAI_API_KEY", "gpt_eval_model_name")


def check_task(task, name: str, path: str, judge: bool = False) -> str | None:
    """``refusal``'s reason as a one-line error at the entry's key; else where the task asks
    lmms-eval's judge (served when the entry has a ``judge``), or None."""
    refused, route = verdict(task, name, judge)
    if refused:
        raise SpecError(f"{path}.{refused[0]}: {refused[1]}")
    return route


def refusal(task, name: str, judge: bool = False) -> tuple[str, str] | None:
    """The first reason rayeval cannot run lmms-eval task ``name`` as lmms-eval does, from
    what the task object holds before its documents are loaded (output type, judge,
    generation_kwargs, aggregations): (the entry's key at fault, the message), or None. A run
    applies it to every task it loads and ``rayeval tasks --check`` to every task of the
    registry (``harness.coverage``), so the two never disagree. ``judge``: the entry serves
    a judge (``judge: {model: ...}``)."""
    return verdict(task, name, judge)[0]


def verdict(task, name: str, judge: bool = False) -> tuple[tuple[str, str] | None, str | None]:
    """(``refusal``'s answer, ``judge_route``'s), the task's sources read once."""
    kind = task.OUTPUT_TYPE
    if kind not in ("generate_until", "multiple_choice"):
        return ("task", f"lmms-eval task {name!r} has output_type {kind!r}; rayeval "
                        "evaluates generate_until and multiple_choice tasks"), None
    problem = _choice_problem(task, name) if kind == "multiple_choice" else None
    if problem:
        return ("task", problem), None
    media = _media(task)
    if media:
        return ("task", f"lmms-eval task {name!r} gives its model {media}; rayeval "
                        "evaluates images and text (video and audio are not supported)"), None
    found = judge_route(task)
    return _refused(task, name, judge, found), found


def _choice_problem(task, name: str) -> str | None:
    """Why a ``multiple_choice`` task cannot be scored as lmms-eval's ``llava_hf`` scores it
    (``choice_rows``), or None: mutual information asks log-likelihoods of choices without
    their context, and several contexts per document put the choices in the prompt."""
    if "acc_mutual_info" in (getattr(task, "_metric_fn_list", None) or {}):
        return f"lmms-eval task {name!r} asks acc_mutual_info (each choice's likelihood " \
               "without its context); rayeval scores choices after their context only"
    if getattr(task, "multiple_input", False):
        return f"lmms-eval task {name!r} puts its choices in the context (several contexts " \
               "per document); rayeval scores one context per document"
    return None


def _refused(task, name: str, judge: bool, found) -> tuple[str, str] | None:
    if found is not None and not judge:
        return "task", f"lmms-eval task {name!r} is judged by an API model ({found}); " \
                       "rayeval does not call API judges: give the entry judge: " \
                       "{model: FOLDER}, a local model rayeval serves it (docs/lmms-judges.md)"
    kwargs = dict(task.get_config("generation_kwargs") or {})
    problem = generation_problem(kwargs, name)
    if problem:
        return "gen_kwargs", problem
    return None


# What a task's document functions read when they give the model video or audio (measured on
# lmms-eval 0.7.3's registry: every video and audio task that the other rules accepted, 71 of
# them, and no image task).
VIDEO_MARKS = re.compile(r"video|\.mp4|decord|VideoReader|frames", re.IGNORECASE)
AUDIO_MARKS = re.compile(r"audio|librosa|soundfile|\.wav", re.IGNORECASE)


def _media(task) -> str | None:
    """Video or audio, where the task's documents give its model that (its dataset_kwargs
    say video, or the source of its doc_to_visual, doc_to_messages or doc_to_audio reads it),
    said with where it was seen; None for images and text."""
    if (task.get_config("dataset_kwargs") or {}).get("video"):
        return "video (dataset_kwargs.video)"
    for key in ("doc_to_visual", "doc_to_messages", "doc_to_audio"):
        try:
            source = inspect.getsource(task.get_config(key))
        except (TypeError, OSError, AttributeError):
            continue
        for what, marks in (("video", VIDEO_MARKS), ("audio", AUDIO_MARKS)):
            found = marks.search(source)
            if found:
                return f"{what} ({key} reads {found.group(0)!r})"
    return None


def judge_route(task) -> str | None:
    """Where a task calls a judge, through lmms-eval's ``llm_judge`` or with an API client of
    its own (a served judge answers both): its functions' modules asking ``llm_judge``, else
    its config's judge model, else a module importing an API client; None when it calls none."""
    marks = {}
    for key in ("process_results", "doc_to_target", "doc_to_visual", "doc_to_messages"):
        for where in _sources(task.get_config(key)):
            # lmms-eval imports a YAML's utils.py by file (not into sys.modules): read it.
            try:
                with open(where, encoding="utf-8") as f:
                    source = f.read()
            except (OSError, TypeError):
                continue
            for mark in SERVED_MARKS + API_MARKS:
                if mark in source:
                    marks.setdefault(mark, f"{key} in {os.path.basename(where)} uses {mark}")
    served = [marks[m] for m in SERVED_MARKS if m in marks]
    if served:
        return served[0]
    metadata = task.get_config("metadata")
    if isinstance(metadata, dict) and "gpt_eval_model_name" in metadata:
        return f"metadata.gpt_eval_model_name {metadata['gpt_eval_model_name']!r}"
    api = [marks[m] for m in API_MARKS if m in marks]
    return api[0] if api else None


def _sources(fn) -> list[str]:
    """The file of a task's function, and the files of what its module takes from its own
    folder or lmms-eval's task folders (MathVista's utils.py takes its judge from
    mathvista_evals.py): one level, no further."""
    where = getattr(getattr(fn, "__code__", None), "co_filename", None)
    if not where:
        return []
    import lmms_eval.tasks

    roots = (os.path.dirname(where), os.path.dirname(lmms_eval.tasks.__file__))
    files = [where]
    for value in list(getattr(fn, "__globals__", {}).values()):
        try:
            module = value if inspect.ismodule(value) else \
                sys.modules.get(getattr(value, "__module__", None) or "")
            found = getattr(module, "__file__", None)
        except Exception:            # noqa: BLE001 - a global whose attributes raise
            continue
        if isinstance(found, str) and found not in files and \
                any(found.startswith(os.path.join(r, "")) for r in roots):
            files.append(found)
    return files


def generation_problem(kwargs: dict, name: str) -> str | None:
    """Why rayeval cannot decode as lmms-eval's chat models do, or None. Those models
    (``huggingface``, ``llava_hf``: lmms-eval 0.7.3's models/chat) read four of a task's
    generation_kwargs, max_new_tokens, temperature (above 0: sampling), top_p and num_beams,
    and ignore every other (image_aspect_ratio, repetition_penalty, seed, until, do_sample):
    rayeval ignores the same ones, samples with its own seeded draws and searches no beams."""
    if int(kwargs.get("num_beams", 1) or 1) > 1:
        return f"lmms-eval task {name!r} searches {int(kwargs['num_beams'])} beams " \
               "(num_beams), which rayeval does not run: gen_kwargs: {num_beams: 1}"
    top_p = kwargs.get("top_p")          # read only when sampling (POPE's greedy top_p: 0)
    if float(kwargs.get("temperature", 0) or 0) > 0 and top_p is not None and \
            not 0 < float(top_p) <= 1:
        return f"lmms-eval task {name!r} samples with top_p {top_p}; a nucleus is above 0 " \
               "and at most 1"
    return None
