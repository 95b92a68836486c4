"""Vision-language Hugging Face folders: which configs are image-text-to-text models, and their
processors.

A folder whose config's ``model_type`` is one of transformers' image-text-to-text models
(``AutoModelForImageTextToText``: Idefics3/SmolVLM, LLaVA, Qwen2-VL, ...) is built with that
auto class instead of the causal-LM one, in every layout rayeval loads (``hf.Builder``). Its
``AutoProcessor`` (image processor + tokenizer + chat template) is a ``Processor``: an
``hf.Tokenizer`` (so generation's stop strings, decoding and the text conventions are the
same) that also renders and processes image+text items. ``key`` covers the tokenizer files,
the processor's files and the context length: decoded image batches are kept per key, so
checkpoints sharing a processor share one decoding of every data set.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from rayeval.errors import CheckpointError, SpecError
from rayeval.io import hf

PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json",
                   "chat_template.jinja", "chat_template.json")


def model_type(folder: str) -> str | None:
    """The ``model_type`` of a folder's config.json (read as JSON, no transformers)."""
    try:
        with open(os.path.join(folder, hf.CONFIG), encoding="utf-8") as f:
            return json.load(f).get("model_type")
    except (OSError, ValueError):
        return None


def has_processor(folder: str) -> bool:
    return any(os.path.isfile(os.path.join(folder, n))
               for n in ("processor_config.json", "preprocessor_config.json"))


def processor_digest(folder: str) -> str:
    return hf.files_digest(folder, PROCESSOR_FILES, seed=hf.tokenizer_digest(folder).encode())


@dataclass
class Processor(hf.Tokenizer):
    """A checkpoint's ``AutoProcessor`` beside its tokenizer (``tokenizer`` is the processor's
    own): what turns a prompt and its images into the model's inputs."""
    processor: Any = None

    def render(self, question: str, images: int) -> str:
        """The full prompt of a question with ``images`` images (``chat_prompt``)."""
        return chat_prompt(self.processor, question, images)

    def inputs(self, prompt: str, images: list) -> dict:
        """The processor's outputs for one item (tensors with a batch dimension of 1)."""
        from PIL import Image

        pil = [Image.fromarray(a) for a in images]
        out = self.processor(text=[prompt], images=[pil] if pil else None, return_tensors="pt")
        return {k: v for k, v in out.items() if hasattr(v, "shape")}


def chat_prompt(processor, question: str, images: int) -> str:
    """The full prompt of a question with ``images`` images, as lmms-eval's generic
    ``huggingface`` chat model renders it (``lmms_eval/models/chat/huggingface.py``): one user
    turn whose content is the images then the text, through the processor's chat template with
    the generation prompt. ``processor``: a transformers processor (or anything with its
    ``apply_chat_template``)."""
    content = [{"type": "image"} for _ in range(images)]
    content.append({"type": "text", "text": question})
    return render_messages(processor, [{"role": "user", "content": content}])


def render_messages(processor, messages: list) -> str:
    """Chat messages (Hugging Face's form: content parts ``{"type": "image"}`` and
    ``{"type": "text", "text": ...}``) as the prompt the model continues."""
    return processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def load_processor(folder: str, *, what: str, model=None,
                   configured_max: int | None = None) -> Processor:
    """The processor of a vision-language folder; one-line errors when it has none or
    transformers cannot read it."""
    transformers = hf.require()
    error = SpecError if what == "model.tokenizer" else CheckpointError
    if not has_processor(folder):
        raise error(f"{what}: {folder}: no processor files (processor_config.json or "
                    "preprocessor_config.json) beside this vision-language model; save the "
                    "processor with it (AutoProcessor...save_pretrained(folder))")
    processor = hf.from_folder(transformers.AutoProcessor, folder, what, error, "processor")
    tok = getattr(processor, "tokenizer", None)
    if tok is None or getattr(processor, "image_processor", None) is None:
        raise error(f"{what}: {folder}: its processor ({type(processor).__name__}) has no "
                    "image processor and tokenizer; it is not a vision-language processor")
    if getattr(processor, "chat_template", None) is None:
        raise error(f"{what}: {folder}: the processor has no chat template; image items are "
                    "rendered with it (save one: processor.chat_template = ...)")
    hf.check_prefix_token(tok, error, f"{what}: {folder}")
    length = hf.context_length(tok, model, configured_max)
    return Processor(tok, length, f"{processor_digest(folder)}:{length}:vision", processor)


def check_image_model(tokenizer, model, folder: str | None, key_path: str) -> None:
    """Before Ray starts, for an evaluation with ``dataset.images``: the model must be a
    vision-language model and its folder must hold its processor (one line each)."""
    if isinstance(tokenizer, Processor):
        return
    kind = getattr(getattr(model, "config", None), "model_type", None)
    where = folder or "model.factory"
    if not hf.is_vision_type(kind):
        what = f"model_type {kind!r}" if kind else type(model).__name__
        raise SpecError(f"{key_path}.images: {where}: {what} is not a vision-language model "
                        "(transformers' AutoModelForImageTextToText); image items need one, or "
                        "drop dataset.images", key_path=f"{key_path}.images")
    load_processor(folder or "", what="checkpoint")       # raises: none there, or unreadable
