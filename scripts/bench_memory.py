"""Benchmark: peak resident memory of a Ray Train worker evaluating a large checkpoint.

Writes a ~400 MB checkpoint (torch.save and safetensors) of a stack of 4096x4096 linear
layers, evaluates each with `rayeval run` machinery on one worker, and prints the worker's peak
RSS above its baseline (before the model is built) against the checkpoint's size.
Target: within 1.3x.

    python scripts/bench_memory.py [--layers 6] [--width 4096]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

MODEL = '''
import torch

def build(width=4096, layers=6, classes=10):
    mods = []
    for _ in range(layers):
        mods += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*mods, torch.nn.Linear(width, classes))
'''


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--width", type=int, default=4096)
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args(argv)
    from rayeval.driver import run_sweep
    from rayeval.spec import load_sweep

    figures = []
    with tempfile.TemporaryDirectory(prefix="rayeval-mem-") as root:
        with open(os.path.join(root, "big_model.py"), "w") as f:
            f.write(MODEL)
        sys.path.insert(0, root)
        from big_model import build

        rng = np.random.default_rng(0)
        x = rng.normal(size=(256, args.width)).astype(np.float32)
        pq.write_table(pa.table({"x": pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1)),
                                                                        args.width),
                                 "y": pa.array(rng.integers(0, 10, 256))}),
                       os.path.join(root, "eval.parquet"))
        os.makedirs(os.path.join(root, "ckpts"))
        state = build(args.width, args.layers).state_dict()
        torch.save(state, os.path.join(root, "ckpts", "step_1.pt"))
        from safetensors.torch import save_file

        save_file(state, os.path.join(root, "ckpts", "step_2.safetensors"))
        del state
        for name in ("step_1.pt", "step_2.safetensors"):
            with open(os.path.join(root, f"{name}.yaml"), "w") as f:
                f.write(f"""name: mem
model: {{factory: "big_model:build", kwargs: {{width: {args.width}, layers: {args.layers}}}}}
checkpoints: [ckpts/{name}]
dataset: {{path: eval.parquet, inputs: x, target: y}}
task: classification
metrics: [accuracy]
batch_size: 64
workers: 1
output: out
bootstrap: {{replicates: 0}}
""")
            size = os.path.getsize(os.path.join(root, "ckpts", name))
            report = run_sweep(load_sweep(os.path.join(root, f"{name}.yaml")), force=True)
            o = report.outcomes[0]
            assert o.ok, o
            above = o.peak_rss_bytes - o.baseline_rss_bytes
            figures.append({"checkpoint": name, "layout": o.layout, "bytes": size,
                            "peak_above_baseline_bytes": above, "ratio": round(above / size, 3)})
            print(f"{name:22s} {o['layout']:12s} checkpoint {size / 2**20:7.1f} MiB, worker peak "
                  f"RSS above baseline {above / 2**20:7.1f} MiB, ratio {above / size:.2f}x "
                  "(target <= 1.3x)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
