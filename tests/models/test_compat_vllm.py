"""rayeval.compat's vLLM hooks found in the installed vLLM (a child process imports it: ~10 s,
so this is not in the quick tier; tests/unit/test_compat.py has the rest of compat)."""

import importlib.util
import subprocess
import sys

import pytest

from rayeval import compat  # noqa: F401 - the module the child process checks


def need(module: str) -> None:
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed")


def test_vllm_s_hooks_are_in_the_installed_vllm():
    need("vllm")
    # A child process: importing vLLM here would leave its patch and its threads in the tests'.
    code = ("from vllm.v1.executor.uniproc_executor import ExecutorWithExternalLauncher as L\n"
            "from rayeval import compat\n"
            "assert callable(L._distributed_args)\n"
            "assert compat.vllm_cpu_gemm_dispatch() is not None\n"
            "original = L._distributed_args\n"
            "compat.name_vllm_init_method(lambda: 'file://x')\n"
            "assert L._distributed_args is not original\n"
            "patched = L._distributed_args\n"
            "compat.name_vllm_init_method(lambda: 'file://y')\n"
            "assert L._distributed_args is patched\n"       # once per process
            # an engine's shutdown keeps the worker group's process group (a judge's release)
            "from vllm.distributed import parallel_state as ps\n"
            "destroy = ps.destroy_model_parallel, ps.destroy_distributed_environment\n"
            "assert hasattr(ps, '_WORLD') and hasattr(ps, '_NODE_COUNT')\n"
            "with compat.vllm_groups_kept(True, False):\n"
            "    assert ps.destroy_distributed_environment is not destroy[1]\n"
            "    ps.destroy_distributed_environment()\n"
            "with compat.vllm_groups_kept(True, True):\n"
            "    assert ps.destroy_model_parallel() is None\n"
            "assert (ps.destroy_model_parallel, ps.destroy_distributed_environment) == destroy\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
