"""What a run shows and leaves: the run callbacks (the progress display, the trackers' publisher),
the result store, leaderboards and their renderings, plots and trackers."""
