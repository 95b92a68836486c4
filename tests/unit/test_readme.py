"""The README's Quickstart block holds exactly two commands, and CI runs the second."""

import os
import re

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def quickstart_commands() -> list[str]:
    text = open(os.path.join(REPO, "README.md"), encoding="utf-8").read()
    section = text.split("## Quickstart", 1)[1]
    block = re.search(r"```(?:bash|sh)?\n(.*?)```", section, re.S).group(1)
    return [ln for ln in block.splitlines() if ln.strip()]


def test_quickstart_has_two_commands_pinning_cpu_torch():
    commands = quickstart_commands()
    assert len(commands) == 2
    assert all("torch==2.13.0" in c for c in commands)
    assert "rayeval run configs/digits/sweep.yaml" in commands[0]


def test_ci_runs_the_readme_test_command():
    ci = open(os.path.join(REPO, ".ci", "run"), encoding="utf-8").read().splitlines()
    assert quickstart_commands()[1] in ci


def test_every_sweep_key_is_documented():
    from rayeval.config.loader import (DATASET_KEYS, EVAL_KEYS, MLFLOW_KEYS, PARALLELISM_KEYS, SWEEP_KEYS,
                              WANDB_KEYS)

    text = open(os.path.join(REPO, "README.md"), encoding="utf-8").read()
    sections = {"model", "bootstrap", "checkpoint", "recovery", "watch", "trackers",
                "parallelism"}
    keys = sorted(SWEEP_KEYS - sections) + ["evals", "dataset.name"]
    keys += [f"evals[i].{k}" for k in sorted(EVAL_KEYS - {"dataset"})]
    keys += [f"evals[i].dataset.{k}" for k in sorted(DATASET_KEYS)]
    keys += ["model.factory", "model.kwargs", "model.dtype", "checkpoint.key",
             "checkpoint.strip_prefix", "checkpoint.trust_pickle", "bootstrap.replicates",
             "bootstrap.confidence", "bootstrap.seed", "bootstrap.buckets",
             "recovery.max_restarts", "recovery.stall_timeout_s", "model.tokenizer",
             "model.max_length", "watch.ready", "watch.order"]
    keys += [f"parallelism.{k}" for k in sorted(PARALLELISM_KEYS)]
    keys += [f"trackers.mlflow.{k}" for k in sorted(MLFLOW_KEYS)]
    keys += [f"trackers.wandb.{k}" for k in sorted(WANDB_KEYS)]
    for key in keys:
        assert f"| `{key}` |" in text, key
