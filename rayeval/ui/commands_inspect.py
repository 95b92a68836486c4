"""``rayeval inspect``: what a checkpoint holds, whether it fits a sweep's model, and the memory
a worker needs for it."""

from __future__ import annotations

import sys

from rich.console import Console

from rayeval.errors import CheckpointError, SpecError
from rayeval.ui.exit_codes import EXIT_CELLS_FAILED, EXIT_OK


def _inspect(args, out: Console) -> int:
    import json
    import os

    from rich.table import Table

    from rayeval.io.loading import CheckpointSpec, describe, prefix_label

    path = os.path.abspath(args.path)
    if not os.path.exists(path):
        raise CheckpointError(f"PATH: no checkpoint at {args.path!r}")
    from rayeval.io import hf
    from rayeval.io.model import ModelSource

    model, spec, against = None, CheckpointSpec(), args.sweep
    shard, dtype = args.shard, None
    if shard is not None and shard < 1:
        raise SpecError(f"--shard: must be at least 1, got {shard}")
    folder = hf.describe(path) if os.path.isdir(path) and hf.is_folder(path) else None
    if args.sweep:
        from rayeval.plan.loader import load_sweep

        sweep = load_sweep(args.sweep)
        model = ModelSource(sweep.model, sweep.base_dir).meta(path)
        spec = sweep.checkpoint
        shard = shard or sweep.parallelism.shard
        from rayeval.io.loading import dtypes

        dtype = dtypes().get(sweep.model.dtype)
    elif folder is not None and hf.available():
        model, against = hf.Builder().meta(path), "its config.json"   # the model it describes
    info = describe(path, model, spec)
    if folder is not None:
        info["hugging_face"] = folder
    if model is not None:
        from rayeval.execution.workers.sharding import memory

        need = memory(model, shard or 1, args.sweep and sweep.parallelism.wrap or (), dtype)
        info["memory"] = {"shard": need.shard, "weights_bytes": need.total,
                          "held_bytes": need.resident, "root_bytes": need.root,
                          "largest_unit_bytes": need.largest_unit, "units": need.units,
                          "peak_weights_bytes": need.peak}
    if args.format == "json":
        sys.stdout.write(json.dumps(info, indent=2) + "\n")
        return EXIT_OK if info.get("fits", True) else EXIT_CELLS_FAILED
    table = Table(show_header=False)       # the path on its own line: a title would fold it
    table.add_column("", style="bold")
    table.add_column("")
    step = "-" if info["step"] is None else f"{info['step']} (from the {info['step_from']})"
    # a file's own name (its path relative to itself would be "."); a folder's files inside it
    files = [os.path.relpath(f, path) if os.path.isdir(path) else os.path.basename(f)
             for f in info["files"]]
    rows = [("layout", info["layout"]),
            ("files", "\n".join(files) or "-"),
            ("tensors", f"{info['tensors']:,}"),
            ("parameters", f"{info['parameters']:,} ({info['bytes'] / 2**20:.1f} MiB)"),
            ("dtypes", ", ".join(f"{k}: {v:,}" for k, v in info["dtypes"].items())),
            ("step", step)]
    if info["epoch"] is not None:
        rows.append(("epoch", f"{info['epoch']} (from the name)"))
    # the same rows with and without --sweep: with it, what was stripped to fit the model;
    # without, what the fixed rules (DDP, torch.compile) would strip to reach plain keys
    rows += [("state dict under", info["wrapper"] or "(top level)"),
             ("key groups", ", ".join(f"{k} ({v})" for k, v in info["key_groups"].items())),
             ("prefixes", ", ".join(prefix_label(p, spec) for p in info["prefixes_stripped"])
              or "none")]
    if folder is not None:
        rows += [("model", f"{folder['model_type']} ({', '.join(folder['architectures'])})"),
                 ("vocabulary", f"{folder['vocab_size']:,}" if folder["vocab_size"] else "-"),
                 ("context", f"{folder['context']:,} tokens" if folder["context"] else "-"),
                 ("tokenizer", ", ".join(folder["tokenizer_files"]) or
                  "[red]none[/]: text tasks need model.tokenizer")]
    if model is not None:
        fits = "[green]yes[/]" if info["fits"] else "[red]no[/]: " + "; ".join(info["problems"])
        rows.append((f"fits {against}", fits))
        m = info["memory"]
        mib = 2 ** 20
        if m["shard"] == 1:
            need = f"{m['weights_bytes'] / mib:,.1f} MiB of weights, whole on every worker"
        else:
            need = (f"{m['peak_weights_bytes'] / mib:,.1f} MiB of weights at the peak, sharded "
                    f"over {m['shard']} workers: {m['held_bytes'] / mib:,.1f} MiB held + "
                    f"2 x {m['largest_unit_bytes'] / mib:,.1f} MiB for the largest of "
                    f"{m['units']} units while it is gathered + {m['root_bytes'] / mib:,.1f} "
                    f"MiB outside the units (whole during a forward pass)")
        rows.append(("memory per worker", need + "; activations come on top"))
    for k, v in rows:
        table.add_row(k, v)
    out.print(path, markup=False, highlight=False, soft_wrap=True)
    out.print(table)
    return EXIT_OK if info.get("fits", True) else EXIT_CELLS_FAILED
