"""Atomic checkpoints: exact round trip, corruption detected in one line, pruning."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from polyrl.checkpoint import CheckpointError, latest_checkpoint, load_checkpoint, save_checkpoint, verify_checkpoint


class Tied(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(11, 4)
        self.head = torch.nn.Linear(4, 11, bias=False)
        self.head.weight = self.emb.weight  # shared tensor, as in tied LM heads


def _train_some(model, opt, sched, n):
    for _ in range(n):
        x = torch.randint(0, 11, (8,))
        loss = model.head(model.emb(x)).logsumexp(-1).mean() + torch.rand(()) * 0
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()


def _make():
    torch.manual_seed(0)
    model = Tied()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))
    return model, opt, sched


def test_resume_is_bit_exact(tmp_path):
    torch.manual_seed(1)
    random.seed(1)
    np.random.seed(1)
    model, opt, sched = _make()
    _train_some(model, opt, sched, 3)
    ck = save_checkpoint(tmp_path, 3, model=model, optimizer=opt, scheduler=sched, state={"data_pos": 24})
    _train_some(model, opt, sched, 3)
    straight = [p.detach().clone() for p in model.parameters()]
    after_rng = (random.random(), float(np.random.rand()))

    model2, opt2, sched2 = _make()
    state = load_checkpoint(ck, model=model2, optimizer=opt2, scheduler=sched2)
    assert state == {"data_pos": 24}
    _train_some(model2, opt2, sched2, 3)
    for a, b in zip(straight, model2.parameters()):
        assert torch.equal(a, b)
    assert (random.random(), float(np.random.rand())) == after_rng
    assert model2.head.weight.data_ptr() == model2.emb.weight.data_ptr()


def test_corrupt_and_incomplete_checkpoints_are_refused(tmp_path):
    model, opt, sched = _make()
    ck = save_checkpoint(tmp_path, 1, model=model, optimizer=opt)
    verify_checkpoint(ck)
    with open(ck / "model.safetensors", "r+b") as f:
        f.seek(-4, 2)
        f.write(b"\x00\x01\x02\x03")
    with pytest.raises(CheckpointError, match="model.safetensors does not match its checksum"):
        load_checkpoint(ck, model=model)
    (ck / "meta.json").unlink()
    with pytest.raises(CheckpointError, match="no readable meta.json"):
        verify_checkpoint(ck)
    with pytest.raises(CheckpointError, match="does not exist"):
        verify_checkpoint(tmp_path / "nope")


def test_prunes_old_and_ignores_temporary_dirs(tmp_path):
    model, opt, _ = _make()
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, step, model=model, optimizer=opt, keep_last=2)
    (tmp_path / "checkpoints" / ".tmp_step_000009_1").mkdir()
    names = sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*"))
    assert names == ["step_000002", "step_000003"]
    assert latest_checkpoint(tmp_path).name == "step_000003"


def test_the_gpus_random_state_is_saved_once_cuda_is_in_use_and_restored_where_it_fits(monkeypatch):
    """Dropout of a model on a GPU draws from CUDA's generators: a checkpoint holds them and a resume on a machine
    with as many GPUs restores them (a resume on the CPU skips them). CUDA's functions are stood in for here; the
    state they return is what ``torch.cuda.get_rng_state_all`` gives, one byte tensor per GPU."""
    from polyrl.checkpoint import rng_state, set_rng_state

    restored = []
    gpus = [torch.tensor([1, 2, 3], dtype=torch.uint8), torch.tensor([4, 5], dtype=torch.uint8)]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: gpus)
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", restored.append)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    state = rng_state()
    assert state["cuda"] is gpus
    set_rng_state(state)
    assert restored == [gpus]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)  # another machine: not this state's GPUs
    set_rng_state(state)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    set_rng_state(state)
    assert restored == [gpus]
    assert "cuda" not in rng_state()
