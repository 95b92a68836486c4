"""The next checkpoint fetched and read on a thread while the current one is evaluated."""

from __future__ import annotations

import os

from rayeval.io.checkpoints import fetch


class Prefetch:
    """The next checkpoint fetched (object storage to this node's cache) and read
    (deserialised) on a thread while the current one is evaluated, so loading hides behind
    the passes. At most one checkpoint ahead, and only fetched, not read, when its files are
    over ``budget`` bytes (it would not fit beside the current one). A failure is kept and
    raised where the checkpoint is loaded, so it fails its own cells as usual."""

    def __init__(self, cache_dir: str, read, budget: int, enabled: bool = True):
        import concurrent.futures

        self.cache_dir = cache_dir
        self.read = read
        self.budget = budget
        self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rayeval-ahead")
        self.enabled = enabled          # RAYEVAL_PREFETCH=0 turns it off (benchmarks)
        self.location: str | None = None
        self.future = None

    def start(self, location: str, fingerprint: str) -> None:
        if not self.enabled:
            return
        self.location = location
        self.future = self.pool.submit(self._get, location, fingerprint)

    def _get(self, location: str, fingerprint: str):
        local = fetch(location, self.cache_dir, fingerprint)
        if self.read is None or _size(local) > self.budget:
            return local, None
        return local, self.read(local)

    def take(self, location: str):
        """(local path, read checkpoint or None) of ``location`` if it was fetched ahead (the
        fetch's error is raised here), else (None, None)."""
        if self.future is None or self.location != location:
            return None, None
        future, self.future, self.location = self.future, None, None
        return future.result()

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def _size(path: str) -> int:
    if not os.path.isdir(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path)
               for f in files)
