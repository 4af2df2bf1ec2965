import subprocess
import sys

import pytest

from trainer.config import ConfigError, TrainConfig, config_from_dict, load_config


def test_defaults_are_valid():
    cfg = load_config([])
    assert cfg == TrainConfig()


def test_flags_override_yaml_and_yaml_overrides_defaults(tmp_path):
    conf = tmp_path / "c.yaml"
    conf.write_text("epochs: 5\nbatch-size: 16\namp: bf16\nsync_bn: true\n")
    cfg = load_config(["--config", str(conf), "--epochs", "7", "--no-resume"])
    assert (cfg.epochs, cfg.batch_size, cfg.amp, cfg.sync_bn, cfg.resume) == (7, 16, "bf16", True, False)


@pytest.mark.parametrize("argv, field", [
    (["--epochs", "0"], "epochs"),
    (["--batch-size", "-3"], "batch_size"),
    (["--batch-size", "many"], "batch_size"),
    (["--lr", "0"], "lr"),
    (["--dataset", "imagenet"], "dataset"),
    (["--model", "vit"], "model"),
    (["--amp", "fp8"], "amp"),
    (["--grad-accum", "1.5"], "grad_accum"),
    (["--backend", "nccl", "--device", "cpu"], "backend"),
    (["--gamma", "2"], "gamma"),
    (["--dist-timeout", "0"], "dist_timeout"),
])
def test_invalid_values_are_rejected_naming_the_field(argv, field):
    with pytest.raises(ConfigError, match=rf"^{field}:"):
        load_config(argv)


def test_unknown_yaml_key_is_rejected(tmp_path):
    conf = tmp_path / "c.yaml"
    conf.write_text("epochs: 2\nlearning_rate: 0.1\n")
    with pytest.raises(ConfigError, match="unknown field 'learning_rate'"):
        load_config(["--config", str(conf)])


def test_broken_yaml_names_the_line(tmp_path):
    conf = tmp_path / "c.yaml"
    conf.write_text("epochs: 2\nlr: [0.1\n")
    with pytest.raises(ConfigError, match="line"):
        load_config(["--config", str(conf)])


def test_config_round_trips_through_a_dict():
    cfg = load_config(["--epochs", "3", "--amp", "fp16"])
    assert config_from_dict(cfg.to_dict()) == cfg


def test_cli_exits_2_with_one_line_naming_the_field():
    proc = subprocess.run([sys.executable, "-m", "trainer", "--epochs", "-1"], capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == "trainer: error: epochs: must be >= 1, got -1"


def test_image_volume_defaults_come_from_the_environment_below_yaml_and_flags(tmp_path, monkeypatch):
    monkeypatch.setenv("DDP_DATA_DIR", "/data")
    monkeypatch.setenv("DDP_CKPT_DIR", "/ckpt")
    assert (load_config([]).data_dir, load_config([]).ckpt_dir) == ("/data", "/ckpt")
    conf = tmp_path / "c.yaml"
    conf.write_text("data_dir: /from/yaml\n")
    cfg = load_config(["--config", str(conf), "--ckpt-dir", "/from/flag"])
    assert (cfg.data_dir, cfg.ckpt_dir) == ("/from/yaml", "/from/flag")
