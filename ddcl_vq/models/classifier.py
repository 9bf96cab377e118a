"""The small image classifier in whose features the prior's evaluation measures samples."""
from __future__ import annotations

from torch import Tensor, nn

FEATURES = 128


class SmallClassifier(nn.Module):
    """Three 3x3 conv blocks (16, 32, 64 channels, each halving the size) -> 128 features -> classes."""

    def __init__(self, channels: int, classes: int, size: int = 32):
        super().__init__()
        layers, c = [], channels
        for width in (16, 32, 64):
            layers += [nn.Conv2d(c, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(), nn.MaxPool2d(2)]
            c = width
        self.conv = nn.Sequential(*layers)
        self.fc = nn.Sequential(nn.Flatten(), nn.Linear(c * (size // 8) ** 2, FEATURES), nn.ReLU())
        self.out = nn.Linear(FEATURES, classes)

    def features(self, x: Tensor) -> Tensor:
        return self.fc(self.conv(x))

    def forward(self, x: Tensor) -> Tensor:
        return self.out(self.features(x))
