"""Make the shipped example in configs/digits: two evaluation sets of 8x8 digit glyphs (clean
and noisy), an MLP trained on noisy glyphs, and its checkpoints in several layouts.
Deterministic; run it again to rebuild the files.

    python scripts/make_example.py [--out configs/digits] [--data-only]

Files (the sweep files next to them name these paths):
    data/clean.parquet   1,009 glyphs with light noise (sigma 0.1), pixels at 1/64 steps  -> clean
    data/eval.parquet    2,003 glyphs with heavy noise (sigma 0.45)                        -> noisy
    ckpts/               steps 20 and 60 (torch.save), 200 (safetensors), 600 (DCP folder)

The same seeds give the same data files byte for byte on any machine (numpy's generator is
portable). Training is deterministic on one machine, but CPU kernels round differently from one
machine to the next (weights differ by ~1e-7), so rebuilt checkpoints need not match committed
ones bit for bit: ``--data-only`` rebuilds the data sets and keeps the checkpoints.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import example_files  # noqa: E402

# 5x7 glyphs for 0-9, one string per row, '#' = ink.
GLYPHS = [
    [" ### ", "#   #", "#  ##", "# # #", "##  #", "#   #", " ### "],
    ["  #  ", " ##  ", "  #  ", "  #  ", "  #  ", "  #  ", " ### "],
    [" ### ", "#   #", "    #", "   # ", "  #  ", " #   ", "#####"],
    ["#####", "   # ", "  #  ", "   # ", "    #", "#   #", " ### "],
    ["   # ", "  ## ", " # # ", "#  # ", "#####", "   # ", "   # "],
    ["#####", "#    ", "#### ", "    #", "    #", "#   #", " ### "],
    ["  ## ", " #   ", "#    ", "#### ", "#   #", "#   #", " ### "],
    ["#####", "    #", "   # ", "  #  ", " #   ", " #   ", " #   "],
    [" ### ", "#   #", "#   #", " ### ", "#   #", "#   #", " ### "],
    [" ### ", "#   #", "#   #", " ####", "    #", "   # ", " ##  "],
]


def make_digits(n: int, seed: int, noise: float = 0.45) -> tuple[np.ndarray, np.ndarray]:
    """n noisy glyph images (n, 64) float32 and their labels (n,) int64."""
    rng = np.random.default_rng(seed)
    templates = np.zeros((10, 7, 5), dtype=np.float32)
    for d, rows in enumerate(GLYPHS):
        for r, row in enumerate(rows):
            templates[d, r] = [c == "#" for c in row]
    labels = rng.integers(0, 10, size=n)
    images = np.zeros((n, 8, 8), dtype=np.float32)
    dy = rng.integers(0, 2, size=n)
    dx = rng.integers(0, 4, size=n)
    for i in range(n):
        images[i, dy[i]:dy[i] + 7, dx[i]:dx[i] + 5] = templates[labels[i]]
    images += rng.normal(0.0, noise, size=images.shape).astype(np.float32)
    return images.reshape(n, 64), labels.astype(np.int64)


def make_clean_digits(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """n lightly noisy glyphs: sigma 0.1, pixel values rounded to multiples of 1/64 (an image's
    integer levels), which also keeps the file small (parquet dictionary-encodes them)."""
    x, y = make_digits(n, seed=seed, noise=0.1)
    return (np.round(x * 64) / 64).astype(np.float32), y


def write_parquet(path: str, x: np.ndarray, y: np.ndarray) -> None:
    pixels = pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1), pa.float32()), 64)
    table = pa.table({"row": pa.array(np.arange(len(y)), pa.int64()), "pixels": pixels,
                      "label": pa.array(y, pa.int64())})
    pq.write_table(table, path, compression="zstd")


SHIPPED = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "configs",
                                        "digits"))
HAND_WRITTEN = ("my_models.py", "my_metrics.py", "sweep.yaml", "sweep_metrics.yaml",
                "sweep_s3.yaml")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=SHIPPED,
                        help="the example's folder; the shipped sweep files and modules are "
                             "copied there when it lacks them")
    parser.add_argument("--rows", type=int, default=2003,
                        help="noisy evaluation rows (prime on purpose: no worker count divides it)")
    parser.add_argument("--clean-rows", type=int, default=1009, help="clean evaluation rows")
    parser.add_argument("--data-only", action="store_true",
                        help="rebuild the data sets only and keep the checkpoints")
    args = parser.parse_args(argv)
    os.makedirs(os.path.join(args.out, "data"), exist_ok=True)
    for name in HAND_WRITTEN:
        if not os.path.exists(os.path.join(args.out, name)):
            shutil.copy(os.path.join(SHIPPED, name), args.out)

    torch.manual_seed(0)
    ex, ey = make_digits(args.rows, seed=1)
    write_parquet(os.path.join(args.out, "data", "eval.parquet"), ex, ey)
    cx, cy = make_clean_digits(args.clean_rows, seed=3)
    write_parquet(os.path.join(args.out, "data", "clean.parquet"), cx, cy)
    if args.data_only:
        print(f"wrote {args.clean_rows} clean and {args.rows} noisy rows under {args.out}")
        return 0

    ckpt_dir = os.path.join(args.out, "ckpts")
    example_files.clear(ckpt_dir)
    tx, ty = make_digits(4096, seed=2)
    tx, ty = torch.from_numpy(tx), torch.from_numpy(ty)

    sys.path.insert(0, args.out)
    from my_models import build_mlp

    model = build_mlp(hidden=32)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    saves = {20: "torch_ddp", 60: "torch_wrapped", 200: "safetensors", 600: "dcp"}
    with example_files.threads():
        for step in range(1, max(saves) + 1):
            idx = torch.randint(0, len(ty), (64,))
            loss = torch.nn.functional.cross_entropy(model(tx[idx]), ty[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            if step in saves:
                save(model, opt, step, saves[step], ckpt_dir)
    print(f"wrote {args.clean_rows} clean and {args.rows} noisy rows and {len(saves)} "
          f"checkpoints under {args.out}")
    return 0


def save(model, opt, step: int, layout: str, ckpt_dir: str) -> None:
    """One checkpoint in ``layout``, written whole or not at all (example_files.whole)."""
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    name = f"step_{step:06d}" + {"torch_ddp": ".pt", "torch_wrapped": ".pt",
                                 "safetensors": ".safetensors", "dcp": ""}[layout]
    with example_files.whole(os.path.join(ckpt_dir, name)) as path:
        if layout == "torch_ddp":      # DDP's module. prefix, bare state dict
            torch.save({f"module.{k}": v for k, v in state.items()}, path)
        elif layout == "torch_wrapped":  # a training checkpoint: compiled model under "model"
            torch.save({"model": {f"_orig_mod.{k}": v for k, v in state.items()},
                        "optimizer": opt.state_dict(), "step": step}, path)
        elif layout == "safetensors":
            from safetensors.torch import save_file

            save_file(state, path)
        elif layout == "dcp":
            import torch.distributed.checkpoint as dcp

            dcp.save({"model": state}, checkpoint_id=path, no_dist=True)


if __name__ == "__main__":
    raise SystemExit(main())
