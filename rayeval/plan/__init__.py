"""From a sweep file to the cells a run must evaluate: the loader (YAML to the config's types,
validated against the tasks and metrics that core registers), the cells and their content keys,
and what became of each."""
