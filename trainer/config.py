"""One typed training config, from defaults, an optional YAML file and command-line flags.

Precedence: dataclass defaults < ``$DDP_DATA_DIR``/``$DDP_CKPT_DIR`` < ``--config FILE.yaml`` <
explicit flags. Every field is
validated in ``__post_init__``; a bad value raises :class:`ConfigError` naming the field.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path

import yaml

DATASETS = ("synthetic", "mnist", "fashion-mnist", "cifar10")
MODELS = ("convnet", "lenet", "resnet", "resnet50")
OPTIMIZERS = ("sgd", "adamw")
SCHEDULERS = ("constant", "cosine", "step")
AMP_MODES = ("none", "bf16", "fp16")
BACKENDS = ("auto", "gloo", "nccl")
DEVICES = ("auto", "cpu", "cuda")


# Environment variables that set a field's default (the image points them at its volumes).
ENV_DEFAULTS = {"data_dir": "DDP_DATA_DIR", "ckpt_dir": "DDP_CKPT_DIR"}


class ConfigError(ValueError):
    """A config value is invalid; the message names the field and what is expected."""


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    # --- data ---
    dataset: str = field(default="synthetic", metadata={"help": f"one of {', '.join(DATASETS)}"})
    data_dir: str = field(default="runs/data", metadata={"help": "dataset cache on the shared volume"})
    download: bool = field(default=True, metadata={"help": "download a missing torchvision dataset"})
    synthetic_size: int = field(default=8192, metadata={"help": "training samples of the synthetic dataset"})
    augment: bool = field(default=True, metadata={"help": "random crop + flip for cifar10 (on the device)"})
    # --- model ---
    model: str = field(default="convnet", metadata={"help": f"one of {', '.join(MODELS)}"})
    sync_bn: bool = field(default=False, metadata={"help": "convert BatchNorm to SyncBatchNorm"})
    stages: int = field(default=1, metadata={
        "help": "model parallelism: split the model into this many stages, each on a device of its own "
                "(local rank r uses GPUs r*stages onwards; on the CPU the stages share it)"})
    micro_batches: int = field(default=1, metadata={
        "help": "pipeline each batch through the stages in this many chunks, so that the stages overlap "
                "(needs stages > 1; BatchNorm then averages over each chunk)"})
    # --- optimisation ---
    epochs: int = field(default=2, metadata={"help": "passes over the training set"})
    max_steps: int = field(default=0, metadata={"help": "stop after this many optimizer steps (0: no limit)"})
    batch_size: int = field(default=64, metadata={"help": "samples per process per micro-batch"})
    eval_batch_size: int = field(default=512, metadata={"help": "samples per process per eval batch"})
    grad_accum: int = field(default=1, metadata={"help": "micro-batches per optimizer step"})
    optimizer: str = field(default="sgd", metadata={"help": f"one of {', '.join(OPTIMIZERS)}"})
    lr: float = field(default=0.01, metadata={"help": "peak learning rate"})
    momentum: float = field(default=0.9, metadata={"help": "SGD momentum"})
    weight_decay: float = field(default=0.0, metadata={"help": "decoupled (adamw) or L2 (sgd) weight decay"})
    scheduler: str = field(default="cosine", metadata={"help": f"one of {', '.join(SCHEDULERS)}"})
    warmup_steps: int = field(default=0, metadata={"help": "linear LR warm-up, in optimizer steps"})
    step_size_epochs: int = field(default=1, metadata={"help": "'step' scheduler: epochs between decays"})
    gamma: float = field(default=0.5, metadata={"help": "'step' scheduler: decay factor"})
    clip_grad: float = field(default=0.0, metadata={"help": "max global grad norm (0: no clipping)"})
    amp: str = field(default="none", metadata={"help": f"mixed precision: {', '.join(AMP_MODES)}"})
    seed: int = field(default=0, metadata={"help": "seed for init, shuffling and dropout"})
    # --- runtime ---
    backend: str = field(default="auto", metadata={"help": "process group backend (auto: nccl on GPU, gloo on CPU)"})
    device: str = field(default="auto", metadata={"help": "auto: cuda when available, else cpu"})
    dist_timeout: int = field(default=600, metadata={
        "help": "seconds a collective waits for a silent peer before the job fails (a lost node)"})
    # --- checkpoints and metrics ---
    ckpt_dir: str = field(default="runs/ckpt", metadata={"help": "checkpoints, final model and metrics"})
    ckpt_every: int = field(default=0, metadata={"help": "also checkpoint every N optimizer steps (0: epoch ends only)"})
    keep_last: int = field(default=3, metadata={"help": "complete checkpoints to keep"})
    resume: bool = field(default=True, metadata={"help": "resume from the newest complete checkpoint"})
    log_every: int = field(default=50, metadata={"help": "optimizer steps between metrics lines"})

    def __post_init__(self) -> None:
        _choice(self, "dataset", DATASETS)
        _choice(self, "model", MODELS)
        _choice(self, "optimizer", OPTIMIZERS)
        _choice(self, "scheduler", SCHEDULERS)
        _choice(self, "amp", AMP_MODES)
        _choice(self, "backend", BACKENDS)
        _choice(self, "device", DEVICES)
        for name in ("epochs", "batch_size", "eval_batch_size", "grad_accum", "keep_last",
                     "log_every", "synthetic_size", "step_size_epochs", "stages", "micro_batches"):
            _at_least(self, name, 1)
        _at_least(self, "dist_timeout", 10)
        for name in ("max_steps", "warmup_steps", "ckpt_every", "seed", "clip_grad", "weight_decay", "momentum"):
            _at_least(self, name, 0)
        if not self.lr > 0:
            raise ConfigError(f"lr: must be > 0, got {self.lr}")
        if not 0 < self.gamma <= 1:
            raise ConfigError(f"gamma: must be in (0, 1], got {self.gamma}")
        if self.momentum >= 1:
            raise ConfigError(f"momentum: must be < 1, got {self.momentum}")
        for name in ("data_dir", "ckpt_dir"):
            if not str(getattr(self, name)).strip():
                raise ConfigError(f"{name}: must be a directory path, got an empty string")
        if self.micro_batches > 1 and self.stages == 1:
            raise ConfigError("micro_batches: pipelines the stages of a split model, but stages is 1; "
                              "give --stages 2 or more (or --grad-accum to split a batch)")
        if self.micro_batches > self.batch_size:
            raise ConfigError(f"micro_batches: {self.micro_batches} chunks of a batch of {self.batch_size}; "
                              f"give at most batch_size")
        if self.sync_bn and self.stages > 1:
            raise ConfigError("sync_bn: SyncBatchNorm needs one device per process, but stages is "
                              f"{self.stages}; drop --sync-bn or --stages")
        if self.backend == "nccl" and self.device == "cpu":
            raise ConfigError("backend: nccl needs GPUs, but device is cpu; use --backend gloo or --device cuda")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _choice(cfg: TrainConfig, name: str, allowed: tuple[str, ...]) -> None:
    value = getattr(cfg, name)
    if value not in allowed:
        raise ConfigError(f"{name}: must be one of {', '.join(allowed)}, got {value!r}")


def _at_least(cfg: TrainConfig, name: str, low: float) -> None:
    value = getattr(cfg, name)
    if value < low:
        raise ConfigError(f"{name}: must be >= {low}, got {value}")


_HINTS = typing.get_type_hints(TrainConfig)


def _coerce(name: str, value: object) -> object:
    """Turns a YAML or flag value into the field's type, or raises ConfigError naming the field."""
    kind = _HINTS[name]
    if kind is bool:
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{name}: expected true or false, got {value!r}")
    if isinstance(value, bool) or value is None:
        raise ConfigError(f"{name}: expected {kind.__name__}, got {value!r}")
    try:
        if kind is int:
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            return int(str(value), 10) if isinstance(value, str) else int(value)
        return kind(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{name}: expected {kind.__name__}, got {value!r}") from None


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m trainer",
        description="DDP trainer: run under torchrun or as a single process.",
        argument_default=argparse.SUPPRESS,
        allow_abbrev=False,  # `--dev cpu` must not pass for --device: the deploy tool owns that flag
    )
    parser.add_argument("--config", help="YAML file with any of the fields below; flags override it")
    for f in fields(TrainConfig):
        help_text = f"{f.metadata.get('help', '')} (default: {f.default})"
        if _HINTS[f.name] is bool:
            parser.add_argument(_flag(f.name), dest=f.name, action=argparse.BooleanOptionalAction, help=help_text)
        else:
            parser.add_argument(_flag(f.name), dest=f.name, metavar=f.name.upper(), help=help_text)
    return parser


def load_config(argv: list[str] | None = None) -> TrainConfig:
    """Parses flags (and the YAML file they name) into a validated TrainConfig."""
    args = vars(build_parser().parse_args(argv))
    values: dict[str, object] = {}
    for name, var in ENV_DEFAULTS.items():  # the image's volumes, below the YAML file and flags
        if os.environ.get(var):
            values[name] = os.environ[var]
    config_file = args.pop("config", None)
    if config_file:
        values.update(_read_yaml(Path(config_file)))
    values.update(args)
    return TrainConfig(**{name: _coerce(name, value) for name, value in values.items()})


def flag_problem(argv: list[str]) -> str | None:
    """What the trainer would refuse in these flags, or None: unknown or malformed flags and invalid
    values, as at start, without exiting (the deploy tool checks ``train.args`` before launching).
    ``--config FILE`` is not read: the file is where the job runs."""
    parser = build_parser()
    parser.exit_on_error = False
    try:
        known, unknown = parser.parse_known_args(argv)
    except argparse.ArgumentError as exc:
        return str(exc)
    if unknown:
        return f"unrecognized arguments: {' '.join(unknown)}"
    values = vars(known)
    values.pop("config", None)
    try:
        TrainConfig(**{name: _coerce(name, value) for name, value in values.items()})
    except ConfigError as exc:
        return str(exc)
    return None


def config_from_dict(values: dict) -> TrainConfig:
    """Rebuilds a config from ``to_dict`` output (e.g. one stored in a checkpoint)."""
    known = {f.name for f in fields(TrainConfig)}
    return TrainConfig(**{k: _coerce(k, v) for k, v in values.items() if k in known})


def _read_yaml(path: Path) -> dict:
    try:
        loaded = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise ConfigError(f"config: cannot read {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise ConfigError(f"config: {path}{where} is not valid YAML") from None
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise ConfigError(f"config: {path} must hold a mapping of field: value")
    known = {f.name for f in fields(TrainConfig)}
    for key in loaded:
        normal = str(key).replace("-", "_")
        if normal not in known:
            raise ConfigError(f"config: {path}: unknown field {key!r}")
    return {str(k).replace("-", "_"): v for k, v in loaded.items()}


def main(argv: list[str] | None = None) -> int:
    """``python -m trainer.config FLAG...``: what the trainer would refuse in these flags
    (:func:`flag_problem`), on one line and exit 2, or nothing and exit 0. The deploy tool asks it so
    of ``train.args`` when it reads an inventory."""
    problem = flag_problem(sys.argv[1:] if argv is None else argv)
    if problem:
        print(problem)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
