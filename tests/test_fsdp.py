"""The FSDP2 learner on gloo (2 CPU processes) against the one-process LocalLearner on the same global batch.

The processes are spawned once for the module (127.0.0.1, a free port, a timeout; ``two_processes``); the tests
compare what rank 0 wrote with what this process computes: losses, gradients and metrics of ``update_policy`` for
every registered aggregation; a one-process checkpoint resumed at world size 2 and a sharded one resumed at world
size 1; the export of a sharded checkpoint as a Hugging Face directory.

Marked ``gpu`` (``pytest -m gpu tests/test_fsdp.py`` on a CUDA machine): the same checks with one process on NCCL
and its GPU against the one-process LocalLearner on the CPU, and the LocalLearner on a GPU (``--device cuda``)
against itself on the CPU.
"""

from __future__ import annotations

import copy
import os
import socket
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.multiprocessing as mp

import polyrl.methods  # noqa: F401  (registers every part)
from polyrl.batch import TokenBatch
from polyrl.learner.local import LocalLearner, ValueHead
from polyrl.objectives import build_method
from polyrl.registry import AGGREGATIONS
from polyrl.update import Scored, update_policy

WORLD = 2
TIMEOUT_S = 240
SETTINGS = dict(lr=1e-2, weight_decay=0.01, warmup_steps=1, max_grad_norm=1.0, temperature=1.0, top_p=1.0, top_k=0,
                fp32_head=False)
# (rows, micro-batch size, minibatches, reuse_old, top-K, critic). Every aggregation: 2 minibatches of 5 and 4 rows
# (3 micro-batches on 2 ranks: one None pass; then 2), pi_old and critic values scored on row shards (9 rows: the
# last shard padded), a critic step on row shards. Once: 3 micro-batches with pi_old (and its top-K) from the update.
CASES = [(9, 2, 2, False, 0, True), (5, 2, 1, True, 3, False)]
STEP = (9, 2, 1, False, 0, True)  # one optimizer step over 5 micro-batches, with a critic (checkpoint tests)
# Shared prompts on, groups of 3 rows in micro-batches of 2: rows 0-1 share a prompt, rows 2-3 none (rank 1's first
# pass), so the two ranks would run the base model a different number of times and hang in FSDP's all-gathers.
SHARED = (7, 2, 1, True, 0, False)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from polyrl.tinylm import build_tiny_llama

    return str(build_tiny_llama(tmp_path_factory.mktemp("tiny"), hidden=32, layers=2, heads=2, seed=0))


# ---------------------------------------------------------------------------------------------------------------------
# processes


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(fn, *args, world: int = WORLD, gpu: bool = False) -> None:
    """Run ``fn(rank, *args)`` in ``world`` processes joined by gloo on the CPU (``gpu``: by NCCL, one GPU each);
    raise what a process raised; kill them at the timeout."""
    ctx = mp.start_processes(_entry, args=(world, gpu, fn, _free_port(), *args), nprocs=world, join=False,
                             start_method="spawn")
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while not ctx.join(timeout=max(1.0, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{fn.__name__} on {world} processes took longer than {TIMEOUT_S} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join(5)


def _entry(rank: int, world: int, gpu: bool, fn, port: int, *args) -> None:
    from polyrl.learner import dist as pdist

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    assert pdist.init_from_env(timeout_s=TIMEOUT_S, cuda=gpu) == (rank, world)  # gloo on the CPU unless gpu
    assert pdist.device().type == ("cuda" if gpu else "cpu")
    try:
        fn(rank, *args)
        pdist.leave()  # both ranks are done before either tears gloo down (one SIGABRT seen under load without it)
    finally:
        pdist.close()


# ---------------------------------------------------------------------------------------------------------------------
# the same models, batches and updates in every process


def _models(model_dir: str, critic: bool, reference: bool, dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, dtype=dtype)
    ref = copy.deepcopy(model).eval().requires_grad_(False) if reference else None
    return model, ref, ValueHead(copy.deepcopy(model)) if critic else None


def _learner(model_dir: str, *, mbs: int, critic: bool = False, reference: bool = False, sharded: bool,
             share: bool = False, dtype: torch.dtype = torch.float32):
    model, ref, crit = _models(model_dir, critic, reference, dtype)
    kind = LocalLearner
    if sharded:
        from polyrl.learner.fsdp import FSDPLearner as kind
    return kind(model, micro_batch_size=mbs, reference=ref, ref_sync_every=1 if reference else 0, critic=crit,
                share_prompts=share, **SETTINGS)


def _scored(learner, B: int, *, seed: int, reuse_old: bool, T: int = 6, P: int = 5, shared: bool = False) -> Scored:
    """``shared``: the rows of each group of 3 share their group's first prompt (a GRPO batch)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, 60, (B, P + T), generator=g)
    lengths = torch.randint(1, T + 1, (B,), generator=g)  # (a micro-batch without any completion token has no
    lengths[0] = T  # gradient at all: completion_logprobs' output is then a constant)
    comp = (torch.arange(T)[None] < lengths[:, None]).float()
    attn = torch.cat([(torch.arange(P)[None] >= torch.randint(0, 3, (B, 1), generator=g)).long(), comp.long()], 1)
    if shared:
        first = torch.arange(B) // 3 * 3
        ids[:, :P], attn[:, :P] = ids[first, :P], attn[first, :P]
    tb = TokenBatch(ids, attn, comp, -torch.rand(B, T, generator=g) * comp, comp.clone(),
                    torch.zeros(B, T, dtype=torch.long))
    adv = torch.randn(B, generator=g)[:, None].expand(B, T).clone()
    values = learner.values(tb)
    return Scored(tb=tb, mask=tb.loss_mask, adv=adv, group_ids=torch.arange(B) // 3,
                  segment_ids=torch.zeros(B, T, dtype=torch.long),
                  old_logp=torch.zeros(B, T) if reuse_old else learner.logprobs_nograd(tb).logp, old_topk=None,
                  ref_logp=learner.ref_logprobs(tb, []), values=values,
                  returns=None if values is None else torch.randn(B, T, generator=g))


def _full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor on the CPU (a DTensor's shards gathered; a GPU's copied back)."""
    return (t.full_tensor() if hasattr(t, "full_tensor") else t.detach().clone()).cpu()


class _Recorder:
    """The learner, recording the full gradient and its norm at each optimizer step (a collective when sharded)."""

    def __init__(self, learner):
        self.learner, self.grads, self.norms = learner, [], []

    def __getattr__(self, name):
        return getattr(self.learner, name)

    def step(self) -> float:
        self.grads.append({n: _full(p.grad) for n, p in self.learner.model.named_parameters() if p.grad is not None})
        self.norms.append(self.learner.step())
        return self.norms[-1]


def _update(learner, method, case, seed: int, zero_rows: tuple[int, ...] = (), shared: bool = False) -> dict:
    """``zero_rows``: these rows get A = 0 and run forward only (skip_zero_adv); ``shared``: see ``_scored``."""
    B, mbs, minibatches, reuse_old, topk, _ = case
    s = _scored(learner, B, seed=seed, reuse_old=reuse_old, shared=shared)
    s.adv[list(zero_rows)] = 0.0
    rec = _Recorder(learner)
    metrics = update_policy(rec, method, s, SimpleNamespace(bad_steps=0, skipped_total=0), epochs=1,
                            minibatches=minibatches, micro_batch_size=mbs, horizon=6, topk=topk, reuse_old=reuse_old,
                            seed=seed, max_bad_steps=3, skip_zero_adv="yes" if zero_rows else "no")
    return dict(metrics=metrics, grads=rec.grads, norms=rec.norms, old_logp=s.old_logp, old_topk=s.old_topk,
                values=s.values, params=_state(learner.model),
                critic=None if learner.critic is None else _state(learner.critic))


def _state(model) -> dict[str, torch.Tensor]:
    return {k: _full(v) for k, v in model.state_dict().items()}


def _method(aggregation: str, kl: bool = False):
    extra = dict(kl="k3", kl_coef=0.1) if kl else {}
    return build_method("fsdp", advantage="grpo", trust_region="clip", aggregation=aggregation, **extra)


def _close(a, b, tol: float, what: str) -> None:
    if isinstance(a, dict):
        assert a.keys() == b.keys(), what
        for k in a:
            _close(a[k], b[k], tol, f"{what}[{k}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), what
        for i, (x, y) in enumerate(zip(a, b)):
            _close(x, y, tol, f"{what}[{i}]")
    elif isinstance(a, torch.Tensor):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol, msg=lambda m: f"{what}: {m}")
    elif a is None:
        assert b is None, what
    else:
        assert abs(a - b) <= tol * max(1.0, abs(a)), f"{what}: {a} != {b}"


# ---------------------------------------------------------------------------------------------------------------------
# (1) loss and gradients do not depend on the world size, for every aggregation


def _skip_then_update(learner) -> dict:
    """A non-finite loss in the second micro-batch (rank 1's) skips the step on every rank; the next update runs."""
    counters = SimpleNamespace(bad_steps=0, skipped_total=0)
    s = _scored(learner, 5, seed=7, reuse_old=False)
    s.adv[2] = float("nan")
    update_policy(learner, _method("token_mean"), s, counters, epochs=1, minibatches=1, micro_batch_size=2, horizon=6,
                  topk=0, reuse_old=False, seed=7, max_bad_steps=3)
    return dict(skipped=counters.skipped_total, after=_update(learner, _method("token_mean"), CASES[1], seed=8))


def _cases(aggregations: list[str]) -> list[tuple[str, int]]:
    return [*((agg, 0) for agg in aggregations), ("token_mean", 1)]


def _updates(model_dir: str, aggregations: list[str]) -> dict:
    results = {}
    for agg, c in _cases(aggregations):
        learner = _learner(model_dir, mbs=CASES[c][1], critic=CASES[c][5], sharded=True)
        results[agg, c] = _update(learner, _method(agg), CASES[c], seed=c)
    results["skip"] = _skip_then_update(_learner(model_dir, mbs=2, sharded=True))
    # rows 1 and 3 forward only: 2 micro-batches with a gradient (one per rank), then 1 without (rank 1: None pass)
    results["zero_adv"] = _update(_learner(model_dir, mbs=2, sharded=True), _method("token_mean"), CASES[1], seed=5,
                                  zero_rows=(1, 3))
    results["shared"] = _update(_learner(model_dir, mbs=2, sharded=True, share=True), _method("token_mean"), SHARED,
                                seed=11, shared=True)
    results["bf16_critic"] = _update(_learner(model_dir, mbs=2, critic=True, sharded=True, dtype=torch.bfloat16),
                                     _method("token_mean"), CASES[1][:5] + (True,), seed=12)
    return results


def test_fsdp_update_equals_one_process_for_every_aggregation(two_processes, tiny_model):
    _check_updates(two_processes, tiny_model)


def _check_updates(run: dict, tiny_model: str) -> None:
    sharded = run["updates"]
    aggregations = run["aggregations"]
    assert aggregations == AGGREGATIONS.names()
    for agg, c in _cases(aggregations):
        case = CASES[c]
        local = _update(_learner(tiny_model, mbs=case[1], critic=case[5], sharded=False), _method(agg), case, seed=c)
        got = sharded[agg, c]
        assert len(local["grads"]) == case[2]
        weights = ("params", "critic")  # the rest within 1e-5: loss, metrics, gradients, pi_old, values
        _close({k: v for k, v in got.items() if k not in weights},
               {k: v for k, v in local.items() if k not in weights}, 1e-5, f"{agg} case {c}")
        # After two Adam steps: m = 0.9 m + 0.1 g cancels where consecutive gradients nearly do, which
        # amplifies the rounding of a summation order; the weights still agree to 1e-4.
        for k in weights:
            _close(got[k], local[k], 1e-4, f"{agg} case {c} {k}")
        assert local["metrics"]["objective/loss"] != 0.0
    local = _skip_then_update(_learner(tiny_model, mbs=2, sharded=False))
    assert local["skipped"] == sharded["skip"]["skipped"] == 1
    _close(sharded["skip"]["after"], local["after"], 1e-5, "the update after a skipped step")
    local = _update(_learner(tiny_model, mbs=2, sharded=False), _method("token_mean"), CASES[1], seed=5,
                    zero_rows=(1, 3))
    assert local["metrics"]["perf/forward_only_frac"] == sharded["zero_adv"]["metrics"]["perf/forward_only_frac"] == 0.4
    _close(sharded["zero_adv"], local, 1e-4, "forward-only zero-advantage rows")
    for share in (False, True):  # shared prompts on 2 ranks whose micro-batches share differently: the same update
        local = _update(_learner(tiny_model, mbs=2, sharded=False, share=share), _method("token_mean"), SHARED,
                        seed=11, shared=True)
        _close({k: v for k, v in sharded["shared"].items() if k != "params"},
               {k: v for k, v in local.items() if k != "params"}, 1e-5, f"shared prompts (local share={share})")
        _close(sharded["shared"]["params"], local["params"], 1e-4, "shared prompts: weights")
    # a float32 value head on a bfloat16 backbone (ppo --dtype bfloat16): FSDP2 refused to shard it at all
    bf16 = sharded["bf16_critic"]
    assert torch.isfinite(torch.tensor(bf16["metrics"]["objective/loss"]))
    assert bf16["critic"]["head.weight"].abs().sum() > 0  # zero at the start: the critic took its step


# ---------------------------------------------------------------------------------------------------------------------
# (2) checkpoints across world sizes, (3) export


def _checkpoints(rank: int, model_dir: str, local_ckpt: str, run_dir: str) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    def optimizer_state(model, optimizer):  # a copy: Adam's step counts are incremented in place
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return copy.deepcopy(get_optimizer_state_dict(model, optimizer, options=options))

    resumed = _learner(model_dir, mbs=2, critic=True, reference=True, sharded=True)
    resumed.load(local_ckpt)  # one process -> two
    loaded = dict(params=_state(resumed.model), optimizer=optimizer_state(resumed.model, resumed.optimizer),
                  critic=_state(resumed.critic), critic_optimizer=optimizer_state(resumed.critic, resumed.critic_opt))
    learner = _learner(model_dir, mbs=2, critic=True, reference=True, sharded=True)  # a fresh run
    method = _method("token_mean", kl=True)
    _update(learner, method, STEP, seed=11)
    learner.begin_step(1)
    torch.rand(1 + rank)  # the ranks' generators draw apart (as dropout on their own rows does)
    path = learner.save(run_dir, 1, {"step": 1})
    draws = torch.rand(4)
    saved = dict(params=_state(learner.model), critic=_state(learner.critic), reference=_state(learner.reference),
                 optimizer=optimizer_state(learner.model, learner.optimizer),
                 critic_optimizer=optimizer_state(learner.critic, learner.critic_opt), lr=learner.lr,
                 weights=copy.deepcopy(learner.weights()))
    second = _update(learner, method, STEP, seed=12)
    assert rank == 0 or saved["weights"] == {}  # the full state dict lands on rank 0 only
    _learner(model_dir, mbs=2, critic=True, reference=True, sharded=True).load(path)
    assert torch.equal(torch.rand(4), draws), f"rank {rank} resumed with another rank's random state"
    return dict(loaded=loaded, saved=saved, second=second, path=str(path))


def _worker(rank: int, model_dir: str, local_ckpt: str, run_dir: str, out: str, aggregations: list[str]) -> None:
    results = dict(updates=_updates(model_dir, aggregations), aggregations=aggregations,
                   **_checkpoints(rank, model_dir, local_ckpt, run_dir))
    if rank == 0:
        torch.save(results, out)


def _run_processes(model_dir: str, root: Path, *, world: int = WORLD, gpu: bool = False) -> None:
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    local = _learner(model_dir, mbs=2, critic=True, reference=True, sharded=False)
    _update(local, _method("token_mean", kl=True), STEP, seed=10)
    local_ckpt = local.save(root / "local_run", 0, {"step": 0})
    before = dict(params=_state(local.model), optimizer=get_optimizer_state_dict(local.model, local.optimizer),
                  critic=_state(local.critic),
                  critic_optimizer=get_optimizer_state_dict(local.critic, local.critic_opt))
    _spawn(_worker, model_dir, str(local_ckpt), str(root / "run"), str(root / "spawned.pt"), AGGREGATIONS.names(),
           world=world, gpu=gpu)
    spawned = torch.load(root / "spawned.pt", weights_only=False, map_location="cpu")
    torch.save(dict(before=before, **spawned), root / "out.pt")


@pytest.fixture(scope="module")
def two_processes(tiny_model, tmp_path_factory):
    """Every aggregation's updates at world size 2; a one-process checkpoint resumed at world size 2; a fresh run's
    update, sharded save and one more update. Run once per pytest run, also when xdist sends the tests of this
    module to several workers (they share the result through a locked directory; the tiny model is seeded)."""
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        root = tmp_path_factory.mktemp("fsdp")
        _run_processes(tiny_model, root)
    else:
        from filelock import FileLock

        root = tmp_path_factory.getbasetemp().parent / "fsdp_two_processes"  # this run's, shared by its workers
        with FileLock(f"{root}.lock"):
            if not (root / "out.pt").exists():
                root.mkdir(exist_ok=True)
                _run_processes(tiny_model, root)
    return torch.load(root / "out.pt", weights_only=False)


def _equal(a, b, what: str) -> None:
    if isinstance(a, dict):
        assert a.keys() == b.keys(), what
        for k in a:
            _equal(a[k], b[k], f"{what}[{k}]")
    elif isinstance(a, list):
        assert len(a) == len(b), what
        for i, (x, y) in enumerate(zip(a, b)):
            _equal(x, y, f"{what}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b), what
    else:
        assert a == b, what


def test_sharded_checkpoint_resumes_at_another_world_size_exactly(two_processes, tiny_model):
    _check_resume(two_processes, tiny_model, world=WORLD, tol=1e-6)


def _check_resume(run: dict, tiny_model: str, *, world: int, tol: float) -> None:
    """``tol``: of the step after the resume against the sharded run's own next step."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    from polyrl.checkpoint import latest_checkpoint, verify_checkpoint

    _equal(run["loaded"], run["before"], f"one-process checkpoint loaded at world size {world}")
    path = Path(run["path"])
    meta = verify_checkpoint(path)
    assert meta["layout"] == "dcp" and meta["world_size"] == world and latest_checkpoint(path.parent.parent) == path
    assert sorted(p.name for p in path.iterdir()) == ["dcp", "meta.json", "trainer_state.pt"]
    saved = run["saved"]
    _equal(saved["weights"], saved["params"], "weights() on rank 0")
    _equal(saved["reference"], saved["params"], "reference synced to the policy by begin_step")
    # The critic's LM head never has a gradient, so no Adam state; a resumed optimizer must not invent one.
    assert "backbone.lm_head.weight" not in saved["critic_optimizer"]["state"]

    learner = _learner(tiny_model, mbs=2, critic=True, reference=True, sharded=False)  # no process group here
    assert learner.load(path) == {"step": 1}
    _equal(_state(learner.model), saved["params"], "policy")
    _equal(_state(learner.critic), saved["critic"], "critic")
    _equal(_state(learner.reference), saved["reference"], "reference")
    _equal(get_optimizer_state_dict(learner.model, learner.optimizer), saved["optimizer"], "optimizer")
    _equal(get_optimizer_state_dict(learner.critic, learner.critic_opt), saved["critic_optimizer"], "critic optimizer")
    assert learner.lr == saved["lr"]
    second = _update(learner, _method("token_mean", kl=True), STEP, seed=12)
    _close(run["second"]["params"], second["params"], tol, "policy after one more step")
    _close(run["second"]["critic"], second["critic"], tol, "critic after one more step")
    _close(run["second"]["metrics"], second["metrics"], 1e-5, "metrics of the step after the resume")


def test_export_hf_loads_with_from_pretrained(two_processes, tiny_model, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from polyrl.learner.sharded import export_hf

    out = export_hf(two_processes["path"], tmp_path / "hf", tiny_model)
    model = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    _equal({k: v for k, v in model.state_dict().items()}, two_processes["saved"]["params"], "exported weights")
    assert AutoTokenizer.from_pretrained(out).get_vocab() == AutoTokenizer.from_pretrained(tiny_model).get_vocab()


@pytest.mark.gpu
def test_one_gpu_on_nccl_equals_one_process_on_the_cpu(tiny_model, tmp_path):
    """FSDP2 over NCCL with one process on its GPU: every aggregation's update, a skipped step and forward-only rows
    as on the CPU (within 1e-5; weights after two Adam steps 1e-4); a CPU checkpoint loaded on the GPU exactly, and the
    GPU's sharded checkpoint resumed on the CPU in one process (its next step within 1e-4 of the GPU's: the two
    devices sum in different orders, and Adam amplifies that where consecutive gradients nearly cancel)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    _run_processes(tiny_model, tmp_path, world=1, gpu=True)
    run = torch.load(tmp_path / "out.pt", weights_only=False)
    _check_updates(run, tiny_model)
    _check_resume(run, tiny_model, world=1, tol=1e-4)


@pytest.mark.gpu
def test_one_process_on_the_gpu_equals_the_cpu(tiny_model, tmp_path):
    """LocalLearner with its models on the GPU (``--device cuda``): every aggregation's update (critic and top-K
    included) within 1e-5 of the CPU's, weights after two Adam steps within 1e-4, results handed back on the CPU; its
    checkpoint resumes on the CPU with the same weights and optimizer state."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    def learner(device: str, case) -> LocalLearner:
        model, _, crit = _models(tiny_model, case[5], False)
        crit = None if crit is None else crit.to(device)
        return LocalLearner(model.to(device), micro_batch_size=case[1], critic=crit, **SETTINGS)

    def on_cpu(x):
        return {k: on_cpu(v) for k, v in x.items()} if isinstance(x, dict) else x.cpu() if torch.is_tensor(x) else x


    for agg, c in _cases(AGGREGATIONS.names()):
        case = CASES[c]
        gpu = learner("cuda", case)
        got, want = _update(gpu, _method(agg), case, seed=c), _update(learner("cpu", case), _method(agg), case, seed=c)
        assert got["old_logp"].device.type == "cpu" and gpu.model.lm_head.weight.device.type == "cuda"
        weights = ("params", "critic")
        _close({k: v for k, v in got.items() if k not in weights},
               {k: v for k, v in want.items() if k not in weights}, 1e-5, f"{agg} case {c}")
        for k in weights:
            _close(got[k], want[k], 1e-4, f"{agg} case {c} {k}")
    path = gpu.save(tmp_path / "run", 1, {"step": 1})
    resumed = learner("cpu", CASES[1])
    assert resumed.load(path) == {"step": 1}
    _equal(_state(resumed.model), _state(gpu.model), "weights")
    _equal(get_optimizer_state_dict(resumed.model, resumed.optimizer),
           on_cpu(get_optimizer_state_dict(gpu.model, gpu.optimizer)), "optimizer state")
