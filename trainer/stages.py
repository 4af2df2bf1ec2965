"""Model parallelism inside a process: the model's layers split into K stages on K devices, the
activations moved from one to the next (PyTorch's model-parallel tutorial), optionally pipelined
in micro-batches so that the stages overlap; DDP wraps the result like any module.

The split never changes the model itself: its parameters keep their names, so a checkpoint of a
split model is the unsplit model's and loads into a run with any number of stages. Without
micro-batches the stages run the very operations of the unsplit forward in the same order: on one
device (the CPU) a split model computes bit for bit what the unsplit one does.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn


class SplitError(ValueError):
    """The model cannot be split as asked; the message names the option and what is possible."""


def layers_of(model: nn.Module) -> list[nn.Module]:
    """The model's forward as pieces applied one after another, of about equal work: its split
    points (each model of the zoo gives its own, ``model.layers()``)."""
    return list(model.layers())


def split_points(layers: Sequence[nn.Module], stages: int) -> list[int]:
    """Where each stage after the first begins: the pieces dealt out evenly, in order (the first
    stages take one more when they do not divide)."""
    if not 1 <= stages <= len(layers):
        raise SplitError(f"stages: {stages}, but this model has {len(layers)} pieces to place; "
                         f"give 1 to {len(layers)}")
    each, extra = divmod(len(layers), stages)
    cuts, at = [], 0
    for s in range(stages - 1):
        at += each + (s < extra)
        cuts.append(at)
    return cuts


class Staged(nn.Module):
    """``model`` run as stages on ``devices`` (one stage each), its output returned on the first
    device, where the loss and the labels are. ``micro_batches`` > 1 pipelines each batch: while a
    later stage works on one chunk, an earlier one works on the next (on GPUs the launches are
    asynchronous, so the devices overlap). Chunks change what BatchNorm averages over, as they do
    in the tutorial: with micro-batches the results are not the unsplit model's bit for bit."""

    def __init__(self, model: nn.Module, devices: Sequence[torch.device], micro_batches: int = 1) -> None:
        super().__init__()
        self.model = model  # registered: DDP and the optimizer see the model's own parameters
        layers = layers_of(model)
        starts = [0, *split_points(layers, len(devices)), len(layers)]
        self.devices = list(devices)
        # A plain list: the stages are views of self.model, not modules of their own.
        self.parts = [nn.Sequential(*layers[a:b]).to(d) for a, b, d in zip(starts, starts[1:], devices)]
        self.micro_batches = micro_batches

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.micro_batches == 1 or len(x) == 1:
            for part, device in zip(self.parts, self.devices):
                x = part(x.to(device, non_blocking=True))
            return x.to(self.devices[0], non_blocking=True)
        chunks = x.split(math.ceil(len(x) / self.micro_batches))
        last = len(self.parts) - 1
        held: dict[int, torch.Tensor] = dict(enumerate(chunks))
        outs: list[torch.Tensor | None] = [None] * len(chunks)
        # A wavefront: at tick t, stage s works on chunk t - s; the later stages go first so that
        # each one's work is queued before the earlier stage's next chunk.
        for tick in range(len(chunks) + last):
            for s in range(last, -1, -1):
                m = tick - s
                if 0 <= m < len(chunks):
                    out = self.parts[s](held.pop(m).to(self.devices[s], non_blocking=True))
                    if s == last:
                        outs[m] = out.to(self.devices[0], non_blocking=True)
                    else:
                        held[m] = out
        return torch.cat(outs)

    def extra_repr(self) -> str:
        sizes = [sum(p.numel() for p in part.parameters()) for part in self.parts]
        return (f"stages={len(self.parts)} on {[str(d) for d in self.devices]}, parameters per stage {sizes}, "
                f"micro_batches={self.micro_batches}")
