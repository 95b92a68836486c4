"""Benchmark: a generation sweep on model.backend vllm against model.backend hf, side by side.

N checkpoints of a small GPT-2 (--layers, --width; random weights, one seed each) with a BPE
tokenizer trained here, saved as Hugging Face folders, and --prompts prompts (sentences of
the tiny LM example's corpus, cut to 6-16 words). One `python -m rayeval run --profile` per
backend over all N checkpoints, --new-tokens greedy tokens each (no stop string: random
weights rarely stop, so every item generates its budget), interleaved over --runs:

    hf     model.backend: hf   (Hugging Face generate, batched by batch_size)
    vllm   model.backend: vllm (one engine per worker, each checkpoint's weights loaded into
           it); its profile shows the engine started once and each checkpoint's weight load

Every generation is compared between the two stores; the script reports how many differ.

Target (issue 23, this CPU machine): the vllm run at most 0.5x the hf run.

    python scripts/bench_vllm.py [--checkpoints 2] [--prompts 300] [--new-tokens 32]
        [--workers 1] [--layers 4] [--width 256] [--runs 1] [--eager] [--engine JSON]
        [--json FILE]
"""

from __future__ import annotations

import json
import os
import random
import re
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchkit  # noqa: E402

REPO = benchkit.REPO
TARGET = 0.5


def build(root: str, args) -> list[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    import make_lm_example as maker

    rng = random.Random(0)
    corpus = maker.make_corpus(rng)
    tokenizer = maker.train_tokenizer(corpus)
    words = corpus.replace("\n", " ").split()
    prompts = []
    for _ in range(args.prompts):
        start = rng.randrange(len(words) - 20)
        prompts.append(" ".join(words[start:start + rng.randint(6, 16)]))
    os.makedirs(os.path.join(root, "data"), exist_ok=True)
    pq.write_table(pa.table({"id": list(range(len(prompts))), "prompt": prompts,
                             "answer": ["-"] * len(prompts)}),
                   os.path.join(root, "data", "prompts.parquet"))
    folders = []
    for i in range(args.checkpoints):
        torch.manual_seed(i)
        eos = tokenizer.eos_token_id
        config = GPT2Config(n_layer=args.layers, n_embd=args.width, n_head=args.width // 64,
                            n_positions=256, vocab_size=len(tokenizer), bos_token_id=eos,
                            eos_token_id=eos)
        folder = os.path.join(root, "ckpts", f"checkpoint-{(i + 1) * 100}")
        GPT2LMHeadModel(config).eval().save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        folders.append(folder)
    return folders


def write_sweep(root: str, backend: str, args) -> str:
    import yaml

    sweep = {"name": f"bench-{backend}", "checkpoints": ["ckpts/checkpoint-*"],
             "workers": args.workers, "output": "unused", "bootstrap": {"replicates": 0},
             "model": {"backend": backend},
             "evals": [{"name": "gen", "task": "generation", "batch_size": args.batch,
                        "samples": True,
                        "dataset": {"path": "data/prompts.parquet", "prompt": "prompt",
                                    "target": "answer", "id": "id"},
                        "generation": {"max_new_tokens": args.new_tokens},
                        "metrics": ["exact_match"]}]}
    if backend == "vllm":
        sweep["model"]["vllm"] = {"max_model_len": 256, "enforce_eager": args.eager,
                                  **json.loads(args.engine)}
    path = os.path.join(root, f"sweep_{backend}.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(sweep, f)
    return path


def profile(log: str) -> dict[str, float]:
    """Rank 0's worker spans of `--profile` (name: (seconds, times)) from a run's log."""
    spans = {}
    with open(log, errors="replace") as f:
        for line in f:
            m = re.match(r"\s*([\d.]+) s \|\s+[\d.]+ s\s+(setup|load|engine start|"
                         r"engine load|pass)\s+x(\d+)", line)
            if m:
                spans[m.group(2)] = (float(m.group(1)), int(m.group(3)))
    return spans


def generations(store: str, checkpoints: list[str]) -> dict:
    sys.path.insert(0, REPO)
    import rayeval

    return {(os.path.basename(c), r["id"]): r["response"] for c in checkpoints
            for r in rayeval.samples(store, checkpoint=os.path.basename(c),
                                     evaluation="gen").to_pylist()}


def main(argv=None) -> int:
    parser = benchkit.parser(__doc__, repeats=1, flag="--runs")
    parser.add_argument("--checkpoints", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=300)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--batch", type=int, default=32, help="hf: sequences per generate")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--engine", default="{}",
                        help="vllm: more engine arguments, as JSON (model.vllm)")
    parser.add_argument("--eager", action="store_true",
                        help="vllm: enforce_eager (no compilation at the engine's start)")
    args = parser.parse_args(argv)

    root = tempfile.mkdtemp(prefix="rayeval-bench-vllm-")
    checkpoints = build(root, args)
    sweeps = {b: write_sweep(root, b, args) for b in ("hf", "vllm")}
    times: dict[str, list[float]] = {"hf": [], "vllm": []}
    spans: dict[str, dict] = {}
    stores = {}
    for run in range(args.runs):
        for backend in benchkit.rotated(("hf", "vllm"), run):
            store = os.path.join(root, f"store_{backend}_{run}")
            log = os.path.join(root, f"{backend}_{run}.log")
            times[backend].append(benchkit.run(
                [sys.executable, "-m", "rayeval", "run", sweeps[backend], "--output", store,
                 "--profile"], log=log, cwd=REPO).seconds)
            spans[backend] = profile(log)
            stores[backend] = store
            print(f"run {run} {backend}: {times[backend][-1]:.1f} s  {spans[backend]}",
                  flush=True)
    hf, vllm = (generations(stores[b], checkpoints) for b in ("hf", "vllm"))
    differ = sorted(k for k in hf if hf[k] != vllm.get(k))
    t_hf, t_vllm = statistics.median(times["hf"]), statistics.median(times["vllm"])
    result = {"machine": benchkit.machine(), "load_after": benchkit.load(),
              "args": vars(args), "hf_s": times["hf"], "vllm_s": times["vllm"],
              "ratio": round(t_vllm / t_hf, 3), "target": TARGET,
              "met": t_vllm / t_hf <= TARGET, "profile": spans,
              "generations": len(hf), "differ": len(differ),
              "differ_examples": [(k, hf[k], vllm.get(k)) for k in differ[:5]]}
    print(json.dumps(result, indent=2, default=str))
    benchkit.record(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
