import os

import pytest

# Ray 2.60 turns token auth on for clusters that ray.init() starts; say so explicitly so every
# test (and every CLI subprocess, which inherits this) runs the same way on any machine.
os.environ.setdefault("RAY_AUTH_MODE", "token")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# A `rayeval serve` the developer left running must not take the tests' runs: a plain
# `rayeval run` looks for one through this file (tests/e2e/test_service.py sets its own).
os.environ.setdefault("RAYEVAL_SERVICE_FILE", os.path.join(
    os.environ.get("TMPDIR", "/tmp"), f"rayeval-tests-no-service-{os.getpid()}.json"))


def pytest_configure(config):
    """The token file that every local cluster of the run shares, made once before any test
    (and, under pytest-xdist, before its workers start): two clusters starting at once would
    each write their own token to ~/.ray/auth_token, and a client reading the other's gets 401."""
    import secrets

    path = os.path.join(os.path.expanduser("~"), ".ray", "auth_token")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))     # Ray's own format (authentication_token_generator)


@pytest.fixture(scope="module")
def ray_cluster():
    """One local Ray cluster per test module, with logical CPUs beyond the largest worker count
    so Ray Data can run beside the Train workers."""
    from support import local_ray

    with local_ray():
        yield


# --- what several modules build alike, built once per run ---------------------------------------
# Each is made on first use (a module run alone still gets it) into the run's temporary folder;
# the modules read them and write their own outputs elsewhere.

@pytest.fixture(scope="session")
def lm_example(tmp_path_factory):
    """scripts/make_lm_example.py's ``build(checkpoints=2)`` (a tiny GPT-2 trained 300 steps,
    ~11 s) made once: a function copying it into a module's folder and returning what
    ``build`` returns, its paths there. The copy is the build's bytes; a module may change it."""
    import shutil

    made = {}

    def copy(out) -> dict:
        from support import script

        if not made:
            src = str(tmp_path_factory.mktemp("lm_example"))
            made.update(script("make_lm_example").build(src, checkpoints=2), root=src)
        src, out = made["root"], str(out)
        for name in os.listdir(src):
            path = os.path.join(src, name)
            if os.path.isdir(path):
                shutil.copytree(path, os.path.join(out, name))
            else:
                shutil.copy2(path, os.path.join(out, name))

        def moved(p):
            return os.path.join(out, os.path.relpath(p, src))

        return {k: ([moved(p) for p in v] if k == "checkpoints" else moved(v) if
                    isinstance(v, str) else v) for k, v in made.items() if k != "root"}

    return copy


@pytest.fixture(scope="session")
def tiny_vlm(tmp_path_factory):
    """The tiny untrained Idefics3 of tests/vlm_support.py whose tokenizer is trained on 500
    easy-vqa train items (seed 0), made once: its folder, ``.../ckpts/checkpoint-1``. Read it,
    never write into it."""
    pytest.importorskip("transformers")
    pytest.importorskip("easy_vqa")
    from vlm_support import build_tiny_vlm, easy_vqa_items, item_texts

    root = tmp_path_factory.mktemp("tiny_vlm")
    return build_tiny_vlm(root / "ckpts" / "checkpoint-1",
                          item_texts(easy_vqa_items("train", n=500)))


@pytest.fixture(scope="session")
def lmms_suite(tmp_path_factory, tiny_vlm):
    """The lmms-eval references of test_lmms_eval_tasks, test_lmms_eval_groups and
    test_vllm_images from one lmms-eval run on ``tiny_vlm`` (tests/lmms_reference.py,
    ``write_suite``): {"model": the folder, "tasks": {"single", "group", "images": folder},
    "reference": {the same keys: lmms-eval's results}}. One lmms-eval start (~10 s) instead
    of one per module."""
    pytest.importorskip("lmms_eval")
    from lmms_reference import OFFLINE_ENV, run_suite, write_suite

    for key, value in OFFLINE_ENV.items():
        os.environ.setdefault(key, value)
    root = str(tmp_path_factory.mktemp("lmms_suite"))
    folders = write_suite(root)
    return {"model": tiny_vlm, "tasks": folders, "reference": run_suite(tiny_vlm, root)}


@pytest.fixture(scope="module")
def one_torch_thread():
    """torch on one thread in this process for the module (put back after it): the reference
    computations a module runs here (transformers loops, lm-eval's simple_evaluate, rayeval's
    one-process passes) are on models of a few thousand weights, where a second intra-op
    thread only adds synchronisation, and on the shared 2-core machine beside a Ray run's
    workers it spins against them: the judge module's plain loop took 17 s on 2 threads and
    2.3 s on 1 (load 5-6). Ray's workers run on one thread already (OMP_NUM_THREADS=1), so the
    references are computed as the workers compute."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
