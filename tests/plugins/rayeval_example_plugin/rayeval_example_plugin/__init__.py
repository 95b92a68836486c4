"""An example rayeval plugin: a task and two metrics, added from outside rayeval.

rayeval calls ``register`` once per process (the driver, each Ray worker), through the entry
point this package declares in the group ``rayeval.plugins``. Registration happens when the
``ranking`` module is imported; importing it here, not at the top of this file, keeps
``import rayeval_example_plugin`` free of torch until rayeval asks for the plugin.
"""


def register() -> None:
    """Add the task ``example_ranking``, its metric ``example_mrr`` and the classification
    metric ``example_hinge`` to rayeval's registries."""
    from rayeval_example_plugin import ranking  # noqa: F401  (its decorators register)
