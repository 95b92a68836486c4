"""Running a plan on Ray: the lifecycle, the coordinator actor, the worker loop, collectives,
signals and the run's profile."""
