"""Ray rollout workers: the same batches as in-process generation, the staleness bound, surviving a killed worker.

One local Ray instance (4 logical CPUs) serves the module; pools join it and leave it running. The tests
that go through ``train`` with rollout workers start and stop their own instance, as a user's run does.
"""

from __future__ import annotations

import io
import os
import re
import signal
import time

import pytest
import torch
from rich.console import Console

from polyrl.methods import get_method
from polyrl.model import load_policy
from polyrl.rollout.agency.arbiter import AgencyArbiter
from polyrl.rollout.episodes import EpisodeRunner, prefix_episode
from polyrl.rollout.generator import SamplingParams
from polyrl.rollout.group import GroupSource
from polyrl.rollout.remote import RemoteRunner, WorkerError, WorkerPool, WorkerSpec
from polyrl.rollout.remote.prefetch import Prefetch
from polyrl.rollout.source import PromptStream
from polyrl.rollout.tree.config import TreeConfig
from polyrl.rollout.tree.sampler import TreeSampler
from polyrl.rollout.tree.source import TreeSource
from polyrl.tasks import CalculatorTask
from polyrl.tasks.arithmetic import AdditionTask
from polyrl.tasks.rewards import RewardChannels
from polyrl.tinylm import build_tiny_llama

ray = pytest.importorskip("ray")
QUIET = Console(file=io.StringIO(), width=120)
DENSE = "tests.reward_fns:digit_fraction"  # every group has variance: no group is filtered out


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    learner = build_tiny_llama(root / "learner", hidden=32, layers=2, heads=2, seed=0)
    baseline = build_tiny_llama(root / "baseline", hidden=32, layers=2, heads=2, seed=1)
    return str(learner), str(baseline)


@pytest.fixture(scope="module")
def cluster():
    ray.init(address="local", num_cpus=4, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    yield
    ray.shutdown()


def _policy(model_dir):
    return load_policy(model_dir, threads=1)


def _remote(model_dir, task, policy, tokenizer, workers, **spec):
    """A local runner on ``policy`` and a RemoteRunner over ``workers`` actors sampling with its weights."""
    from polyrl.rollout.hf import HFGenerator

    local = EpisodeRunner(HFGenerator(policy, tokenizer), tokenizer, task)
    pool = WorkerPool(WorkerSpec(model_dir, task, **spec), workers=workers, weights=policy.state_dict)
    return local, RemoteRunner(local, pool, local.generator.arbiter)


def _perturb(policy, seed):
    """One fake optimizer step: every weight moves a little (seeded)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.02)


def _same(a, b):
    assert [s.completion_token_ids for s in a] == [s.completion_token_ids for s in b]
    assert [s.prompt_token_ids for s in a] == [s.prompt_token_ids for s in b]
    for x, y in zip(a, b):
        assert x.logprobs == pytest.approx(y.logprobs, abs=1e-5)
        assert (x.loss_mask, x.turn_ids, x.finish_reason) == (y.loss_mask, y.turn_ids, y.finish_reason)


def _group_source(runner, steps=3, prefetch=None):
    sampling = lambda step: SamplingParams(n=4, max_new_tokens=6, seed=1_000_003 + step)  # noqa: E731
    return GroupSource(runner, RewardChannels(AdditionTask(), [DENSE]), num_groups=3, sampling=sampling,
                       max_rounds=1, steps=steps, prefetch=prefetch)


@pytest.mark.parametrize("workers", [1, 2])
def test_workers_give_the_in_process_batches(cluster, models, workers):
    task, method = AdditionTask(), get_method("grpo")
    policy, tokenizer = _policy(models[0])
    local, remote = _remote(models[0], task, policy, tokenizer, workers)
    here, there = _group_source(local), _group_source(remote)
    streams = PromptStream.of(task, 0), PromptStream.of(task, 0)
    try:
        for step in range(3):
            a, b = here.collect(method, streams[0], step), there.collect(method, streams[1], step)
            _same(a.samples, b.samples)
            assert torch.equal(a.scores, b.scores) and torch.equal(a.group_ids, b.group_ids)
            assert b.stats["rollout/worker_restarts"] == 0 and 0 < b.stats["rollout/worker_utilization"] <= 1
            _perturb(policy, step)  # the trainer's update; the in-process generator shares the module
            for source in (here, there):
                source.after_update(policy.state_dict, step + 1)
    finally:
        there.close()


def test_tree_multiturn_and_agency_run_through_the_workers(cluster, models):
    policy, tokenizer = _policy(models[0])
    # the tree sampler: a whole step's tree (roots, branch points, continuations) on two actors
    task, tree = AdditionTask(), TreeConfig()
    sources = []
    for runner in _remote(models[0], task, policy, tokenizer, 2):
        sampler = TreeSampler(runner, {}, root_frac=tree.root_frac, roots=tree.roots, candidate_factor=tree.candidates,
                              prune=tree.prune, branch=tree.branch, half_life=tree.half_life, max_group=tree.max_group,
                              objective=tree.probe)
        sampling = lambda step: SamplingParams(n=4, max_new_tokens=6, seed=7 + step)  # noqa: E731
        sources.append(TreeSource(sampler, RewardChannels(task, ["tests.reward_fns:even_length"]), num_groups=3,
                                  sampling=sampling))
    a, b = (s.collect(get_method("grpo"), PromptStream.of(task, 0), 0) for s in sources)
    _same(a.samples, b.samples)
    assert torch.equal(a.tree.branch_at, b.tree.branch_at) and torch.equal(a.group_ids, b.group_ids)
    # continuations of a prefix (what the tree's branches are): the copied prefix is context, the rest sampled
    local, remote = sources[0].sampler.runner, sources[1].sampler.runner
    params = SamplingParams(n=1, max_new_tokens=8, seed=9)
    roots = local.run(local.new(task.prompts("train", 3, 0), 2), params)
    branches = [[prefix_episode(e, min(3, len(e.token_ids) // 2)) for e in roots] for _ in range(2)]
    local.run(branches[0], params, key_offset=100)
    remote.run(branches[1], params, key_offset=100)
    _same(*(local.to_samples(b, list(range(len(b)))) for b in branches))
    assert any(b.loss_mask[0] == 0 for b in branches[1])
    sources[1].close()
    # multi-turn tool episodes: the calculator answers inside the actor
    calc = CalculatorTask()
    local, remote = _remote(models[0], calc, policy, tokenizer, 2)
    params = SamplingParams(n=4, max_new_tokens=16, seed=1)  # a seed at which the tiny model calls the tool once
    prompts = calc.prompts("train", 6, 0)
    a, b = local.sample(prompts, params), remote.sample(prompts, params)
    _same(a, b)
    assert any(0 in s.loss_mask for s in a), "no tool call happened: the environment was not exercised"
    remote.close()
    # agency transfer: the baseline decodes alongside inside the actor, at the driver's beta
    from polyrl.rollout.hf import HFGenerator

    generator = HFGenerator(policy, tokenizer)
    generator.arbiter = AgencyArbiter(_policy(models[1])[0], lambda step: 0.5)
    local = EpisodeRunner(generator, tokenizer, task)
    pool = WorkerPool(WorkerSpec(models[0], task, baseline_dir=models[1]), workers=2, weights=policy.state_dict)
    remote = RemoteRunner(local, pool, generator.arbiter)
    prompts = task.prompts("train", 4, 0)
    a, b = local.sample(prompts, SamplingParams(n=4, max_new_tokens=6, seed=3)), \
        remote.sample(prompts, SamplingParams(n=4, max_new_tokens=6, seed=3))
    _same(a, b)
    assert 0 < sum(s.baseline_tokens for s in b) < sum(len(s.completion_token_ids) for s in b)
    remote.close()


def test_staleness_bound_holds_under_a_slow_trainer(cluster, models):
    k, steps, task, method = 2, 6, AdditionTask(), get_method("grpo")
    policy, tokenizer = _policy(models[0])
    local, remote = _remote(models[0], task, policy, tokenizer, 1)
    source = _group_source(remote, steps=steps, prefetch=Prefetch(remote, k))
    stream = PromptStream.of(task, 0)
    versions = {0: {n: t.clone() for n, t in policy.state_dict().items()}}
    checker, _ = _policy(models[0])  # regenerates a batch in-process with the weights it claims to have used
    replay = EpisodeRunner(local.generator.__class__(checker, tokenizer), tokenizer, task)
    seen = []
    try:
        for step in range(steps):
            prompts = [p for _, p in stream.peek(0, 3)]
            batch = source.collect(method, stream, step)
            time.sleep(0.3)  # a slow trainer: the actor could run far ahead if nothing held it back
            assert 0 <= batch.stats["async/staleness_max"] <= k
            version = batch.samples[0].policy_version
            assert all(s.policy_version == version for s in batch.samples) and step - k <= version <= step
            checker.load_state_dict(versions[version])
            _same(replay.sample(prompts, SamplingParams(n=4, max_new_tokens=6, seed=1_000_003 + step)),
                  batch.samples)
            seen.append(step - version)
            _perturb(policy, step)
            versions[step + 1] = {n: t.clone() for n, t in policy.state_dict().items()}
            source.after_update(policy.state_dict, step + 1)
    finally:
        source.close()
    assert max(seen) == k, f"the bound was never reached (staleness {seen}): nothing was prefetched"


def _addition_runners(model_dir, workers: int, prompts: int):
    """(local runner, remote runner over ``workers`` actors, sampling params, ``prompts`` addition prompts)."""
    task = AdditionTask()
    policy, tokenizer = _policy(model_dir)
    local, remote = _remote(model_dir, task, policy, tokenizer, workers)
    return local, remote, SamplingParams(n=4, max_new_tokens=6, seed=11), task.prompts("train", prompts, 0)


def test_a_killed_worker_is_restarted_and_its_calls_reissued(cluster, models):
    local, remote, params, prompts = _addition_runners(models[0], 2, 6)
    try:
        victim = remote.pool.pids()[0]
        remote.sample(prompts, params)  # both actors have served a call: their incarnations are known
        episodes = remote.new(prompts, params.n)
        pending = remote.submit(episodes, params)
        os.kill(victim, signal.SIGKILL)  # kill -9 while its chunk is in flight
        remote.pool.wait(pending)
        got = remote.to_samples(episodes, [i // params.n for i in range(len(episodes))])
        _same(local.sample(prompts, params), got)  # nothing lost, nothing twice, nothing different
        assert remote.take_stats()["rollout/worker_restarts"] == 1
        assert victim not in remote.pool.pids()
    finally:
        remote.close()


def test_a_task_from_a_plugin_file_reaches_the_workers(cluster, models, tmp_path):
    """`polyrl --plugin my_task.py train --rollout-workers 1` with a task defined in that file: the file runs under a
    private module name no worker can import, and its task was pickled by reference, so every actor died in its
    constructor (ModuleNotFoundError, 8 restarts). Its classes now travel by value and the batches are the local
    ones."""
    from polyrl.plugins import import_module_or_file

    plugin = tmp_path / "my_task.py"
    plugin.write_text("from polyrl.tasks.arithmetic import AdditionTask\n\n\n"
                      "class PluginAddition(AdditionTask):\n"
                      "    name = 'plugin_addition'\n")
    task = import_module_or_file(str(plugin)).PluginAddition()
    policy, tokenizer = _policy(models[0])
    local, remote = _remote(models[0], task, policy, tokenizer, 1)
    params = SamplingParams(n=2, max_new_tokens=4, seed=5)
    prompts = task.prompts("train", 3, 0)
    try:
        _same(local.sample(prompts, params), remote.sample(prompts, params))
    finally:
        remote.close()


def test_what_ray_could_never_place_or_would_ignore_is_refused_in_one_line(cluster, models):
    spec = WorkerSpec(models[0], AdditionTask())
    weights = lambda: {}  # noqa: E731  (never called: nothing starts)
    for kwargs, says in [(dict(workers=5), "5 rollout workers need 5 CPU (the cluster has 4)"),
                         (dict(workers=1, gpus_per_worker=1.0), "need 1 GPU (the cluster has 0)"),
                         (dict(workers=1, address="auto"), "Ray is already running in this process"),
                         (dict(workers=1, cpus=2), "ray_cpus = 2 would be ignored")]:
        with pytest.raises(WorkerError, match=re.escape(says)) as e:
            WorkerPool(spec, weights=weights, **kwargs)
        assert "\n" not in str(e.value)


def test_exceptions_rank_0_broadcasts_survive_pickling():
    """Rank 0 sends an empty step (NoUsableGroups) or a reward failure to the other ranks whole."""
    import pickle

    from polyrl.errors import RewardError
    from polyrl.rollout.collect import NoUsableGroups

    empty = pickle.loads(pickle.dumps(NoUsableGroups("every group filtered", {"rollout/generated": 8.0})))
    assert str(empty) == "every group filtered" and empty.stats == {"rollout/generated": 8.0}
    error = RewardError("my.fn", "returned NaN", completion=3, prompt_index=1, traceback="tb")
    error.step = 7
    again = pickle.loads(pickle.dumps(error))
    assert str(again) == str(error) and again.traceback == "tb" and again.step == 7


def test_a_worker_restarted_before_its_first_reply_is_counted(cluster, models):
    """The pool records each actor's first incarnation at start: an actor that died before it ever replied (out of
    memory in its first generation) was restarted unseen, and rollout/worker_restarts stayed 0."""
    local, remote, params, prompts = _addition_runners(models[0], 1, 2)
    try:
        os.kill(remote.pool.pids()[0], signal.SIGKILL)  # before any call
        _same(local.sample(prompts, params), remote.sample(prompts, params))
        assert remote.take_stats()["rollout/worker_restarts"] == 1
    finally:
        remote.close()


def test_an_address_where_no_cluster_answers_is_refused_at_once():
    """`--ray-address 127.0.0.1:1` hung: ray.init retried it forever ("Failed to connect to GCS" every 30 s)."""
    import time

    from polyrl.rollout.remote.pool import WorkerError, _check_reachable

    t0 = time.monotonic()
    for address in ("127.0.0.1:1", "ray://127.0.0.1:1"):
        with pytest.raises(WorkerError, match=r"^ray_address = '.*127\.0\.0\.1:1': nothing answers there"):
            _check_reachable(address)
    assert time.monotonic() - t0 < 5
    _check_reachable("auto")  # Ray's own forms are Ray's to resolve
