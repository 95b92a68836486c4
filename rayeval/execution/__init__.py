"""Running a plan on Ray: the lifecycle, the coordinator actor, the worker loop, restarts,
sharded models (FSDP2), collectives, signals and the run's profile."""
