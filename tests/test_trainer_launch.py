from trainer.launch import torchrun_argv


def test_arguments_after_the_separator_go_to_the_trainer_and_before_it_to_torchrun():
    argv = torchrun_argv(["--nnodes", "3", "--rdzv-backend", "c10d", "--", "--epochs", "1"], {})
    cut = argv.index("-m", 3)
    assert argv[1:3] == ["-m", "torch.distributed.run"]
    assert argv[3:cut] == ["--nnodes", "3", "--rdzv-backend", "c10d"]
    assert argv[cut:] == ["-m", "trainer", "--epochs", "1"]


def test_without_separator_it_runs_standalone_with_the_image_volumes_as_defaults():
    argv = torchrun_argv(["--dataset", "mnist", "--data-dir", "/elsewhere"],
                         {"NPROC_PER_NODE": "4", "DDP_DATA_DIR": "/data", "DDP_CKPT_DIR": "/ckpt"})
    assert argv[3:6] == ["--standalone", "--nproc-per-node", "4"]
    trainer = argv[argv.index("trainer") + 1:]
    assert trainer == ["--data-dir", "/data", "--ckpt-dir", "/ckpt", "--dataset", "mnist", "--data-dir", "/elsewhere"]


def test_standalone_on_a_cpu_machine_starts_one_process():
    argv = torchrun_argv([], {})
    assert argv[3:6] == ["--standalone", "--nproc-per-node", "1"]
