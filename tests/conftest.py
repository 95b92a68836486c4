import os

import pytest

# Ray 2.60 turns token auth on for clusters that ray.init() starts; say so explicitly so every
# test (and every CLI subprocess, which inherits this) runs the same way on any machine.
os.environ.setdefault("RAY_AUTH_MODE", "token")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


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
