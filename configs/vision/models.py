"""The vision example's model: a tiny CNN over 16x16 RGB images (float32, NCHW, values in
[0, 1], as transforms.py decodes them)."""

import torch
from torch import nn


class TinyCNN(nn.Module):
    def __init__(self, channels: int = 8, classes: int = 3, size: int = 16):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, channels, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(channels, 2 * channels, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        )
        self.head = nn.Linear(2 * channels * (size // 4) ** 2, classes)

    def forward(self, image: torch.Tensor, brightness: torch.Tensor | None = None) -> torch.Tensor:
        """image: (batch, 3, H, W). brightness: optional (batch,) exposure of each image
        (1: as in training); the image is divided by it first, so dim images look normal."""
        if brightness is not None:
            image = image / brightness.reshape(-1, 1, 1, 1)
        return self.head(self.features(image).flatten(1))


def build_cnn(channels: int = 8, classes: int = 3) -> nn.Module:
    return TinyCNN(channels, classes)
