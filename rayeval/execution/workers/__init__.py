"""What runs inside the Ray Train workers (one per GPU; ``worker.train_loop`` is what the
trainer runs). Everything here is imported in a worker process, from what is pickled to it
(the plan, the ledger's handle, the trainer config), never from the driver's state; it reports
to the driver only through the run ledger (``execution.ledger``'s ``WorkerLedger``).

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
"""
