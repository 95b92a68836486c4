"""An example rayeval plugin: a task, two metrics and a checkpoint layout, added from outside
rayeval.

rayeval calls ``register`` once per process (the driver, each Ray worker), through the entry
point this package declares in the group ``rayeval.plugins``. Registration happens when the
``ranking`` and ``npz`` modules are imported; importing it here, not at the top of this file, keeps
``import rayeval_example_plugin`` free of torch until rayeval asks for the plugin.
"""


def register() -> None:
    """Add the task ``example_ranking``, its metric ``example_mrr``, the classification
    metric ``example_hinge`` and the checkpoint layout ``example-npz`` to rayeval's
    registries."""
    from rayeval_example_plugin import npz, ranking  # noqa: F401  (their decorators register)
