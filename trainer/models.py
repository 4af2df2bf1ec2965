"""The model zoo: plain nn.Modules that adapt to the dataset's image shape. Each one's
``layers()`` is its forward as a list of pieces applied in turn, of about equal work: its split
points, where a cut into stages may fall (trainer/stages.py)."""

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

    def layers(self) -> list[nn.Module]:
        f, h = self.features, self.head
        return [f[0:3], f[3:], h[0:3], h[3:]]


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

    def layers(self) -> list[nn.Module]:
        f, h = self.features, self.head
        return [f[0:3], f[3:], h[0:2], h[2:4], h[4:]]


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

    def layers(self) -> list[nn.Module]:
        return [self.stem, *self.stages, self.head]


class ResNet50(nn.Module):
    """torchvision's ResNet-50 (the model-parallel tutorial's), its first convolution taking the
    dataset's channels."""

    def __init__(self, channels: int, size: int, classes: int) -> None:
        super().__init__()
        del size  # adaptive pooling: any image size of 32 px or more works (28 px too)
        from torchvision.models import resnet50  # only this model needs torchvision at build time

        net = resnet50(num_classes=classes)
        if channels != 3:
            net.conv1 = nn.Conv2d(channels, 64, 7, 2, 3, bias=False)
        self.net = net

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def layers(self) -> list[nn.Module]:
        n = self.net
        return [nn.Sequential(n.conv1, n.bn1, n.relu, n.maxpool), *n.layer1, *n.layer2, *n.layer3, *n.layer4,
                nn.Sequential(n.avgpool, nn.Flatten(1), n.fc)]


MODEL_CLASSES = {"convnet": ConvNet, "lenet": LeNet, "resnet": ResNet, "resnet50": ResNet50}


def build_model(name: str, channels: int, size: int, classes: int, sync_bn: bool = False) -> nn.Module:
    model = MODEL_CLASSES[name](channels, size, classes)
    if sync_bn:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    return model
