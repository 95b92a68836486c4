"""The quick tier is this folder: every test here is marked ``quick`` (``python -m pytest -m
quick`` runs exactly these) and must stay cheap, so each one runs under a guard that fails it if
it, or a fixture it uses, builds a transformers model, trains a tokenizer, runs lm-eval or
lmms-eval, starts a process group or worker processes, or starts Ray. Such a test belongs in
tests/models (tiny models, no Ray) or tests/integration. Importing transformers, lm-eval or Ray
to read a config, render a task or name an exception is allowed.

The guard replaces those entry points while a test of this folder is set up, runs and is torn
down (and only then), including in modules imported during it; each replacement records the
call and raises, and the test fails even where the code under test catches the error."""

from __future__ import annotations

import importlib.abc
import pathlib
import sys

import pytest

HERE = pathlib.Path(__file__).parent

# module: (the attributes that do the work, what calling one means)
GUARDED = {
    "transformers.modeling_utils": (("PreTrainedModel.__init__",), "builds a transformers model"),
    "tokenizers.trainers": (("BpeTrainer", "WordPieceTrainer", "WordLevelTrainer",
                             "UnigramTrainer"), "trains a tokenizer"),
    "lm_eval": (("simple_evaluate", "evaluate"), "runs lm-eval"),
    "lm_eval.evaluator": (("simple_evaluate", "evaluate"), "runs lm-eval"),
    "lmms_eval.evaluator": (("simple_evaluate", "evaluate"), "runs lmms-eval"),
    "lmms_eval.__main__": (("cli_evaluate",), "runs lmms-eval"),
    "torch.distributed": (("init_process_group",), "starts a process group"),
    "torch.multiprocessing": (("start_processes", "spawn"), "starts worker processes"),
    "ray": (("init",), "starts Ray"),
}


class Guard(importlib.abc.MetaPathFinder):
    """While ``on``, the entry points of GUARDED are replaced, in the modules already imported
    and in those imported meanwhile (their loader is wrapped to patch right after they run)."""

    def __init__(self):
        self.on, self.undo, self.seen = False, [], []

    def start(self):
        self.on, self.seen = True, []
        for name in GUARDED:
            if name in sys.modules:
                self.patch(name, sys.modules[name])

    def stop(self) -> list[str]:
        self.on = False
        for owner, attr, old in reversed(self.undo):
            setattr(owner, attr, old)
        self.undo = []
        return self.seen

    def patch(self, name, module):
        attrs, meaning = GUARDED[name]
        for path in attrs:
            *parents, attr = path.split(".")
            owner = module
            for part in parents:
                owner = getattr(owner, part, None)
            if owner is None or attr not in vars(owner):
                continue
            old = vars(owner)[attr]
            self.undo.append((owner, attr, old))
            setattr(owner, attr, self.refusal(f"{name}.{path}", meaning))

    def refusal(self, where, meaning):
        def refuse(*args, **kwargs):
            self.seen.append(f"{meaning} ({where})")
            raise RuntimeError(f"a quick-tier test {meaning} ({where}); move it to tests/models "
                               "or tests/integration (tests/unit/conftest.py)")
        return refuse

    def find_spec(self, name, path=None, target=None):
        if not self.on or name not in GUARDED:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            if self.on:
                self.patch(name, module)

        spec.loader.exec_module = exec_module
        return spec


GUARD = Guard()
sys.meta_path.insert(0, GUARD)


def _quick(item) -> bool:
    return HERE in pathlib.Path(str(item.path)).parents


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    for item in items:
        if _quick(item):
            item.add_marker(pytest.mark.quick)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if not _quick(item):
        yield
        return
    GUARD.start()
    try:
        yield
    finally:
        GUARD.stop()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    outcome = yield
    if _quick(item) and GUARD.seen:
        outcome.force_exception(pytest.fail.Exception(
            "quick tier: " + "; ".join(dict.fromkeys(GUARD.seen)) +
            ": move the test to tests/models or tests/integration", pytrace=False))
