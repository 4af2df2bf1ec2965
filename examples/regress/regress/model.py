"""The model: a small MLP."""

import torch.nn as nn


def mlp(features, hidden, depth=2):
    layers, width = [], features
    for _ in range(depth):
        layers += [nn.Linear(width, hidden), nn.SiLU()]
        width = hidden
    return nn.Sequential(*layers, nn.Linear(width, 1))
