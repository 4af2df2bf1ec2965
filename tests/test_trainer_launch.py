from trainer.launch import torchrun_argv


def test_arguments_after_the_separator_go_to_the_trainer_and_before_it_to_torchrun():
    argv = torchrun_argv(["--nnodes", "3", "--rdzv-backend", "c10d", "--", "--epochs", "1"], {})
    cut = argv.index("-m", 3)
    assert argv[1:3] == ["-m", "torch.distributed.run"]
    assert argv[3:cut] == ["--nnodes", "3", "--rdzv-backend", "c10d"]
    assert argv[cut:] == ["-m", "trainer", "--epochs", "1"]


def test_without_separator_it_runs_standalone_with_every_argument_for_the_trainer():
    argv = torchrun_argv(["--dataset", "mnist", "--data-dir", "/elsewhere"], {"NPROC_PER_NODE": "4"})
    assert argv[3:6] == ["--standalone", "--nproc-per-node", "4"]
    assert argv[argv.index("trainer") + 1:] == ["--dataset", "mnist", "--data-dir", "/elsewhere"]


def test_standalone_starts_one_process_per_gpu_or_one_without_gpus(monkeypatch):
    import trainer.launch as launch

    monkeypatch.setattr(launch, "default_nproc", lambda: "1")  # what a machine without GPUs reports
    assert torchrun_argv([], {})[3:6] == ["--standalone", "--nproc-per-node", "1"]


def test_default_nproc_counts_visible_gpus(monkeypatch):
    import torch
    import trainer.launch as launch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert launch.default_nproc() == "1"
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)  # GPUs cannot exist here
    assert launch.default_nproc() == "8"
