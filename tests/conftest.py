import os
import pathlib
import time

import pytest

from lanes import tier as _tier

# Ray 2.60 turns token auth on for clusters that ray.init() starts; say so explicitly so every
# test (and every CLI subprocess, which inherits this) runs the same way on any machine.
os.environ.setdefault("RAY_AUTH_MODE", "token")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# A `rayeval serve` the developer left running must not take the tests' runs: a plain
# `rayeval run` looks for one through this file (tests/e2e/test_service.py sets its own).
os.environ.setdefault("RAYEVAL_SERVICE_FILE", os.path.join(
    os.environ.get("TMPDIR", "/tmp"), f"rayeval-tests-no-service-{os.getpid()}.json"))
# One torch thread in the pytest process and in every process it starts (CLI runs, scripts, gloo
# ranks, lm-eval's references; Ray's workers have one already), read by torch when it is first
# imported. The suite's models have a few thousand weights, where a second intra-op thread
# only adds synchronisation, and on the 2-core machine it spins against Ray's workers and the
# other process of a pair: reference loops ran 7-8x slower under a Ray run on two threads
# (the judge module's plain loop: 17 s on 2 threads, 2.3 s on 1).
for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")
# At most 2 tasks of a Ray Data stage at once (docs/sweep-file.md): the session's Ray declares
# 12 CPUs on 2 cores (support.SESSION_CPUS), and an image evaluation's first run started a
# stage process per CPU, each importing transformers: 64 s, 28 s with 2 (test_vlm_ray's data).
os.environ.setdefault("RAYEVAL_DATA_CONCURRENCY", "2")

# The tiers that start no Ray: the session's Ray (support.shared_ray), up from an earlier tier,
# is stopped before their first test, so its idle processes do not sit beside them.
NO_RAY_TIERS = ("unit", "models")


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


@pytest.hookimpl(tryfirst=True)        # before xdist's own (the hook's first answer wins)
def pytest_xdist_make_scheduler(config, log):
    """Under ``-n N`` (pytest-xdist's default ``--dist load``, the README's test command): the
    lanes of tests/lanes.py. Another ``--dist`` is xdist's own."""
    if config.getvalue("dist") != "load":
        return None
    from lanes import Lanes, watch

    lanes = Lanes(config, log)
    watch(lanes, _LAST_REPORT)
    return lanes


def pytest_runtest_setup(item):
    if os.path.basename(os.path.dirname(str(item.fspath))) in NO_RAY_TIERS:
        from support import stop_ray

        stop_ray()


@pytest.fixture(scope="session", autouse=True)
def _session_ray_down():
    """The session's Ray (support.shared_ray) stopped when the session ends."""
    yield
    from support import stop_ray

    stop_ray()


@pytest.fixture(scope="module")
def ray_cluster():
    """The session's one local Ray (support.shared_ray), with logical CPUs beyond the largest
    worker count so Ray Data can run beside the Train workers: started by the first test that
    asks, kept up for the next (one start per session instead of one per module). A module
    after one that stopped it (``no_ray``, test_s3) starts it again."""
    from support import shared_ray

    shared_ray()
    yield


@pytest.fixture(scope="module")
def standing(ray_cluster):
    """The session's standing worker groups (support.StandingPool) on its Ray: hand a run to
    them with ``rayeval.run(..., standing=standing)`` or ``run_sweep(..., standing=...)``,
    as a ``rayeval serve`` takes a user's run. A test of the run's own fit (its restarts,
    signals, timings, Ray's start) runs without."""
    from support import POOL

    yield POOL


@pytest.fixture
def no_ray():
    """No Ray up in this process when the test starts: for a test that checks a run's own
    start and shutdown of Ray. The next test that asks for ``ray_cluster`` starts it again."""
    from support import stop_ray

    stop_ray()
    yield


# --- what several modules build alike, built once per run ---------------------------------------
# Each is made on first use (a module run alone still gets it) into the run's temporary folder;
# the modules read them and write their own outputs elsewhere.

@pytest.fixture(scope="session")
def disk_cache(request):
    """support.DiskCache in pytest's cache folder (none with ``-p no:cacheprovider``)."""
    from support import DiskCache

    cache = getattr(request.config, "cache", None)
    return DiskCache(None if cache is None else str(cache.mkdir("rayeval-fixtures")))


HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPTS = os.path.join(os.path.dirname(HERE), "scripts")


@pytest.fixture(scope="session")
def lm_example(disk_cache):
    """scripts/make_lm_example.py's ``build(checkpoints=2)`` (a tiny GPT-2 trained 300 steps,
    ~11 s) made once, and kept on disk under the key of its script and torch's, transformers'
    and tokenizers' versions: a function copying it into a module's folder and returning what
    ``build`` returns, its paths there. The copy is the build's bytes; a module may change it."""
    import json
    import shutil

    from support import content_key, script, versions

    def build(folder):
        made = script("make_lm_example").build(folder, checkpoints=2)
        rel = {k: ([os.path.relpath(p, folder) for p in v] if k == "checkpoints" else
                   os.path.relpath(v, folder) if isinstance(v, str) else v)
               for k, v in made.items()}
        with open(os.path.join(folder, "build.json"), "w") as f:
            json.dump(rel, f)

    key = content_key(pathlib.Path(SCRIPTS, "make_lm_example.py"),
                      pathlib.Path(SCRIPTS, "example_files.py"),
                      versions("torch", "transformers", "tokenizers"))
    src = disk_cache.folder("lm_example", key, build)
    with open(os.path.join(src, "build.json")) as f:
        rel = json.load(f)

    def copy(out) -> dict:
        out = str(out)
        for name in os.listdir(src):
            if name == "build.json":
                continue
            path = os.path.join(src, name)
            if os.path.isdir(path):
                shutil.copytree(path, os.path.join(out, name))
            else:
                shutil.copy2(path, os.path.join(out, name))
        return {k: ([os.path.join(out, p) for p in v] if k == "checkpoints" else
                    os.path.join(out, v) if isinstance(v, str) else v) for k, v in rel.items()}

    return copy


@pytest.fixture(scope="session")
def tiny_vlm(disk_cache):
    """The tiny untrained Idefics3 of tests/vlm_support.py whose tokenizer is trained on 500
    easy-vqa train items (seed 0), made once and kept on disk under the key of vlm_support.py
    and the versions of what builds it: its folder, ``.../ckpts/checkpoint-1``. Read it,
    never write into it."""
    pytest.importorskip("transformers")
    pytest.importorskip("easy_vqa")
    from support import content_key, versions
    from vlm_support import build_tiny_vlm, easy_vqa_items, item_texts

    def build(folder):
        build_tiny_vlm(os.path.join(folder, "ckpts", "checkpoint-1"),
                       item_texts(easy_vqa_items("train", n=500)))

    key = content_key(pathlib.Path(HERE, "vlm_support.py"),
                      versions("torch", "transformers", "tokenizers", "easy-vqa", "pillow"))
    return os.path.join(disk_cache.folder("tiny_vlm", key, build), "ckpts", "checkpoint-1")


@pytest.fixture(scope="session")
def lmms_suite(tmp_path_factory, tiny_vlm, disk_cache):
    """The lmms-eval references of test_lmms_eval_tasks, test_lmms_eval_groups and
    test_vllm_images from one lmms-eval run on ``tiny_vlm`` (tests/lmms_reference.py,
    ``write_suite``): {"model": the folder, "tasks": {"single", "group", "images", "own":
    folder},
    "reference": {the same keys: lmms-eval's results}}. One lmms-eval start (~10 s) instead
    of one per module, kept on disk under the key of the model's bytes, lmms_reference.py and
    vlm_support.py (the items) and the versions of lmms-eval and what it runs on; the task
    folders are copied into this session's folder (the runs read them from there)."""
    pytest.importorskip("lmms_eval")
    import pickle
    import shutil

    from lmms_reference import OFFLINE_ENV, run_suite, write_suite
    from support import content_key, versions

    for key, value in OFFLINE_ENV.items():
        os.environ.setdefault(key, value)

    def build(folder):
        write_suite(folder)
        with open(os.path.join(folder, "reference.pickle"), "wb") as f:
            pickle.dump(run_suite(tiny_vlm, folder), f)

    key = content_key(pathlib.Path(tiny_vlm), pathlib.Path(HERE, "lmms_reference.py"),
                      pathlib.Path(HERE, "vlm_support.py"),
                      versions("lmms_eval", "torch", "transformers", "easy-vqa", "pillow"))
    kept = disk_cache.folder("lmms_suite", key, build)
    with open(os.path.join(kept, "reference.pickle"), "rb") as f:
        reference = pickle.load(f)
    root = str(tmp_path_factory.mktemp("lmms_suite"))
    folders = {}
    for name in ("single", "group", "images", "own"):
        folders[name] = shutil.copytree(os.path.join(kept, name), os.path.join(root, name))
    return {"model": tiny_vlm, "tasks": folders, "reference": reference}


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


# --- each tier's time, printed at the end of every run ---------------------------------------

_TIER_SECONDS: dict[str, float] = {}
_TIER_TESTS: dict[str, int] = {}


_LAST_REPORT = [time.monotonic()]    # when a test last reported, for lanes.watch


def pytest_runtest_logreport(report):
    """Setup, call and teardown of every test, summed per tier: a module-scoped fixture's
    cost (a model built, a reference run) is in the setup of its module's first test."""
    _LAST_REPORT[0] = time.monotonic()
    tier = _tier(report.nodeid)
    _TIER_SECONDS[tier] = _TIER_SECONDS.get(tier, 0.0) + report.duration
    if report.when == "call":
        _TIER_TESTS[tier] = _TIER_TESTS.get(tier, 0) + 1


def pytest_terminal_summary(terminalreporter):
    if not _TIER_SECONDS:
        return
    # the sums of each tier's tests' times (under pytest-xdist, `-n 2`, the workers' tests
    # overlap, so pytest's last line, the wall, is less than their total)
    terminalreporter.section("time per tier (sum of its tests' times)")
    for tier, seconds in sorted(_TIER_SECONDS.items(), key=lambda kv: -kv[1]):
        terminalreporter.write_line(f"{tier:<12} {_TIER_TESTS.get(tier, 0):5d} tests "
                                    f"{seconds:8.1f} s")
