"""The ``rayeval`` command's exit statuses: 0 all went, 1 some checkpoints failed (or a job did,
or a checkpoint does not fit), 2 bad input. Every command module returns one of these."""

EXIT_OK, EXIT_CELLS_FAILED, EXIT_BAD_INPUT = 0, 1, 2
