"""Build the vision-language example beside configs/vlm/sweep.yaml: a tiny Idefics3 trained a few
minutes on easy-vqa's train questions, saved as Hugging Face folders (model, processor,
tokenizer) at three steps in ckpts/, and 200 easy-vqa test items as parquet with the images'
PNG bytes in data/ (neither is committed: configs/vlm/.gitignore).

    python scripts/make_vlm_example.py [--out configs/vlm] [--steps 1200] [--checkpoints 3]

Needs `pip install 'rayeval[vlm]' easy-vqa==1.0` (the items ship inside the easy-vqa wheel;
nothing is downloaded). The model is tests/vlm_support.py's tiny Idefics3 (~0.55M parameters);
training teaches it to answer ``<question>`` about a 64x64 shape with one of 13 words, the loss
on the answer and the end-of-utterance token only (docs/vision-language.md: the last checkpoint
scores 0.77 exact match on the 200 test items, the first 0.72; chance 0.077, the question's most
common answer alone 0.66).

Training runs on one thread, which the script sets itself (``--threads``; scripts/
example_files.py has the measurements): 332 s for the default 1,200 steps on the 2-core test
machine while other sessions ran (load average 3 to 20), 12.5 s per 100 steps once it was
quieter, so about 2.5 minutes on a quiet one. Checkpoints are written whole or not at all
(example_files.whole): an interrupted run leaves none that configs/vlm/sweep.yaml's glob would
match, and a re-run starts again from an empty ckpts/.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "scripts"))

import example_files  # noqa: E402
from tests.vlm_support import (EOS, build_tiny_vlm, easy_vqa_answers,  # noqa: E402
                               easy_vqa_items, item_texts)

TEST_ITEMS = 200
BATCH = 32


def _steps(total: int, n: int) -> list[int]:
    """n steps from a tenth of training to the end, so the first checkpoint is clearly worse."""
    if n <= 1:
        return [total]
    first = max(1, total // 10)
    return sorted({round(first + i * (total - first) / (n - 1)) for i in range(n)})


def _batch(proc, items, images):
    """Processor inputs and labels: the prompt (chat template, the image then the question),
    then " answer" and the end-of-utterance token, which alone are scored."""
    tok = proc.tokenizer
    prompts = [proc.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"},
                                      {"type": "text", "text": it["question"]}]}],
        add_generation_prompt=True) for it in items]
    answers = [tok.encode(" " + it["answer"] + EOS) for it in items]
    inputs = proc(text=[p + " " + it["answer"] + EOS for p, it in zip(prompts, items)],
                  images=[[images[it["image"]]] for it in items], padding=True,
                  return_tensors="pt")
    labels = inputs["input_ids"].clone().fill_(-100)
    for j, ans in enumerate(answers):
        end = int(inputs["attention_mask"][j].sum())        # right-padded
        labels[j, end - len(ans):end] = inputs["input_ids"][j, end - len(ans):end]
    return inputs, labels


def train(out: str, steps: int, checkpoints: int, seed: int = 0, lr: float = 3e-3,
          threads: int = example_files.THREADS) -> list[str]:
    """Train and save ``checkpoints`` folders under out/ckpts (emptied first); their paths."""
    import tempfile

    train_items = easy_vqa_items("train")
    ckpts = os.path.join(out, "ckpts")
    example_files.clear(ckpts)
    with example_files.threads(threads), tempfile.TemporaryDirectory() as tmp:
        folder = build_tiny_vlm(os.path.join(tmp, "init"), item_texts(train_items), seed)
        return _train(folder, ckpts, train_items, steps, checkpoints, seed, lr)


def _train(folder, ckpts, train_items, steps, checkpoints, seed, lr) -> list[str]:
    import torch
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    model = AutoModelForImageTextToText.from_pretrained(folder).float().train()
    proc = AutoProcessor.from_pretrained(folder)
    images = {p: Image.open(p).convert("RGB") for p in {it["image"] for it in train_items}}
    torch.manual_seed(seed)
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0 - 0.9 * i / steps)
    keep = set(_steps(steps, checkpoints))
    written, start = [], time.perf_counter()
    for step in range(1, steps + 1):
        inputs, labels = _batch(proc, rng.sample(train_items, BATCH), images)
        loss = model(**inputs, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 100 == 0:
            print(f"step {step}: loss {loss.item():.3f} ({time.perf_counter() - start:.0f} s)",
                  flush=True)
        if step in keep:
            target = os.path.join(ckpts, f"checkpoint-{step}")
            with example_files.whole(target) as partial:
                model.eval().save_pretrained(partial)
                proc.save_pretrained(partial)
            model.train()
            written.append(target)
    return written


def write_items(out: str, n: int = TEST_ITEMS) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq

    items = easy_vqa_items("test", n=n, seed=0)
    answers = easy_vqa_answers()
    os.makedirs(os.path.join(out, "data"), exist_ok=True)
    path = os.path.join(out, "data", "vqa.parquet")
    images = []
    for it in items:
        with open(it["image"], "rb") as f:
            images.append(f.read())
    table = pa.table({
        "id": [it["id"] for it in items], "image": images,
        "question": [it["question"] for it in items], "answer": [it["answer"] for it in items],
        "choices": [answers] * len(items),
        "label": [answers.index(it["answer"]) for it in items]})
    with example_files.whole(path) as partial:
        pq.write_table(table, partial)
    return path


def build(out: str, steps: int = 1200, checkpoints: int = 3,
          threads: int = example_files.THREADS) -> list[str]:
    write_items(out)
    return train(out, steps, checkpoints, threads=threads)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(REPO, "configs", "vlm"))
    parser.add_argument("--steps", type=int, default=1200)
    parser.add_argument("--checkpoints", type=int, default=3)
    parser.add_argument("--threads", type=int, default=example_files.THREADS,
                        help="torch's threads (one is fastest here: scripts/example_files.py)")
    args = parser.parse_args()
    start = time.perf_counter()
    for path in build(args.out, args.steps, args.checkpoints, args.threads):
        print(path)
    print(f"done in {time.perf_counter() - start:.0f} s", flush=True)


if __name__ == "__main__":
    main()
