"""Running a plan on Ray. Each module runs in one kind of process, which decides the rules that
apply to it: in the driver, signals and the user's terminal; in the Ray Train workers, what is
pickled to them (the plan, the ledger's handle, the trainer config) and what must import
without the driver's state; in the ledger actor, only what workers report. The package is
split by it: this folder holds the driver's modules and the ledger's, ``workers/`` what runs
inside the Ray Train workers.

The driver (the process of ``rayeval run``, ``rayeval.run``, a service or a watch):

    driver      the run of a plan, written once; the one TorchTrainer.fit; a standing group
    lifecycle   Ray started or joined, and shut down, once per run (or per watch)
    recovery    the restart budget, and what a failed fit is said to be
    callbacks   what watches a run (progress, trackers, watch's messages)
    signals     SIGINT/SIGTERM as one exception in the main thread
    pipeline    Ray Data datasets built for the workers (a worker reads its split through it)
    user_code   a sweep's own modules in a process that outlives the run (also in workers)

The run ledger, a Ray actor both sides talk to:

    ledger      where a run stands: written by the workers, read by the driver
    run_state   the ledger's one explicit state between worker groups

The Ray Train workers: the subpackage ``workers`` (its own docstring lists its modules). The
driver imports it only to hand the trainer its loop (``workers.worker.train_loop``).

Both: ``profile`` (where a run's wall time goes: the driver's phases, the workers' spans).
"""
