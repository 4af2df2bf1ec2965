"""The model zoo: small, plain nn.Modules that adapt to the dataset's image shape."""

from __future__ import annotations

import torch
from torch import nn


class ConvNet(nn.Module):
    """The PyTorch MNIST example's network, with BatchNorm after each convolution."""

    def __init__(self, channels: int, size: int, classes: int) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(channels, 32, 3), nn.BatchNorm2d(32), nn.ReLU(inplace=True),
            nn.Conv2d(32, 64, 3), nn.BatchNorm2d(64), nn.ReLU(inplace=True),
            nn.MaxPool2d(2), nn.Dropout(0.25), nn.Flatten(),
        )
        side = (size - 4) // 2
        self.head = nn.Sequential(
            nn.Linear(64 * side * side, 128), nn.ReLU(inplace=True), nn.Dropout(0.5),
            nn.Linear(128, classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


class LeNet(nn.Module):
    """LeNet-5 (ReLU and max-pooling variant)."""

    def __init__(self, channels: int, size: int, classes: int) -> None:
        super().__init__()
        pad = 2 if size < 32 else 0  # 28x28 inputs are padded to LeNet's 32x32
        self.features = nn.Sequential(
            nn.Conv2d(channels, 6, 5, padding=pad), nn.ReLU(inplace=True), nn.MaxPool2d(2),
            nn.Conv2d(6, 16, 5), nn.ReLU(inplace=True), nn.MaxPool2d(2), nn.Flatten(),
        )
        side = ((size + 2 * pad - 4) // 2 - 4) // 2
        self.head = nn.Sequential(
            nn.Linear(16 * side * side, 120), nn.ReLU(inplace=True),
            nn.Linear(120, 84), nn.ReLU(inplace=True), nn.Linear(84, classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return torch.relu(out + self.shortcut(x))


class ResNet(nn.Module):
    """A CIFAR-style ResNet-20 (3 stages of 3 basic blocks, 16/32/64 channels)."""

    def __init__(self, channels: int, size: int, classes: int, blocks_per_stage: int = 3) -> None:
        super().__init__()
        del size  # global average pooling makes the network size-agnostic
        self.stem = nn.Sequential(nn.Conv2d(channels, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU(inplace=True))
        layers, cin = [], 16
        for cout, stride in ((16, 1), (32, 2), (64, 2)):
            for i in range(blocks_per_stage):
                layers.append(BasicBlock(cin, cout, stride if i == 0 else 1))
                cin = cout
        self.stages = nn.Sequential(*layers)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.stages(self.stem(x)))


MODEL_CLASSES = {"convnet": ConvNet, "lenet": LeNet, "resnet": ResNet}


def build_model(name: str, channels: int, size: int, classes: int, sync_bn: bool = False) -> nn.Module:
    model = MODEL_CLASSES[name](channels, size, classes)
    if sync_bn:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    return model
