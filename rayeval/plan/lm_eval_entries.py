"""Where the plan's callers found the rendered entries' table store: ``write_requests`` and
``UNWRITTEN`` now live with the request tables they write (``harness.store``), and the
``lm_eval:``/``lmms_eval:`` entries with their slices (``harness.entries``, ``lmms.entries``),
which register them as entry kinds (``config.entries``). Named here too for the driver and the
tests that import them from the plan.
"""

from rayeval.harness.groups import group_specs  # noqa: F401
from rayeval.harness.store import UNWRITTEN, write_requests  # noqa: F401
