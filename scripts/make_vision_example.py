"""Make the vision example in configs/vision: synthetic 16x16 RGB images of three shapes, stored
as PNG bytes in parquet, a tiny CNN trained on them briefly, and three of its checkpoints. Its
sweep decodes the images with a dataset.transform. Deterministic; run it again to rebuild.

    python scripts/make_vision_example.py [--out configs/vision]

Files (the sweep file next to them names these paths):
    data/shapes.parquet   401 images: id, image (PNG bytes), label (0 circle, 1 square, 2 triangle)
    data/dim.parquet      307 images taken at a lower exposure, and their brightness (0.3-0.6)
    ckpts/                steps 10 and 40 (torch.save), 300 (safetensors)

models.py, transforms.py and sweep.yaml are copied from configs/vision when --out lacks them.
The data files are the same bytes on any machine with the same PIL (its PNG encoder) and pyarrow;
training is deterministic on one machine, but CPU kernels round differently on another.
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from PIL import Image, ImageDraw

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import example_files  # noqa: E402

SHIPPED = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..",
                                        "configs", "vision"))
HAND_WRITTEN = ("models.py", "transforms.py", "sweep.yaml")
SIZE = 16
CLASSES = ("circle", "square", "triangle")


def make_images(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """n images (n, 16, 16, 3) uint8 of one shape each, of random size, place and colours, and
    their labels (n,) int64."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, len(CLASSES), size=n)
    images = np.zeros((n, SIZE, SIZE, 3), dtype=np.uint8)
    for i in range(n):
        background = tuple(int(v) for v in rng.integers(0, 90, size=3))
        ink = tuple(int(v) for v in rng.integers(120, 256, size=3))
        side = int(rng.integers(5, 12))
        x0, y0 = (int(v) for v in rng.integers(0, SIZE - side + 1, size=2))
        box = (x0, y0, x0 + side - 1, y0 + side - 1)
        img = Image.new("RGB", (SIZE, SIZE), background)
        draw = ImageDraw.Draw(img)
        if labels[i] == 0:
            draw.ellipse(box, fill=ink)
        elif labels[i] == 1:
            draw.rectangle(box, fill=ink)
        else:
            draw.polygon([(x0 + (side - 1) / 2, y0), (box[2], box[3]), (x0, box[3])], fill=ink)
        images[i] = np.asarray(img)
    return images, labels.astype(np.int64)


def png(image: np.ndarray) -> bytes:
    out = io.BytesIO()
    Image.fromarray(image, "RGB").save(out, format="PNG", optimize=True)
    return out.getvalue()


def write_parquet(path: str, images: np.ndarray, labels: np.ndarray, **extra) -> None:
    columns = {"id": pa.array(np.arange(len(labels)), pa.int64()),
               "image": pa.array([png(im) for im in images], pa.binary()),
               "label": pa.array(labels, pa.int64())}
    columns.update({k: pa.array(v) for k, v in extra.items()})
    pq.write_table(pa.table(columns), path, compression="zstd")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=SHIPPED, help="the example's folder")
    parser.add_argument("--rows", type=int, default=401, help="rows of data/shapes.parquet")
    parser.add_argument("--dim-rows", type=int, default=307, help="rows of data/dim.parquet")
    args = parser.parse_args(argv)
    os.makedirs(os.path.join(args.out, "data"), exist_ok=True)
    for name in HAND_WRITTEN:
        if not os.path.exists(os.path.join(args.out, name)):
            shutil.copy(os.path.join(SHIPPED, name), args.out)

    images, labels = make_images(args.rows, seed=1)
    write_parquet(os.path.join(args.out, "data", "shapes.parquet"), images, labels)
    images, labels = make_images(args.dim_rows, seed=2)
    brightness = np.random.default_rng(3).uniform(0.3, 0.6, size=args.dim_rows).astype(np.float32)
    dim = np.round(images * brightness.reshape(-1, 1, 1, 1)).astype(np.uint8)
    write_parquet(os.path.join(args.out, "data", "dim.parquet"), dim, labels,
                  brightness=brightness)

    ckpt_dir = os.path.join(args.out, "ckpts")
    example_files.clear(ckpt_dir)
    train_x, train_y = make_images(2048, seed=4)
    tx = torch.from_numpy(train_x.astype(np.float32) / 255).permute(0, 3, 1, 2).contiguous()
    ty = torch.from_numpy(train_y)

    sys.path.insert(0, args.out)
    from models import build_cnn

    torch.manual_seed(0)
    model = build_cnn(channels=8)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    saves = (10, 40, 300)
    with example_files.threads():
        for step in range(1, max(saves) + 1):
            idx = torch.randint(0, len(ty), (64,))
            loss = torch.nn.functional.cross_entropy(model(tx[idx]), ty[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            if step in saves:
                save(model, step, ckpt_dir)
    print(f"wrote {args.rows} + {args.dim_rows} images and {len(saves)} checkpoints under "
          f"{args.out}")
    return 0


def save(model: torch.nn.Module, step: int, ckpt_dir: str) -> None:
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    name = f"step_{step:06d}" + (".pt" if step < 100 else ".safetensors")
    with example_files.whole(os.path.join(ckpt_dir, name)) as path:    # whole or not at all
        if step < 100:        # a training checkpoint with the model under "model"
            torch.save({"model": state, "step": step}, path)
        else:
            from safetensors.torch import save_file

            save_file(state, path)


if __name__ == "__main__":
    raise SystemExit(main())
