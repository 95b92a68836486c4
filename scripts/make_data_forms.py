"""Write one evaluation set of the digits example in every form rayeval reads, with a sweep
that evaluates all of them: each form must give the numbers parquet gives.

    python scripts/make_data_forms.py OUT [--data configs/digits/data/clean.parquet]
                                          [--rows N] [--ckpts configs/digits/ckpts]

OUT gets:
    digits.parquet    the rows as they are, plus `path` (every form's row id)
    digits.jsonl      JSON lines: pixels as a list
    digits.csv        one column per pixel (p00..p63): forms:stack_pixels makes the tensor
    digits_hf/        a Hugging Face `save_to_disk` folder (needs the `datasets` package)
    digits_images/    one 8-bit PNG per row, in a folder per label (pixels are 1/64 steps in
                      [-2, 2), so k/64 survives as the byte k + 128): forms:decode_png makes
                      the tensor
    forms.py          the two transforms
    sweep.yaml        the example's model and checkpoints, one evaluation per form
Every form has the same `path` column ("LABEL/ROW.png", the images' own relative paths), which
every evaluation uses as its row id, so intervals match bit for bit too.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLE = os.path.join(os.path.dirname(HERE), "configs", "digits")

FORMS_MODULE = '''"""Transforms for the digits example's CSV and image forms."""
import io

import numpy as np
import torch
from PIL import Image


def stack_pixels(table):
    """The CSV form's 64 pixel columns as one float32 (rows, 64) tensor."""
    cols = [table.column(f"p{i:02d}").to_numpy().astype(np.float32) for i in range(64)]
    return torch.from_numpy(np.stack(cols, axis=1))


def decode_png(table):
    """8-bit PNGs of 8x8 glyphs (the byte k + 128) back to the pixels k/64 as float32."""
    rows = [(np.asarray(Image.open(io.BytesIO(b)), dtype=np.float32).reshape(64) - 128) / 64
            for b in table.column("image").to_pylist()]
    return torch.from_numpy(np.stack(rows)) if rows else torch.zeros((0, 64))
'''

FORMS = {   # evaluation name -> dataset mapping (relative to OUT)
    "parquet": {"path": "digits.parquet", "inputs": "pixels"},
    "jsonl": {"path": "digits.jsonl", "inputs": "pixels"},
    "csv": {"path": "digits.csv", "transform": "forms:stack_pixels"},
    "hf": {"path": "digits_hf", "inputs": "pixels"},
    "images": {"path": "digits_images", "inputs": "image", "transform": "forms:decode_png"},
}


def write(out: str, data: str, rows: int | None, ckpts: str, forms=tuple(FORMS)) -> str:
    """Write the forms into ``out``; the sweep file's path."""
    os.makedirs(out, exist_ok=True)
    table = pq.read_table(data)
    if rows is not None:
        table = table.slice(0, rows)
    pixels = np.asarray(table.column("pixels").to_pylist(), dtype=np.float32)
    steps = pixels * 64
    if not np.array_equal(steps, np.round(steps)) or steps.min() < -128 or steps.max() > 127:
        raise SystemExit(f"{data}: pixels are not k/64 steps in [-2, 2); PNG cannot hold "
                         "them exactly")
    labels = table.column("label").to_pylist()
    ids = table.column("row").to_pylist()
    paths = [f"{label}/{row:05d}.png" for label, row in zip(labels, ids)]
    table = table.append_column("path", pa.array(paths, pa.string()))
    pq.write_table(table, os.path.join(out, "digits.parquet"), row_group_size=256)
    if "jsonl" in forms:
        with open(os.path.join(out, "digits.jsonl"), "w") as f:
            for r in table.to_pylist():
                f.write(json.dumps(r) + "\n")
    if "csv" in forms:
        cols = {f"p{i:02d}": pixels[:, i] for i in range(64)}
        cols.update(label=labels, row=ids, path=paths)
        pacsv.write_csv(pa.table(cols), os.path.join(out, "digits.csv"))
    if "hf" in forms:
        import datasets

        shutil.rmtree(os.path.join(out, "digits_hf"), ignore_errors=True)
        datasets.Dataset(table).save_to_disk(os.path.join(out, "digits_hf"))
    if "images" in forms:
        from PIL import Image

        root = os.path.join(out, "digits_images")
        shutil.rmtree(root, ignore_errors=True)
        for k, rel in zip((steps + 128).astype(np.uint8), paths):
            os.makedirs(os.path.dirname(os.path.join(root, rel)), exist_ok=True)
            Image.fromarray(k.reshape(8, 8), mode="L").save(os.path.join(root, rel))
    with open(os.path.join(out, "forms.py"), "w") as f:
        f.write(FORMS_MODULE)
    evals = [{"name": name, "task": "classification", "metrics": ["accuracy", "macro_f1", "nll"],
              "dataset": {**FORMS[name], "target": "label", "id": "path"}} for name in forms]
    sweep = {"name": "forms", "model": {"factory": "my_models:build_mlp",
                                        "kwargs": {"hidden": 32}},
             "checkpoints": [os.path.join(os.path.abspath(ckpts), "step_*")], "evals": evals,
             "batch_size": 128, "workers": 2, "output": "out"}
    shutil.copy(os.path.join(EXAMPLE, "my_models.py"), os.path.join(out, "my_models.py"))
    path = os.path.join(out, "sweep.yaml")
    import yaml

    with open(path, "w") as f:
        yaml.safe_dump(sweep, f, sort_keys=False)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--data", default=os.path.join(EXAMPLE, "data", "clean.parquet"))
    ap.add_argument("--rows", type=int, default=None)
    ap.add_argument("--ckpts", default=os.path.join(EXAMPLE, "ckpts"))
    args = ap.parse_args()
    print(write(args.out, args.data, args.rows, args.ckpts))


if __name__ == "__main__":
    main()
