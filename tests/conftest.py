import os
import pathlib

import pytest

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


# Test files that time a run's exit after a signal against a fixed bound (10 s after Ctrl-C,
# measured ~2 s idle): under ``-n 2`` they run one at a time, never beside the integration tier
# (``Lanes``).
TIMED_FILES = ("tests/e2e/test_signals.py", "tests/e2e/test_signals_paths.py",
               "tests/e2e/test_service.py")


def _lane_kind(scope: str) -> str:
    """What a unit of work is to ``Lanes``: the integration tier (one unit, CPU-bound: its
    runs keep both cores busy, at a load of 3-10), a file timed against a bound, a file that
    starts Ray or a server of its own (end-to-end: ~1.2 of the 2 cores busy, the rest waiting
    on its subprocesses), or a light one (unit, models, browser: one core, no Ray)."""
    if scope == "tests/integration":
        return "integration"
    if scope in TIMED_FILES:
        return "timed"
    return "ray" if _tier(scope) == "e2e" else "light"


# the order in which ``Lanes`` hands out the kinds: the timed files first, one at a time, each
# beside other end-to-end files, which also run two at a time; light files fill in; then the
# integration tier alone (beside light files, a worker-loss case of test_judge failed once)
_LANE_ORDER = ("timed", "ray", "integration", "light")
# what may run on one worker while the other runs a unit of the key's kind (symmetric: a kind
# listed under another lists it back)
_BESIDE = {"ray": {"ray", "timed", "light"}, "timed": {"ray", "light"},
           "integration": set(), "light": {"ray", "timed", "light"}}


@pytest.hookimpl(tryfirst=True)        # before xdist's own (the hook's first answer wins)
def pytest_xdist_make_scheduler(config, log):
    """Under ``-n N`` (pytest-xdist's default ``--dist load``, the README's test command):
    ``Lanes``. Another ``--dist`` is xdist's own.

    Each file goes whole to one worker (its module fixtures built once) and the integration
    tier whole to one worker, so two of its runs never share the cores (two integration tests
    at once each ran ~2.5x slower: their sum 3,332 s against 1,304 s in one process). The
    end-to-end files, which wait on their own subprocesses' Ray much of the time (~1.2 cores
    busy), run two at once first, the timed ones one at a time (their Ctrl-C exits: 1.9-2.9 s
    beside another end-to-end file, against a 10 s bound); then the integration tier alone,
    never beside another test (the whole suite with the integration tier
    beside the end-to-end files ran at a load of 10-50 and a Ctrl-C case missed its bound).
    The tiers before the integration tier: 797 s on two lanes, 1,319 s in one process."""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class Lanes(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return "tests/integration" if _tier(nodeid) == "integration" else \
                nodeid.split("::")[0]

        def _running(self, node) -> set[str]:
            """The kinds of the units a node has tests of still to run."""
            return {_lane_kind(scope) for scope, unit in self.assigned_work.get(node, {}).items()
                    if not all(unit.values())}

        def _next_scope(self, node) -> str | None:
            """The first waiting unit, in ``_LANE_ORDER``, that may run beside what the other
            workers run; None when every waiting one must wait for them."""
            others = [self._running(n) for n in self.nodes if n is not node]
            for kind in _LANE_ORDER:
                for scope in self.workqueue:
                    if _lane_kind(scope) == kind and all(running <= _BESIDE[kind]
                                                         for running in others):
                        return scope
            return None

        def _assign_work_unit(self, node) -> None:
            scope = self._next_scope(node)
            if scope is None:
                return
            self.workqueue.move_to_end(scope, last=False)
            super()._assign_work_unit(node)

        def _reschedule(self, node) -> None:
            # a worker left waiting (nothing could run beside the other's unit) is given work
            # when the other finishes a test, not only when one of its own finishes
            for each in [node] + [n for n in self.nodes if n is not node]:
                if not each.shutting_down and (self.workqueue or each is node):
                    super()._reschedule(each)

    return Lanes(config, log)


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


def _tier(nodeid: str) -> str:
    """The tier of a test: the folder under tests/ its file sits in (unit, models, ...), from
    its node id (relative to the project, whatever folder a test has moved into)."""
    parts = nodeid.split("::")[0].split("/")
    return parts[1] if len(parts) > 2 and parts[0] == "tests" else "tests"


def pytest_runtest_logreport(report):
    """Setup, call and teardown of every test, summed per tier: a module-scoped fixture's
    cost (a model built, a reference run) is in the setup of its module's first test."""
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
