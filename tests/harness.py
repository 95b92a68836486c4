"""The reference for rayeval's language-model tasks: EleutherAI's lm-evaluation-harness (0.4.13)
run on the same Hugging Face checkpoint folders and parquet files (see
scripts/make_lm_example.py), so another implementation can be compared metric by metric and
item by item.

    from harness import run_harness
    ref = run_harness("OUT/ckpts/checkpoint-300", "OUT/data")
    ref["mc"]["acc"], ref["docs"]["samples"][3], ref["gen"]["samples"][0]

Three tasks, written as harness task YAMLs by ``write_tasks``:
    rayeval_mc    multiple_choice        prompt / choices / label        acc, acc_norm
    rayeval_docs  loglikelihood_rolling  text                            word_perplexity,
                                                                         byte_perplexity,
                                                                         bits_per_byte
    rayeval_gen   generate_until         prompt / answer, greedy         exact_match

Nothing is downloaded: the hub and datasets libraries are put offline, the parquet files load
through the datasets library's packaged "parquet" builder into a cache inside the task folder
(so a rebuilt data set at the same path is never served stale from a shared cache).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

from support import OFFLINE_ENV, go_offline, offline_env  # noqa: F401 - re-exported

# Before anything imports huggingface_hub / datasets / transformers: they read these at import.
go_offline()

TASKS = {"mc": "rayeval_mc", "docs": "rayeval_docs", "gen": "rayeval_gen"}
# The filter whose output exact_match scores; its name is the suffix of the metric keys
# ("exact_match,strip") in the harness's results.
GEN_FILTER = "strip"


def _q(value) -> str:
    """A YAML scalar for value: JSON strings and lists are valid YAML flow scalars and escape
    newlines and quotes correctly."""
    return json.dumps(value)


def write_tasks(task_dir: str, data_dir: str, *, until=("\n",),
                max_new_tokens: int = 8) -> list[str]:
    """Write the three task YAMLs into task_dir (created if missing) for the parquet files in
    data_dir; return the YAML paths. Pass task_dir as the TaskManager's include_path or the
    CLI's --include_path."""
    os.makedirs(task_dir, exist_ok=True)
    data_dir = os.path.abspath(data_dir)
    cache_dir = os.path.join(os.path.abspath(task_dir), "datasets_cache")

    def header(name: str, output_type: str, file: str) -> str:
        return (f"task: {name}\n"
                f"dataset_path: parquet\n"
                f"dataset_kwargs:\n"
                f"  data_files: {{test: {_q(os.path.join(data_dir, file))}}}\n"
                f"  cache_dir: {_q(cache_dir)}\n"
                f"test_split: test\n"
                f"output_type: {output_type}\n")

    texts = {
        # doc_to_text/doc_to_choice/doc_to_target name columns, so the harness reads the values
        # as they are (no Jinja rendering); the label is already an int index.
        "rayeval_mc": header("rayeval_mc", "multiple_choice", "mc.parquet") + (
            "doc_to_text: prompt\n"
            "doc_to_choice: choices\n"
            "doc_to_target: label\n"
            "target_delimiter: \" \"\n"
            "metric_list:\n"
            "  - {metric: acc, aggregation: mean, higher_is_better: true}\n"
            "  - {metric: acc_norm, aggregation: mean, higher_is_better: true}\n"),
        # As the harness's wikitext task: no context, the whole document is the target, scored
        # in rolling windows of the model's max_length, the first token conditioned on BOS.
        "rayeval_docs": header("rayeval_docs", "loglikelihood_rolling", "docs.parquet") + (
            "doc_to_text: \"\"\n"
            "doc_to_target: text\n"
            "metric_list:\n"
            "  - {metric: word_perplexity, aggregation: weighted_perplexity,"
            " higher_is_better: false}\n"
            "  - {metric: byte_perplexity, aggregation: weighted_perplexity,"
            " higher_is_better: false}\n"
            "  - {metric: bits_per_byte, aggregation: bits_per_byte, higher_is_better: false}\n"),
        # The harness cuts a generation at the first stop string; the built-in
        # remove_whitespace filter then strips it, and the target template trims the answer,
        # so exact_match compares both without surrounding whitespace.
        "rayeval_gen": header("rayeval_gen", "generate_until", "gen.parquet") + (
            "doc_to_text: prompt\n"
            "doc_to_target: \"{{answer | trim}}\"\n"
            "generation_kwargs:\n"
            f"  until: {_q(list(until))}\n"
            f"  max_gen_toks: {int(max_new_tokens)}\n"
            "  do_sample: false\n"
            "filter_list:\n"
            f"  - name: {GEN_FILTER}\n"
            "    filter:\n"
            "      - function: remove_whitespace\n"
            "      - function: take_first\n"
            "metric_list:\n"
            "  - {metric: exact_match, aggregation: mean, higher_is_better: true}\n"),
    }
    paths = []
    for name, text in texts.items():
        path = os.path.join(task_dir, f"{name}.yaml")
        with open(path, "w") as f:
            f.write(text + "metadata:\n  version: 1.0\n")
        paths.append(path)
    return paths


def _metric(task_results: dict, name: str, filter_name: str = "none") -> float:
    return float(task_results[f"{name},{filter_name}"])


def _item_id(sample: dict) -> int:
    return int(sample["doc"]["id"])


def _collect(results: dict, tasks) -> dict:
    """The harness's results dict -> {task: {metric: value, "samples": {id: ...}}}."""
    out = {}
    res, samples = results["results"], results["samples"]
    if "mc" in tasks:
        r = res[TASKS["mc"]]
        items = {}
        for s in samples[TASKS["mc"]]:
            # One response per choice: (loglikelihood, is_greedy); the filter is a no-op.
            lls = [float(resp[0]) for resp in s["filtered_resps"]]
            items[_item_id(s)] = {"lls": lls, "acc": float(s["acc"]),
                                  "acc_norm": float(s["acc_norm"])}
        out["mc"] = {"acc": _metric(r, "acc"), "acc_norm": _metric(r, "acc_norm"),
                     "samples": items}
    if "docs" in tasks:
        r = res[TASKS["docs"]]
        items = {}
        for s in samples[TASKS["docs"]]:
            # Sum of token log-probabilities over all rolling windows (natural log).
            resp = s["filtered_resps"]
            items[_item_id(s)] = float(resp[0] if isinstance(resp, list) else resp)
        out["docs"] = {m: _metric(r, m) for m in
                       ("word_perplexity", "byte_perplexity", "bits_per_byte")}
        out["docs"]["samples"] = items
    if "gen" in tasks:
        r = res[TASKS["gen"]]
        items = {}
        for s in samples[TASKS["gen"]]:
            resp = s["filtered_resps"]
            items[_item_id(s)] = resp[0] if isinstance(resp, list) else resp
        out["gen"] = {"exact_match": _metric(r, "exact_match", GEN_FILTER), "samples": items}
    return out


def run_harness(folder: str, data_dir: str, *, tasks=("mc", "docs", "gen"), batch_size: int = 8,
                max_new_tokens: int = 8, until=("\n",)) -> dict:
    """Evaluate one checkpoint folder (model + tokenizer, as save_pretrained writes them) with
    lm_eval's Python API on CPU in float32. Returns, for each task asked for:

        {"mc":   {"acc": float, "acc_norm": float,
                  "samples": {id: {"lls": [float per choice], "acc": 0/1, "acc_norm": 0/1}}},
         "docs": {"word_perplexity": float, "byte_perplexity": float, "bits_per_byte": float,
                  "samples": {id: total loglikelihood (nats)}},
         "gen":  {"exact_match": float, "samples": {id: generation, cut and stripped}}}

    ids are the data sets' ``id`` column."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    tasks = tuple(tasks)
    with tempfile.TemporaryDirectory(prefix="rayeval-harness-") as task_dir:
        write_tasks(task_dir, data_dir, until=until, max_new_tokens=max_new_tokens)
        # include_defaults=False: only our three tasks, not the harness's thousands of YAMLs.
        manager = TaskManager(include_path=task_dir, include_defaults=False)
        results = lm_eval.simple_evaluate(
            model="hf",
            model_args=f"pretrained={os.path.abspath(folder)},dtype=float32",
            tasks=[TASKS[t] for t in tasks],
            task_manager=manager,
            device="cpu",
            batch_size=batch_size,
            log_samples=True,
            # Standard errors are not returned, so none are computed.
            bootstrap_iters=0,
        )
    return _collect(results, tasks)


def harness_cli_command(folder: str, task_dir: str, out_dir: str, *, tasks=("mc", "docs", "gen"),
                        batch_size: int = 8) -> list[str]:
    """The lm_eval command line that evaluates one checkpoint folder on the tasks in task_dir
    (written by write_tasks) and writes its results JSON (with samples) under out_dir. Run it
    with env=offline_env() so it downloads nothing."""
    return [sys.executable, "-m", "lm_eval", "run",
            "--model", "hf",
            "--model_args", f"pretrained={os.path.abspath(folder)},dtype=float32",
            "--tasks", ",".join(TASKS[t] for t in tasks),
            "--include_path", os.path.abspath(task_dir),
            "--device", "cpu",
            "--batch_size", str(batch_size),
            "--output_path", os.path.abspath(out_dir),
            "--log_samples"]
