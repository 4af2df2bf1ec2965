import torch
import pytest

from trainer import data
from trainer.dist import DistEnv, DistSetupError, pick_device


def env(rank: int, world: int) -> DistEnv:
    return DistEnv(rank, rank, world, world, torch.device("cpu"), None)


def test_ranks_get_disjoint_shards_that_cover_the_dataset():
    n, world = 103, 3
    shards = []
    for rank in range(world):
        sampler = data.train_sampler(env(rank, world), n, seed=1)
        shards.append(torch.cat(data.epoch_batches(sampler, 0, batch_size=5, grad_accum=1, device=torch.device("cpu"))))
    assert len({len(s) for s in shards}) == 1  # every rank takes the same number of steps
    seen = torch.cat(shards).tolist()
    assert len(seen) == len(set(seen))  # whole batches only: no sample twice in an epoch


def test_set_epoch_reshuffles_and_the_same_seed_reproduces():
    make = lambda seed: data.train_sampler(env(0, 2), 64, seed=seed)  # noqa: E731
    cpu = torch.device("cpu")
    e0 = torch.cat(data.epoch_batches(make(0), 0, 8, 1, cpu))
    e1 = torch.cat(data.epoch_batches(make(0), 1, 8, 1, cpu))
    again = torch.cat(data.epoch_batches(make(0), 0, 8, 1, cpu))
    other_seed = torch.cat(data.epoch_batches(make(1), 0, 8, 1, cpu))
    assert not torch.equal(e0, e1)
    assert torch.equal(e0, again)
    assert not torch.equal(e0, other_seed)


def test_batches_come_in_whole_accumulation_groups():
    sampler = data.train_sampler(env(0, 1), 100, seed=0)
    batches = data.epoch_batches(sampler, 0, batch_size=8, grad_accum=3, device=torch.device("cpu"))
    assert len(batches) == 12 and all(len(b) == 8 for b in batches)


def test_eval_shards_cover_every_test_sample_exactly_once():
    n, world = 1001, 4
    got = torch.cat([data.eval_shard(env(r, world), n, torch.device("cpu")) for r in range(world)])
    assert sorted(got.tolist()) == list(range(n))


def test_augment_randomly_crops_each_padded_sample_and_flips_it_horizontally():
    """augment is a per-sample random crop of the padded image, and a horizontal flip."""
    n, pad = 6, 2
    images = torch.randint(0, 256, (n, 3, 8, 8), dtype=torch.uint8)
    out = data.augment(images, torch.Generator().manual_seed(5), pad=pad)
    draws = torch.Generator().manual_seed(5)  # the same draws, in the same order
    off_y = torch.randint(0, 2 * pad + 1, (n,), generator=draws)
    off_x = torch.randint(0, 2 * pad + 1, (n,), generator=draws)
    flip = torch.rand(n, generator=draws) < 0.5
    padded = torch.nn.functional.pad(images, (pad, pad, pad, pad))
    for i in range(n):
        crop = padded[i, :, off_y[i]:off_y[i] + 8, off_x[i]:off_x[i] + 8]
        assert torch.equal(out[i], crop.flip(-1) if flip[i] else crop)
    assert flip.any() and not flip.all()  # both branches were exercised


def test_synthetic_dataset_is_written_once_and_found_afterwards(tmp_path):
    assert data.prepare(env(0, 1), "synthetic", str(tmp_path), 256, True) == "fetched"
    stamp = (tmp_path / "synthetic" / "synthetic-256.pt").stat().st_mtime_ns
    assert data.prepare(env(0, 1), "synthetic", str(tmp_path), 256, True) == "found"
    assert (tmp_path / "synthetic" / "synthetic-256.pt").stat().st_mtime_ns == stamp
    train, test = data.load("synthetic", str(tmp_path), 256)
    assert train.images.shape == (256, 1, 28, 28) and len(test) == 256


def test_missing_dataset_offline_is_a_clear_error(tmp_path):
    with pytest.raises(data.DatasetUnavailable, match="fashion-mnist is not under .* --no-download"):
        data.prepare(env(0, 1), "fashion-mnist", str(tmp_path), 0 + 1, download=False)


def test_failed_download_says_what_to_do(tmp_path, monkeypatch):
    # every proxy points at a closed loopback port: the real download code fails without leaving the machine
    for var in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY"):
        monkeypatch.setenv(var, "http://127.0.0.1:9")
    monkeypatch.delenv("no_proxy", raising=False)
    monkeypatch.delenv("NO_PROXY", raising=False)
    with pytest.raises(data.DatasetUnavailable, match="download failed .*copy the files there"):
        data.prepare(env(0, 1), "mnist", str(tmp_path), 1, download=True)


def test_cuda_requested_without_a_gpu_is_a_clear_error():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(DistSetupError, match="no GPU is visible"):
        pick_device("cuda", 0, 1)


def test_more_processes_than_gpus_is_a_clear_error(monkeypatch):
    # GPUs cannot exist here: the device count is the one thing faked
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(DistSetupError, match="4 processes on this node but only 2 GPU"):
        pick_device("auto", 3, 4)
