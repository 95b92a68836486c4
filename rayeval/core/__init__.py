"""What an evaluation computes: tasks, metrics as mergeable states, the pass, exact statistics.

Plain torch: no Ray, no collectives."""
