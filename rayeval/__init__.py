"""rayeval: evaluate many PyTorch checkpoints on a Ray cluster and rank them."""

__version__ = "0.1.0"
