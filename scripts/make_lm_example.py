"""Make a tiny language-model example with nothing downloaded: a byte-level BPE tokenizer and a
2-layer GPT-2 trained for a few seconds on synthetic facts, saved as Hugging Face folders at
several steps, plus three evaluation sets and a sweep file that names them.

    python scripts/make_lm_example.py OUT_DIR [--checkpoints N] [--seed S] [--steps T]

Files under OUT_DIR:
    ckpts/checkpoint-{step}/   model (safetensors) + tokenizer, one folder per saved step
    data/mc.parquet            id, prompt, choices (list<string>), label   -> multiple choice
    data/docs.parquet          id, text                                   -> rolling perplexity
    data/gen.parquet           id, prompt, answer                         -> greedy generation
    sweep.yaml                 the sweep that evaluates every checkpoint on all three

The corpus is one-digit additions ("3 + 4 = 7") and sentences from a small grammar in which
each animal has its own verb and place ("the cat sat on the mat."), so a model this small
learns part of it within a few hundred steps and the checkpoints differ in quality. The model's
context is 64 tokens so long documents need several rolling windows.

Importable too (tests load it by path): ``build(out_dir, checkpoints=3, seed=0)`` returns the
paths it wrote.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

import pyarrow as pa
import pyarrow.parquet as pq
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import example_files  # noqa: E402

EOS = "<|endoftext|>"
CONTEXT = 64          # n_positions: the model's (and the tokenizer's) maximum length
VOCAB_SIZE = 400      # 257 byte-level symbols + special token, the rest merges

# Each animal always does the same thing in the same place: a learnable association that makes
# the sentence-completion questions answerable.
ANIMALS = {
    "cat": ("sat on", "mat"),
    "dog": ("slept by", "door"),
    "bird": ("sang in", "tree"),
    "fish": ("swam in", "river"),
    "cow": ("ate grass in", "field"),
    "horse": ("ran across", "meadow"),
    "owl": ("watched from", "old barn"),
    "fox": ("hid under", "wooden bridge"),
}
ADJECTIVES = ["small", "big", "brown", "happy", "old", "quiet"]
SWEEP_YAML = """\
name: tiny-lm
checkpoints: [ckpts/checkpoint-*]
workers: 2
output: results
bootstrap: {replicates: 200}
evals:
  - name: facts_mc
    task: multiple_choice
    dataset: {path: data/mc.parquet, prompt: prompt, choices: choices, target: label, id: id}
    metrics: [acc, acc_norm]
  - name: docs
    task: text_perplexity
    dataset: {path: data/docs.parquet, text: text, id: id}
    metrics: [word_perplexity, byte_perplexity, bits_per_byte, token_perplexity]
  - name: sums
    task: generation
    dataset: {path: data/gen.parquet, prompt: prompt, target: answer, id: id}
    generation: {until: ["\\n"], max_new_tokens: 8}
    metrics: [exact_match]
"""


def addition(a: int, b: int) -> str:
    return f"{a} + {b} = {a + b}"


def sentence(rng: random.Random) -> str:
    animal = rng.choice(sorted(ANIMALS))
    verb, place = ANIMALS[animal]
    adj = rng.choice(ADJECTIVES) + " " if rng.random() < 0.4 else ""
    return f"the {adj}{animal} {verb} the {place}."


def make_corpus(rng: random.Random, runs: int = 4000) -> str:
    """Training text: short runs of additions and sentences, joined by newlines or by spaces
    (the evaluation documents use both), with EOS between runs as GPT-2 separates documents,
    so the model also learns what follows EOS: rolling perplexity conditions a document's
    first token on it."""
    out = []
    while len(out) < runs:
        facts = [addition(rng.randrange(10), rng.randrange(10)) if rng.random() < 0.5
                 else sentence(rng) for _ in range(rng.randint(2, 8))]
        sep = "\n" if rng.random() < 0.5 else " "
        out.append(sep.join(facts) + "\n")
    return EOS.join(out)


def train_tokenizer(corpus: str):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    # GPT-2's scheme: bytes mapped to printable symbols, no prefix space, and no post-processor,
    # so encode() adds no special tokens and BOS must be prepended by whoever wants it.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    # Split at EOS so the trainer never merges across the special token's text.
    tok.train_from_iterator(corpus.split(EOS), trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOS, eos_token=EOS,
                                   model_max_length=CONTEXT)


def checkpoint_steps(total: int, n: int) -> list[int]:
    """n steps evenly spaced from an early one (a tenth of training) to the last, so the first
    checkpoint is visibly worse than the last."""
    if n <= 1:
        return [total]
    first = max(1, total // 10)
    return sorted({round(first + i * (total - first) / (n - 1)) for i in range(n)})


def make_mc(rng: random.Random, rows: int = 60) -> pa.Table:
    """Half additions (choices are sums: one and two digits, so lengths differ), half sentence
    completions (choices are places or verb phrases of different lengths)."""
    prompts, choices, labels = [], [], []
    places = sorted({p for _, p in ANIMALS.values()})
    verbs = sorted({v for v, _ in ANIMALS.values()})
    for i in range(rows):
        k = rng.randint(2, 5)
        if i % 2 == 0:
            a, b = rng.randrange(10), rng.randrange(10)
            prompt, right = f"{a} + {b} =", str(a + b)
            pool = [str(s) for s in range(19) if s != a + b]
        elif i % 4 == 1:
            animal = rng.choice(sorted(ANIMALS))
            verb, place = ANIMALS[animal]
            prompt, right = f"the {animal} {verb} the", place
            pool = [p for p in places if p != place]
        else:
            animal = rng.choice(sorted(ANIMALS))
            verb, _ = ANIMALS[animal]
            prompt, right = f"the {animal}", verb
            pool = [v for v in verbs if v != verb]
        opts = rng.sample(pool, k - 1)
        label = rng.randrange(k)
        opts.insert(label, right)
        prompts.append(prompt)
        choices.append(opts)
        labels.append(label)
    return pa.table({"id": pa.array(range(rows), pa.int64()), "prompt": prompts,
                     "choices": pa.array(choices, pa.list_(pa.string())),
                     "label": pa.array(labels, pa.int64())})


def make_docs(rng: random.Random, rows: int = 20) -> pa.Table:
    """Documents from one sentence to a few hundred tokens: the long ones span two to five
    64-token windows. A few carry odd whitespace or non-ASCII bytes, which the word and byte
    counts behind word/byte perplexity must handle."""
    texts = []
    for i in range(rows):
        n = [1, 3, 12, 25, 40][i % 5]
        parts = [addition(rng.randrange(10), rng.randrange(10)) if rng.random() < 0.4
                 else sentence(rng) for _ in range(n)]
        sep = "\n" if i % 3 == 0 else " "
        texts.append(sep.join(parts))
    texts[3] = "\n  " + texts[3].replace("\n", "\n\n", 2) + "  \n"  # outer and inner whitespace
    texts[7] = texts[7].replace("cat", "café cat", 1) + " naïve"   # multi-byte characters
    return pa.table({"id": pa.array(range(rows), pa.int64()), "text": texts})


def make_gen(rng: random.Random, rows: int = 40) -> pa.Table:
    pairs = rng.sample([(a, b) for a in range(10) for b in range(10)], rows)
    return pa.table({"id": pa.array(range(rows), pa.int64()),
                     "prompt": [f"{a} + {b} =" for a, b in pairs],
                     "answer": [str(a + b) for a, b in pairs]})


def train(tokenizer, corpus: str, ckpt_dir: str, *, steps: int, saves: list[int], seed: int,
          batch: int = 16, lr: float = 3e-3) -> list[str]:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    eos = tokenizer.eos_token_id
    config = GPT2Config(n_layer=2, n_embd=64, n_head=2, n_positions=CONTEXT,
                        vocab_size=len(tokenizer), bos_token_id=eos, eos_token_id=eos)
    model = GPT2LMHeadModel(config)
    # The backend tokenizer encodes the whole stream without the wrapper's "longer than
    # model_max_length" warning; EOS in the text still becomes the one special token.
    ids = torch.tensor(tokenizer.backend_tokenizer.encode(corpus).ids, dtype=torch.long)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    # Linear decay to a tenth: the late checkpoints settle instead of jittering at full rate.
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0 - 0.9 * i / steps)
    written = []
    model.train()
    for step in range(1, steps + 1):
        # Random 64-token windows of the stream: lines start at every position, as they will
        # in evaluation prompts, documents and rolling windows.
        starts = torch.randint(0, len(ids) - CONTEXT, (batch,))
        x = torch.stack([ids[s:s + CONTEXT] for s in starts])
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if step in saves:
            folder = os.path.join(ckpt_dir, f"checkpoint-{step}")
            model.eval()
            with example_files.whole(folder) as partial:      # whole or not at all
                model.save_pretrained(partial)
                tokenizer.save_pretrained(partial)
            model.train()
            written.append(folder)
            print(f"  step {step:4d}  loss {loss.item():.3f}  -> {folder}")
    return written


def build(out_dir: str, *, checkpoints: int = 3, seed: int = 0, steps: int = 300) -> dict:
    """Write the example under out_dir (checkpoints from an earlier build are removed) and
    return {"checkpoints": [folder, ...], "steps": [int, ...], "mc": path, "docs": path,
    "gen": path, "sweep": path}."""
    rng = random.Random(seed)
    corpus = make_corpus(rng)
    tokenizer = train_tokenizer(corpus)

    data_dir = os.path.join(out_dir, "data")
    os.makedirs(data_dir, exist_ok=True)
    paths = {}
    for name, table in (("mc", make_mc(rng)), ("docs", make_docs(rng)), ("gen", make_gen(rng))):
        paths[name] = os.path.join(data_dir, f"{name}.parquet")
        pq.write_table(table, paths[name])

    ckpt_dir = os.path.join(out_dir, "ckpts")
    example_files.clear(ckpt_dir)       # a stale checkpoint would match the glob
    saves = checkpoint_steps(steps, checkpoints)
    # One thread: the model is too small to gain from more, multi-threaded kernels slow down
    # badly on a busy machine, and a fixed count keeps the weights the same on any core count.
    with example_files.threads():
        folders = train(tokenizer, corpus, ckpt_dir, steps=steps, saves=saves, seed=seed)

    paths["sweep"] = os.path.join(out_dir, "sweep.yaml")
    with open(paths["sweep"], "w") as f:
        f.write(SWEEP_YAML)
    return {"checkpoints": folders, "steps": saves, **paths}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", help="folder to write the example into")
    parser.add_argument("--checkpoints", type=int, default=3, help="checkpoints to save")
    parser.add_argument("--seed", type=int, default=0, help="seed for the data and the training")
    parser.add_argument("--steps", type=int, default=300, help="training steps")
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    paths = build(args.out_dir, checkpoints=args.checkpoints, seed=args.seed, steps=args.steps)
    for key in ("mc", "docs", "gen", "sweep"):
        print(f"wrote {paths[key]}")
    print(f"wrote {len(paths['checkpoints'])} checkpoints (steps {paths['steps']}) under "
          f"{os.path.join(args.out_dir, 'ckpts')} in {time.perf_counter() - t0:.1f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
