import os

import pytest

# Ray 2.60 turns token auth on for clusters that ray.init() starts; say so explicitly so every
# test (and every CLI subprocess, which inherits this) runs the same way on any machine.
os.environ.setdefault("RAY_AUTH_MODE", "token")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


@pytest.fixture(scope="module")
def ray_cluster():
    """One local Ray cluster per test module, with logical CPUs beyond the largest worker count
    so Ray Data can run beside the Train workers."""
    import ray

    from rayeval.execution.lifecycle import start_local_ray

    start_local_ray(num_cpus=5, include_dashboard=False, log_to_driver=False,
                    logging_level="ERROR",
                    _system_config={"worker_maximum_startup_concurrency": 8})
    yield
    ray.shutdown()
