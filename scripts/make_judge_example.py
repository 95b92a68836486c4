"""Make the judged example's judge with nothing downloaded: a tiny GPT-2 trained here (about four
minutes on one CPU thread) to read a sum's reference and an answer and say " yes" when they are
the same number and " no" when they are not: right on 98.2% of 400 fresh items.

    python scripts/make_judge_example.py [OUT_DIR]      # default: configs/judge

Files under OUT_DIR:
    judges/judge-model/   the judge (safetensors) and its tokenizer, with a chat template

configs/judge/sweep.yaml (shipped beside it) has the tiny language model of configs/lm answer
configs/lm's one-digit sums and this judge grade each answer against the reference; its board
shows ``exact_match`` beside ``judge``, which agree wherever the judge is right. The judge is a
stand-in that runs anywhere, not a grader to trust: a real one is an instruct model's folder
(docs/judges.md).

How it is trained: every example is the prompt the sweep's judge template renders, through the
chat template, for a sum, its reference and an answer, followed by the verdict and the end of
text. Half the answers are the reference, the rest another number or a scrap of text like the
ones an undertrained checkpoint writes, most after a space as a model's answer to "a + b ="
comes (" 7"); the verdict compares them without spaces. The loss is on the verdict and the end
of text only.

Importable too (tests load it by path): ``build(out_dir, seed=0)`` returns the judge's folder.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import example_files  # noqa: E402

EOS = "<|endoftext|>"
CONTEXT = 96
VOCAB_SIZE = 320
# The judge sees one user message through this template, with the generation prompt
# (``judge`` in docs/judges.md): roles in angle brackets, the reply after "<assistant>".
CHAT = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}")
# The sweep's judge prompt (configs/judge/sweep.yaml); the tests check that the two agree.
PROMPT = ("Question: {{ prompt }}\nReference: {{ target }}\nAnswer: {{ response }}\n"
          "Do they match? Reply yes or no.")
SCRAPS = ["", "the cat", "1 + 2", "=", "sat on the mat.", "9 9", "+", "the dog ran"]


def render(prompt: str, target: str, response: str) -> str:
    """The judge prompt of one item, as the sweep's template renders it."""
    return PROMPT.replace("{{ prompt }}", prompt).replace("{{ target }}", target) \
        .replace("{{ response }}", response)


def chat(text: str) -> str:
    return f"<user>{text}<assistant>"


def example(rng: random.Random) -> tuple[str, str]:
    """One training item: the judge's input and its verdict."""
    a, b = rng.randrange(10), rng.randrange(10)
    target = str(a + b)
    roll = rng.random()
    if roll < 0.5:
        response = target
    elif roll < 0.85:
        response = str(rng.choice([n for n in range(19) if n != a + b]))
    else:
        response = rng.choice(SCRAPS)
    if rng.random() < 0.7:          # an answer after "=" starts with a space: " 7"
        response = " " + response
    verdict = " yes" if response.strip() == target else " no"
    return chat(render(f"{a} + {b} =", target, response)), verdict


def train_tokenizer(rng: random.Random):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    texts = [x + v for x, v in (example(rng) for _ in range(2000))]
    tok = Tokenizer(models.BPE())
    # Each digit a token of its own: a number reads the same after "Reference:" and after
    # "Answer:", which a merge such as " 1" would not give (the verdict was right on 79% of
    # fresh items with merged digits after 1,500 steps).
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, special_tokens=[EOS], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    out = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOS, eos_token=EOS,
                                  pad_token=EOS, model_max_length=CONTEXT)
    out.chat_template = CHAT
    return out


def train(tokenizer, rng: random.Random, *, steps: int, seed: int, batch: int = 32,
          lr: float = 1e-3):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    eos = tokenizer.eos_token_id
    config = GPT2Config(n_layer=2, n_embd=128, n_head=4, n_positions=CONTEXT,
                        vocab_size=len(tokenizer), bos_token_id=eos, eos_token_id=eos)
    model = GPT2LMHeadModel(config)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0 - 0.9 * i / steps)
    model.train()
    for step in range(1, steps + 1):
        x, labels = batch_of(tokenizer, [example(rng) for _ in range(batch)])
        loss = model(input_ids=x, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if step % 200 == 0 or step == steps:
            print(f"  step {step:4d}  loss {loss.item():.4f}", flush=True)
    return model.eval()


def batch_of(tokenizer, items: list[tuple[str, str]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs right-padded with EOS, and labels that score the verdict and the EOS after it."""
    eos = tokenizer.eos_token_id
    rows, labels = [], []
    for text, verdict in items:
        head = tokenizer.encode(text, add_special_tokens=False)
        tail = tokenizer.encode(verdict, add_special_tokens=False) + [eos]
        rows.append(head + tail)
        labels.append([-100] * len(head) + tail)
    width = max(map(len, rows))
    x = torch.tensor([r + [eos] * (width - len(r)) for r in rows])
    y = torch.tensor([r + [-100] * (width - len(r)) for r in labels])
    return x, y


def agreement(model, tokenizer, rng: random.Random, n: int = 400) -> float:
    """The share of fresh items whose greedy verdict is right."""
    right = 0
    for _ in range(n):
        text, verdict = example(rng)
        ids = torch.tensor([tokenizer.encode(text, add_special_tokens=False)])
        with torch.no_grad():
            out = model.generate(ids, do_sample=False, max_new_tokens=2,
                                 pad_token_id=tokenizer.eos_token_id)
        said = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
        right += said.strip().split(" ")[0] == verdict.strip()
    return right / n


def build(out_dir: str, *, seed: int = 0, steps: int = 3000) -> str:
    """Write the judge under out_dir/judges/judge-model (whole or not at all); its folder."""
    rng = random.Random(seed)
    tokenizer = train_tokenizer(rng)
    with example_files.threads():
        model = train(tokenizer, rng, steps=steps, seed=seed)
        share = agreement(model, tokenizer, random.Random(seed + 1))
    print(f"  the judge's verdict is right on {share:.1%} of 400 fresh items")
    folder = os.path.join(out_dir, "judges", "judge-model")
    with example_files.whole(folder) as partial:
        model.save_pretrained(partial)
        tokenizer.save_pretrained(partial)
    return folder


def main(argv=None) -> int:
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", nargs="?", default=os.path.join(repo, "configs", "judge"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=3000)
    args = parser.parse_args(argv)
    began = time.perf_counter()
    folder = build(args.out_dir, seed=args.seed, steps=args.steps)
    print(f"wrote {folder} in {time.perf_counter() - began:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
