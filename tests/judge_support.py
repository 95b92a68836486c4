"""A judged evaluation built here (docs/judges.md), and the plain transformers loop it is
checked against.

The evaluated checkpoints are tiny random Llamas; the judge is a Llama built by hand so that
its verdicts vary with the response, which a tiny random or a small real judge does not do
(SmolLM2-135M-Instruct answers "No" to every yes/no judging prompt tried): its hidden size is
the vocabulary's, its embeddings are one-hot, attention and MLP add nothing, and its output
layer maps each token to the next by a fixed rule. So its greedy text after any prompt is a
function of the prompt's last token: " yes", " no" or " maybe" (no verdict: a failure),
then " maybe" on. Nothing is downloaded.
"""

from __future__ import annotations

import os
import re

import pyarrow as pa
import pyarrow.parquet as pq
import torch
import yaml

from support import tiny_llama, tiny_tokenizer

QUESTIONS = ["what is two plus two", "name a colour", "the capital of france",
             "a word for happy", "how many legs has a cat", "the opposite of cold",
             "a prime number", "the colour of the sky", "what do bees make",
             "a large animal", "the first letter", "what is ice"]
VERDICT_WORDS = [" yes", " no", " maybe"]
# A chat template without a generation prompt: the rendered prompt ends with the response's
# last token, which the judge's verdict depends on.
CHAT = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
PROMPT = ("Question: {{ question }}\nReference: {{ target }}\nAnswer: {{ response }}")


def build(folder: str, items: int = 40, checkpoints: int = 2) -> dict:
    """The data set, checkpoints and judge under ``folder``; the paths."""
    os.makedirs(folder, exist_ok=True)
    questions = [QUESTIONS[i % len(QUESTIONS)] + f" {i}" for i in range(items)]
    answers = [str(i % 7) for i in range(items)]
    texts = [f"Q: {q}\nA: {a}" for q, a in zip(questions, answers)] + \
        ["yes no maybe " * 20, "Question Reference Answer"] * 5
    tok = tiny_tokenizer(texts, vocab=400)
    tok.chat_template = CHAT
    table = pa.table({"id": list(range(items)), "question": questions,
                      "prompt": [f"Q: {q}\nA:" for q in questions], "answer": answers})
    data = os.path.join(folder, "qa.parquet")
    pq.write_table(table, data)
    ckpts = []
    for c in range(checkpoints):
        path = os.path.join(folder, "ckpts", f"step-{(c + 1) * 100}")
        tiny_llama(len(tok), seed=c + 1).save_pretrained(path)
        tok.save_pretrained(path)
        ckpts.append(path)
    judge = os.path.join(folder, "judges", "judge-model")
    judge_model(tok).save_pretrained(judge)
    tok.save_pretrained(judge)
    return {"data": data, "checkpoints": ckpts, "judge": judge, "folder": folder}


def judge_model(tok, salt: int = 0):
    """The hand-built judge (see the module's docstring)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    vocab = len(tok)
    words = [tok.convert_tokens_to_ids(tok.tokenize(w))[0] for w in VERDICT_WORDS]
    assert all(len(tok.tokenize(w)) == 1 for w in VERDICT_WORDS), "verdict words split"
    config = LlamaConfig(vocab_size=vocab, hidden_size=vocab, intermediate_size=8,
                         num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1,
                         head_dim=vocab, max_position_embeddings=512, bos_token_id=0,
                         eos_token_id=0, pad_token_id=0, tie_word_embeddings=False)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        model.model.embed_tokens.weight.copy_(torch.eye(vocab))
        model.model.norm.weight.fill_(1.0)
        model.model.layers[0].input_layernorm.weight.fill_(1.0)
        model.model.layers[0].post_attention_layernorm.weight.fill_(1.0)
        head = model.lm_head.weight
        for a in range(vocab):
            nxt = words[2] if a in words else words[(a * 7 + salt) % 3]
            head[nxt, a] = 1.0
    return model


def sweep(paths: dict, *, workers: int = 1, batch_size: int = 16, prompt: str = PROMPT,
          verdict=None, name: str = "sweep.yaml", output: str = "out", **judge) -> str:
    raw = {"name": "judged", "model": {}, "checkpoints": paths["checkpoints"],
           "output": os.path.join(paths["folder"], output), "workers": workers,
           "batch_size": batch_size, "bootstrap": {"replicates": 200},
           "evals": [{"name": "nq", "task": "generation",
                      "dataset": {"path": paths["data"], "prompt": "prompt",
                                  "target": "answer", "id": "id"},
                      "generation": {"until": ["\n"], "max_new_tokens": 6},
                      "judge": {"model": paths["judge"], "prompt": prompt,
                                "max_new_tokens": 3,
                                "verdict": verdict or {"yes": 1, "no": 0}, **judge},
                      "metrics": ["exact_match", "judge"]}]}
    path = os.path.join(paths["folder"], name)
    with open(path, "w") as f:
        yaml.safe_dump(raw, f, sort_keys=False)
    return path


def plain_loop(paths: dict, prompt: str = PROMPT, verdict=None, max_new_tokens: int = 3,
               answer_tokens: int = 6) -> dict:
    """Per checkpoint, per item id: (response, judge prompt, judge text, score or None), by
    transformers alone: each item generated on its own (greedy, cut at the stop string),
    the template rendered with jinja2, the chat template applied, the judge's greedy text,
    the verdict read by a regular expression written here."""
    verdict = verdict or {"yes": 1, "no": 0}
    rows, judge = _items(paths), _Judge(paths, max_new_tokens)
    answers = responses(paths, answer_tokens)
    template = _template(prompt)
    out = {}
    for ckpt, given in answers.items():
        items = {}
        for row in rows:
            text = template.render(**row, response=given[row["id"]], target=row["answer"])
            said = judge(text)
            items[row["id"]] = (given[row["id"]], text, said, read_verdict(verdict, said))
        out[ckpt] = items
    return out


def pairwise_loop(paths: dict, baseline: str, prompt: str, verdict=None,
                  max_new_tokens: int = 3) -> dict:
    """Per checkpoint, per item id: (score or None, judge text in the first order, in the
    swapped order): each item asked with the checkpoint's answer first, then the baseline's;
    its score is the mean of how much the checkpoint's answer wins in each."""
    verdict = verdict or {"yes": 1, "no": 0}
    rows, answers, judge = _items(paths), responses(paths), _Judge(paths, max_new_tokens)
    template = _template(prompt)
    out = {}
    for ckpt, given in answers.items():
        items = {}
        for row in rows:
            mine, theirs = given[row["id"]], answers[baseline][row["id"]]
            first = judge(template.render(**row, response=mine, target=row["answer"],
                                          response_a=mine, response_b=theirs))
            second = judge(template.render(**row, response=mine, target=row["answer"],
                                           response_a=theirs, response_b=mine))
            a, b = read_verdict(verdict, first), read_verdict(verdict, second)
            items[row["id"]] = (None if a is None or b is None else (a + 1 - b) / 2,
                                first, second)
        out[ckpt] = items
    return out


def _items(paths: dict) -> list[dict]:
    return pq.read_table(paths["data"]).to_pylist()


def _template(prompt: str):
    import jinja2

    return jinja2.Environment(undefined=jinja2.StrictUndefined).from_string(prompt)


def responses(paths: dict, max_new_tokens: int = 6) -> dict:
    """Per checkpoint, per item id: its greedy answer, each item generated on its own."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = {}
    for ckpt in paths["checkpoints"]:
        tok = AutoTokenizer.from_pretrained(ckpt)
        model = AutoModelForCausalLM.from_pretrained(ckpt).eval()
        given = {}
        for row in _items(paths):
            ids = tok(row["prompt"], return_tensors="pt").input_ids
            with torch.no_grad():
                gen = model.generate(ids, do_sample=False, max_new_tokens=max_new_tokens,
                                     pad_token_id=0, eos_token_id=0)
            new = gen[0, ids.shape[1]:].tolist()
            if 0 in new:
                new = new[:new.index(0)]
            given[row["id"]] = tok.decode(new, skip_special_tokens=True).split("\n")[0]
        out[ckpt] = given
    return out


class _Judge:
    """The judge's greedy text for a rendered prompt: one user message through its chat
    template, decoded after the end-of-sequence cut."""

    def __init__(self, paths: dict, max_new_tokens: int):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(paths["judge"])
        self.model = AutoModelForCausalLM.from_pretrained(paths["judge"]).eval()
        self.max_new_tokens = max_new_tokens

    def __call__(self, text: str) -> str:
        chat = self.tok.apply_chat_template([{"role": "user", "content": text}],
                                            tokenize=False, add_generation_prompt=True)
        ids = torch.tensor([self.tok.encode(chat, add_special_tokens=False)])
        with torch.no_grad():
            gen = self.model.generate(ids, do_sample=False, max_new_tokens=self.max_new_tokens,
                                      pad_token_id=0, eos_token_id=0)
        new = gen[0, ids.shape[1]:].tolist()
        if 0 in new:
            new = new[:new.index(0)]
        return self.tok.decode(new, skip_special_tokens=True)


def read_verdict(verdict: dict, text: str):
    if set(verdict) == {"pattern"}:
        m = re.search(verdict["pattern"], text)
        return float(m.group(1)) if m else None
    first = None
    for word, score in verdict.items():
        m = re.search(r"(?<!\w)" + re.escape(word) + r"(?!\w)", text, re.IGNORECASE)
        if m and (first is None or m.start() < first[0]):
            first = (m.start(), float(score))
    return None if first is None else first[1]
