"""From a sweep to the cells a run must evaluate, and what became of each."""
