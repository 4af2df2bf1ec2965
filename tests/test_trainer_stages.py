"""Model parallelism inside a process (trainer/stages.py): a model split into stages computes what
the unsplit one does, on CPU bit for bit; its parameters keep their names; impossible splits and
option mixes are refused naming the option."""

import pytest
import torch

from trainer.config import ConfigError, TrainConfig
from trainer.dist import DistEnv
from trainer.models import MODEL_CLASSES, build_model
from trainer.stages import SplitError, Staged, layers_of, split_points

CPU = torch.device("cpu")


def _model(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model(name, 1, 28, 10)


def _outputs_and_grads(module: torch.nn.Module, params, x: torch.Tensor):
    torch.manual_seed(5)  # the same dropout draws
    out = module(x)
    grads = torch.autograd.grad(out.square().sum(), params)
    return out, grads


@pytest.mark.parametrize("name", sorted(MODEL_CLASSES))
@pytest.mark.parametrize("stages", [2, 3])
def test_a_split_model_gives_the_unsplit_models_outputs_and_gradients_bit_for_bit(name, stages):
    model = _model(name).train()
    params = list(model.parameters())
    x = torch.randn(4, 1, 28, 28, generator=torch.Generator().manual_seed(1))
    whole, whole_grads = _outputs_and_grads(model, params, x)
    split, split_grads = _outputs_and_grads(Staged(model, [CPU] * stages), params, x)
    assert torch.equal(whole, split)
    assert all(torch.equal(a, b) for a, b in zip(whole_grads, split_grads, strict=True))


@pytest.mark.parametrize("name", sorted(MODEL_CLASSES))
def test_each_model_runs_as_its_pieces_in_turn(name):
    """layers() is the model's forward: the split points cut nothing out and add nothing."""
    model = _model(name).eval()
    x = torch.randn(2, 1, 28, 28)
    out = x
    for piece in layers_of(model):
        out = piece(out)
    assert torch.equal(out, model(x))


def test_splitting_keeps_the_parameters_names_so_a_checkpoint_fits_any_split():
    model = _model("resnet")
    names = list(model.state_dict())
    staged = Staged(model, [CPU] * 3)
    assert list(model.state_dict()) == names
    assert [n.removeprefix("model.") for n in staged.state_dict()] == names
    assert [id(p) for p in staged.parameters()] == [id(p) for p in model.parameters()]


def test_the_pieces_are_dealt_out_evenly_in_order():
    pieces = list(range(11))
    assert split_points(pieces, 1) == []
    assert split_points(pieces, 2) == [6]
    assert split_points(pieces, 3) == [4, 8]
    assert split_points(pieces, 11) == list(range(1, 11))


def test_more_stages_than_pieces_is_refused_naming_the_option():
    with pytest.raises(SplitError, match=r"stages: 5, but this model has 4 pieces to place; give 1 to 4"):
        Staged(_model("convnet"), [CPU] * 5)


def test_micro_batches_in_evaluation_give_the_whole_batchs_outputs():
    """Evaluation normalises with running statistics: chunks change nothing but the schedule."""
    model = _model("resnet").eval()
    x = torch.randn(10, 1, 28, 28)
    with torch.no_grad():
        whole = model(x)
        for micro in (2, 3, 10):
            piped = Staged(model, [CPU] * 3, micro_batches=micro)(x)
            torch.testing.assert_close(piped, whole, rtol=1e-5, atol=1e-6)


def test_micro_batches_in_training_sum_each_chunks_gradients():
    """LeNet has no BatchNorm or dropout: a pipelined batch's gradients are the batch's."""
    model = _model("lenet").train()
    params = list(model.parameters())
    x = torch.randn(12, 1, 28, 28)
    whole, whole_grads = _outputs_and_grads(model, params, x)
    piped, piped_grads = _outputs_and_grads(Staged(model, [CPU] * 2, micro_batches=4), params, x)
    torch.testing.assert_close(piped, whole)
    for a, b in zip(whole_grads, piped_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_a_process_owns_its_stages_devices_in_order():
    cuda = DistEnv(3, 1, 4, 2, torch.device("cuda", 2), "nccl", stages=2)
    assert cuda.devices == (torch.device("cuda", 2), torch.device("cuda", 3))
    cpu = DistEnv(0, 0, 1, 1, CPU, None, stages=3)
    assert cpu.devices == (CPU, CPU, CPU)


@pytest.mark.parametrize("flags, message", [
    ({"micro_batches": 2}, "micro_batches: pipelines the stages of a split model, but stages is 1"),
    ({"stages": 2, "micro_batches": 65}, "micro_batches: 65 chunks of a batch of 64; give at most batch_size"),
    ({"stages": 2, "sync_bn": True}, "sync_bn: SyncBatchNorm needs one device per process, but stages is 2"),
    ({"stages": 0}, "stages: must be >= 1, got 0"),
])
def test_stage_options_that_cannot_work_are_refused_naming_the_field(flags, message):
    with pytest.raises(ConfigError, match=message):
        TrainConfig(**flags)


def test_processes_times_stages_beyond_the_visible_gpus_is_a_clear_error(monkeypatch):
    # GPUs cannot exist here: the device count is the one thing faked
    from trainer.dist import DistSetupError, pick_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert pick_device("auto", 1, 2, stages=2) == torch.device("cuda", 2)
    with pytest.raises(DistSetupError, match=r"2 processes x 3 stages on this node but only 4 GPU\(s\) visible; "
                                             r"start torchrun with --nproc-per-node 1 or fewer, or fewer --stages"):
        pick_device("auto", 1, 2, stages=3)
