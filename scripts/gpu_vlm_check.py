"""GPU check of the vision-language path: rayeval's Hugging Face backend on image+text items on
one GPU, greedy token ids item by item against transformers' own ``generate`` on each item
alone on the same GPU, for batch sizes 1 and 16 (lmms-eval's users report scores that change
with the batch size: lmms-eval issue #236); and the same ids on CPU.

The models are the tiny untrained Idefics3, LLaVA and Qwen2-VL of tests/vlm_support.py (float32,
built from configs; Qwen2-VL only where torchvision is installed, which its processor needs), loaded as rayeval loads a checkpoint (``ModelSource.loader`` onto the device);
the items are easy-vqa test questions (real 64x64 images). No Ray: the backend in one process,
as a worker runs it. Prints one JSON object; exit status 1 when an item's ids differ.

    python scripts/gpu_vlm_check.py [--items 64] [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), os.path.join(os.path.dirname(HERE), "tests")]

NEW_TOKENS = 6


def _through_eos(tokens, eos):
    return tokens[:tokens.index(eos) + 1] if eos in tokens else tokens


def check(family: str, folder: str, items, device: str) -> dict:
    import torch

    from rayeval.config.schema import CheckpointSpec, DatasetSpec, Generation, ModelSpec
    from rayeval.core.backends import ImageRequest, Setup, create
    from rayeval.core.backends.base import Context
    from rayeval.io import images as image_io
    from rayeval.io.model import ModelSource

    source = ModelSource(ModelSpec(), "")
    out = {}
    for where in (device, "cpu"):
        dev = torch.device(where)
        model, _ = source.loader(dev, CheckpointSpec()).load(folder)
        model.eval()
        proc = source.tokenizer(folder, model)
        requests = []
        for it in items:
            with open(it["image"], "rb") as f:
                pictures = [image_io.decode_bytes(f.read())]
            prompt = proc.render(it["question"], 1)
            requests.append(ImageRequest(prompt, tuple(pictures), proc.inputs(prompt, pictures)))
        alone = []
        start = time.perf_counter()
        with torch.inference_mode():
            for r in requests:
                inputs = {k: v.to(dev) for k, v in r.inputs.items()}
                ref = model.generate(**inputs, do_sample=False, max_new_tokens=NEW_TOKENS,
                                     pad_token_id=proc.tokenizer.pad_token_id,
                                     eos_token_id=proc.eos_id)
                alone.append(_through_eos(ref[0, inputs["input_ids"].shape[1]:].tolist(),
                                          proc.eos_id))
        seconds = {"transformers_alone": time.perf_counter() - start}
        backend = create("hf", Setup(device=dev))
        backend.serve(model)
        got = {}
        for batch in (1, 16):
            ctx = Context(spec=DatasetSpec(path=""), task="generation", text=proc,
                          generation=Generation(until=(), max_new_tokens=NEW_TOKENS),
                          batch=batch)
            start = time.perf_counter()
            tokens = []
            with torch.inference_mode():
                for i in range(0, len(requests), batch):
                    tokens += backend.image_tokens(requests[i:i + batch], ctx)
            seconds[f"rayeval_batch{batch}"] = time.perf_counter() - start
            got[batch] = [_through_eos(t, proc.eos_id) for t in tokens]
        out[where] = {"alone": alone, "got": got, "seconds": seconds}
    gpu, cpu = out[device], out["cpu"]
    differ = {f"batch{b}_vs_alone": sum(a != g for a, g in zip(gpu["alone"], gpu["got"][b]))
              for b in (1, 16)}
    differ["gpu_vs_cpu_alone"] = sum(a != c for a, c in zip(gpu["alone"], cpu["alone"]))
    return {"family": family, "items": len(items),
            "distinct_generations": len({tuple(t) for t in gpu["alone"]}),
            "items_differing": differ,
            "seconds": {where: {k: round(v, 3) for k, v in out[where]["seconds"].items()}
                        for where in out}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--items", type=int, default=64)
    p.add_argument("--device", default="cuda")
    args = p.parse_args(argv)
    import torch

    from vlm_support import (build_tiny_llava, build_tiny_qwen2vl, build_tiny_vlm,
                             easy_vqa_items, item_texts)

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("no GPU found", file=sys.stderr)
        return 2
    root = tempfile.mkdtemp(prefix="rayeval-gpu-vlm-")
    texts = item_texts(easy_vqa_items("train", n=500))
    items = easy_vqa_items("test", n=args.items, seed=1)
    results = [check("idefics3", build_tiny_vlm(os.path.join(root, "idefics3"), texts), items,
                     args.device),
               check("llava", build_tiny_llava(os.path.join(root, "llava"), texts), items,
                     args.device)]
    try:
        qwen = build_tiny_qwen2vl(os.path.join(root, "qwen2_vl"), texts)
    except ImportError as e:            # no torchvision: its video processor cannot be built
        results.append({"family": "qwen2_vl", "skipped": str(e).splitlines()[0]})
    else:
        try:
            results.append(check("qwen2_vl", qwen, items, args.device))
        except Exception as e:          # noqa: BLE001 - reported, the other families stand
            results.append({"family": "qwen2_vl", "error": f"{type(e).__name__}: {e}"})
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    print(json.dumps({"device": name, "torch": torch.__version__, "results": results}, indent=1))
    bad = any("error" in r for r in results) or any(
        r["items_differing"][k] for r in results if "items_differing" in r
        for k in ("batch1_vs_alone", "batch16_vs_alone"))
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
