"""``rayeval install lmms-eval``: what an entry kind needs, in one command.

lmms-eval's own dependency list does not install on every machine (video decoders, API
clients, a CUDA torchvision that cannot load beside a CPU torch), so rayeval installs it in two
steps: the ``lmms-eval`` extra (what lmms-eval's task layer and its tasks' metrics import), then
lmms-eval itself without its dependencies (docs/vision-language.md). This runs both with the
Python that runs rayeval, so they land in its environment; ``--dry-run`` passes pip's own
``--dry-run`` (every requirement resolved, nothing installed). Standard library only.
"""

from __future__ import annotations

import shlex
import subprocess
import sys

# What each installable name runs: pip's arguments, in order.
STEPS = {"lmms-eval": (["install", "rayeval[lmms-eval]"],
                       ["install", "--no-deps", "lmms-eval==0.7.3"])}


def commands(what: str, dry_run: bool = False) -> list[list[str]]:
    """The pip commands ``rayeval install WHAT`` runs, with this Python."""
    return [[sys.executable, "-m", "pip", *step[:1], *(["--dry-run"] if dry_run else []),
             *step[1:]] for step in STEPS[what]]


def install(what: str, dry_run: bool = False) -> int:
    """Run the commands one after the other (each printed first), stopping at a failure with
    pip's exit status."""
    for command in commands(what, dry_run):
        print(f"[rayeval] {shlex.join(command)}", flush=True)
        code = subprocess.call(command)
        if code:
            print(f"error: {shlex.join(command)} failed (exit {code}); see pip's output above",
                  file=sys.stderr)
            return code
    if not dry_run:
        print(f"[rayeval] {what} installed; `rayeval tasks --check lmms_eval` lists the "
              "tasks it runs")
    return 0
