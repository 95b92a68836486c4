"""Running a plan on Ray: the lifecycle, the run ledger actor, the worker loop, restarts,
sharded models (FSDP2), collectives, signals and the run's profile."""
