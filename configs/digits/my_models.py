"""The example sweep's model: a small MLP over 8x8 glyph images (64 pixel values)."""

import torch


def build_mlp(hidden: int = 32, in_features: int = 64, classes: int = 10) -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(in_features, hidden),
        torch.nn.ReLU(),
        torch.nn.Linear(hidden, classes),
    )
