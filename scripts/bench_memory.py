"""Benchmark: peak resident memory of a Ray Train worker evaluating a large checkpoint, whole
and sharded over N workers (``parallelism: {shard: N}``).

Writes a ~400 MB checkpoint (torch.save, safetensors and a torch.distributed.checkpoint folder)
of a stack of 4096x4096 linear layers, evaluates it with `rayeval run` machinery on 4 workers as
4 replicas of 1 rank, 2 of 2 and 1 of 4, and prints rank 0's peak RSS above its baseline (before
the model is built) against the checkpoint's size, with the wall time of each run.
Targets: within 1.3x of the checkpoint whole; sharded, about size / N plus one layer.

    python scripts/bench_memory.py [--layers 6] [--width 4096] [--shards 1,2,4] [--workers 4]
"""

from __future__ import annotations

import os
import sys
import tempfile

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchkit  # noqa: E402

MODEL = '''
import torch

class Stack(torch.nn.Module):
    """Linear layers in a ModuleList: each is a unit when the model is sharded."""

    def __init__(self, width=4096, layers=6, classes=10):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(layers))
        self.head = torch.nn.Linear(width, classes)

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.head(x)

def build(width=4096, layers=6, classes=10):
    return Stack(width, layers, classes)
'''


def main(argv=None) -> int:
    p = benchkit.parser(__doc__)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--width", type=int, default=4096)
    p.add_argument("--shards", default="1,2,4", help="values of parallelism.shard")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--layouts", default="torch,safetensors,dcp")
    args = p.parse_args(argv)
    import ray
    import torch.distributed.checkpoint as dcp

    from rayeval.execution.driver import run_sweep
    from rayeval.plan.loader import load_sweep

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
        names = {"torch": "step_1.pt", "safetensors": "step_2.safetensors", "dcp": "step_3"}
        torch.save(state, os.path.join(root, "ckpts", names["torch"]))
        from safetensors.torch import save_file

        save_file(state, os.path.join(root, "ckpts", names["safetensors"]))
        dcp.save(state, checkpoint_id=os.path.join(root, "ckpts", names["dcp"]), no_dist=True)
        size = sum(t.numel() * t.element_size() for t in state.values())
        del state
        ray.init(num_cpus=args.workers + 2, include_dashboard=False, log_to_driver=False,
                 _system_config={"worker_maximum_startup_concurrency": 2 * args.workers + 4})
        try:
            for shard in [int(n) for n in args.shards.split(",")]:
                for layout in args.layouts.split(","):
                    name = names[layout]
                    sweep = os.path.join(root, f"{layout}-{shard}.yaml")
                    with open(sweep, "w") as f:
                        f.write(f"""name: mem
model: {{factory: "big_model:build", kwargs: {{width: {args.width}, layers: {args.layers}}}}}
checkpoints: [ckpts/{name}]
dataset: {{path: eval.parquet, inputs: x, target: y}}
task: classification
metrics: [accuracy]
batch_size: 64
workers: {args.workers}
parallelism: {{shard: {shard}}}
output: out
bootstrap: {{replicates: 0}}
""")
                    with benchkit.Stopwatch() as took:
                        report = run_sweep(load_sweep(sweep), force=True)
                    seconds = took.s
                    o = report.outcomes[0]
                    assert o.ok, o
                    above = o.peak_rss_bytes - o.baseline_rss_bytes
                    loaded = o.loaded_rss_bytes - o.baseline_rss_bytes
                    figures.append({"shard": shard, "layout": o.layout, "bytes": size,
                                    "peak_above_baseline_bytes": above,
                                    "loaded_above_baseline_bytes": loaded,
                                    "ratio": round(above / size, 3), "seconds": round(seconds, 1),
                                    "value": o.values[0][1]})
                    print(f"shard {shard}  {o.layout:12s} weights {size / 2**20:6.1f} MiB "
                          f"(size/N {size / shard / 2**20:5.1f} MiB); rank 0 above its baseline:"
                          f" loaded {loaded / 2**20:6.1f} MiB ({loaded / size:.2f}x), peak of the "
                          f"pass {above / 2**20:6.1f} MiB ({above / size:.2f}x); run "
                          f"{seconds:.1f} s, accuracy {o.values[0][1]:.4f}", flush=True)
        finally:
            ray.shutdown()
    benchkit.record(args.json, {"runs": figures})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
