"""Running a plan on Ray. Each module runs in one kind of process, which decides the rules that
apply to it: in the driver, signals and the user's terminal; in the Ray Train workers, what is
pickled to them (the plan, the ledger's handle, the trainer config) and what must import
without the driver's state; in the ledger actor, only what workers report.

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

The Ray Train workers (one per GPU; ``worker.train_loop`` is what the trainer runs):

    worker      every pending cell of a plan, checkpoint by checkpoint; a standing group's loop
    rank        one rank: its place, device, deadlines, ledger client, timer
    checkpoints each checkpoint loaded once, agreed on by every rank; prefetch: the next one
                read on a thread meanwhile
    scorer      one cell's pass over this worker's shard and its one all-reduce
    shards      a worker's rows of an evaluation, decoded, kept in memory where they fit
    sinks       what becomes of a cell's merged states (publish it, a race's round, ...)
    resume      a cell scored in segments, kept in the store as it goes
    judging     the judge stage of a judged evaluation
    race        a race (``select:``) on the workers
    sharding    FSDP2 models over several workers
    dist        the collectives (the identity without a process group)

Both: ``profile`` (where a run's wall time goes: the driver's phases, the workers' spans).
"""
