"""Run by tests/integration/test_vllm_images.py in a process of its own (``python
tests/vllm_images_run.py OUT.json FOLDER...``): one vLLM engine (``VllmBackend``, as a
worker builds it) serves each tiny Idefics3 folder in turn, its weights loaded in place, and
generates easy-vqa items greedily from their prompts and images; transformers' own
``generate`` on the processor's inputs is the reference. Writes, per folder, both sides'
token ids and the backend's texts.

A process of its own: the engine's external launcher joins a process group (here a gloo group
of one, as a worker's Ray Train group of one would be), which must not outlive the test.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

ITEMS = 6
MAX_NEW_TOKENS = 8


def prompts(processor, items):
    """Each item's prompt as lmms-eval's generic chat model renders one: a user turn of the
    image then the question, with the generation prompt."""
    return [processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"},
                                      {"type": "text", "text": it["question"]}]}],
        add_generation_prompt=True) for it in items]


def reference(model, processor, prompt, image, eos) -> list[int]:
    import torch

    inputs = processor(text=prompt, images=[image], return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, do_sample=False, max_new_tokens=MAX_NEW_TOKENS)
    new = out[0, inputs["input_ids"].shape[1]:].tolist()
    return new[:new.index(eos) + 1] if eos in new else new


def main(out_path: str, folders: list[str]) -> None:
    import numpy as np
    import torch
    import torch.distributed as dist
    from PIL import Image
    from transformers import AutoProcessor, Idefics3ForConditionalGeneration

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from vlm_support import easy_vqa_items

    from rayeval.config.schema import DatasetSpec, Generation, ModelSpec
    from rayeval.core.backends.base import Context, ImageRequest, Setup
    from rayeval.core.backends.vllm import VllmBackend
    from rayeval.io.hf import Tokenizer

    with tempfile.TemporaryDirectory() as tmp:   # the group's rendezvous file
        dist.init_process_group("gloo", init_method=f"file://{tmp}/pg", rank=0, world_size=1)
        ranks = {"RANK": 0, "LOCAL_RANK": 0, "WORLD_SIZE": 1, "LOCAL_WORLD_SIZE": 1}
        spec = ModelSpec(backend="vllm", vllm={"max_model_len": 128, "enforce_eager": True})
        backend = VllmBackend(Setup(model=spec, tensor=1, ident=f"test-{os.getpid()}",
                                    ranks=ranks))
        items = easy_vqa_items("test", n=ITEMS, seed=3)
        images = [np.asarray(Image.open(it["image"]).convert("RGB")) for it in items]
        gen = Generation(max_new_tokens=MAX_NEW_TOKENS)
        result = []
        for folder in folders:
            model = Idefics3ForConditionalGeneration.from_pretrained(
                folder, dtype=torch.float32).eval()
            processor = AutoProcessor.from_pretrained(folder)
            tok = processor.tokenizer
            backend.serve(model, folder, None, folder)
            texts = prompts(processor, items)
            requests = [ImageRequest(prompt=p, images=(im,)) for p, im in zip(texts, images)]
            ids = [it["id"] for it in items]
            ours = [r[0] for r in backend.engine.generate_images(requests, ids, gen)]
            ctx = Context(spec=DatasetSpec(path="x", prompt="question"), task="generation",
                          text=Tokenizer(tok, 128, "t"), generation=gen)
            result.append({
                "folder": folder, "vllm": ours,
                "hf": [reference(model, processor, p, Image.fromarray(im), tok.eos_token_id)
                       for p, im in zip(texts, images)],
                "texts": [r[0] for r in backend.generate_images(requests, ids, ctx)],
                "decoded": [tok.decode([t for t in ids_ if t != tok.eos_token_id])
                            for ids_ in ours],
                "engine": id(backend.engine.llm)})
        with open(out_path, "w") as f:
            json.dump(result, f)
        # the group stays: vLLM's own shutdown at exit still uses it


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
