"""What a run leaves: the result store, leaderboards and their renderings, plots, trackers."""
