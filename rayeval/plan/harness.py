"""lm-evaluation-harness tasks while planning: the names the sweep loader uses, from the
lm-eval slice (``rayeval.harness``), where they are defined."""

from rayeval.harness.groups import Group, group_metrics
from rayeval.harness.render import Rendered, render
from rayeval.harness.store import DOCS_FILE, location, write

__all__ = ["DOCS_FILE", "Group", "Rendered", "group_metrics", "location", "render", "write"]
