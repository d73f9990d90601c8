"""What runs inside a generator actor: the policy, its sampler and the task's episode driver.

A ``RolloutWorker`` loads the starting model from ``model_dir`` (a local directory every node can read) and
builds the same ``EpisodeRunner`` over an ``HFGenerator`` as the trainer does, so single-turn groups,
multi-turn tool episodes, tree continuations and agency transfer (a frozen baseline decoding alongside)
all run here unchanged. Each call names the weights it must sample with (an id and a reference into
Ray's object store); the actor loads them only when they differ from the ones it holds. A call is
therefore complete in itself: when Ray restarts a killed actor and re-issues the call, the new actor
produces the same episodes (sampling randomness is keyed by row, see ``HFGenerator``).

With ``reference=True`` the actor also scores every completion under the frozen starting model (or the
distillation teacher in ``reference_dir``) (``Episode.ref_logprobs``), taking that forward pass off the trainer's
critical path.

The class imports no ray at module level; ``pool`` turns it into an actor with ``ray.remote``.
"""

from __future__ import annotations

import os
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import torch

from polyrl.rollout.episodes import Episode, EpisodeRunner
from polyrl.rollout.generator import SamplingParams


@dataclass(frozen=True)
class WorkerSpec:
    """Everything an actor builds its models from (sent once, when the actor starts or restarts)."""

    model_dir: str
    task: Any  # the Task object itself (pickled by Ray), so plugin and data-file tasks need no rebuilding
    dtype: str = "float32"
    fp32_head: bool = False
    threads: int = 1
    baseline_dir: str | None = None  # agency transfer: the frozen baseline's directory
    agency_mode: str = "token"
    reference: bool = False  # score every completion under the frozen starting model
    reference_dir: str | None = None  # the frozen reference's directory when it is not model_dir (a teacher)
    logprob_kwargs: dict = field(default_factory=dict)  # micro_batch_size, temperature, top_p, top_k: as the trainer


@dataclass
class WorkerReply:
    """One call's episodes and what the driver needs to account for them."""

    episodes: list[Episode]
    incarnation: str  # changes when Ray restarts the actor (counted as rollout/worker_restarts)
    busy_s: float  # seconds spent sampling (rollout/worker_utilization)
    load_s: float  # seconds spent fetching and loading new weights (perf/weight_sync_s)


class RolloutWorker:
    """A generator actor's body (see the module docstring)."""

    def __init__(self, spec: WorkerSpec) -> None:
        import ray

        from polyrl.model import load_policy
        from polyrl.rollout.agency.arbiter import AgencyArbiter
        from polyrl.rollout.hf import HFGenerator

        self.incarnation = uuid.uuid4().hex
        # The GPU Ray assigned (--rollout-worker-gpus), else the CPU: an actor that asked for no GPU must not take
        # one (Ray leaves CUDA_VISIBLE_DEVICES alone for it).
        device = torch.device("cuda" if ray.get_gpu_ids() and torch.cuda.is_available() else "cpu")
        model, tokenizer = load_policy(spec.model_dir, dtype=spec.dtype, threads=spec.threads)
        self.generator = HFGenerator(model.to(device), tokenizer, fp32_head=spec.fp32_head)
        if spec.baseline_dir is not None:  # beta comes with every call; the schedule stays with the driver
            baseline = load_policy(spec.baseline_dir, dtype=spec.dtype, threads=spec.threads)[0].to(device)
            self.generator.arbiter = AgencyArbiter(baseline, lambda step: 0.0, mode=spec.agency_mode)
        self.reference = None
        if spec.reference:
            self.reference = load_policy(spec.reference_dir or spec.model_dir, dtype=spec.dtype,
                                         threads=spec.threads)[0]
            self.reference = self.reference.to(device).requires_grad_(False)
        self.logprob_kwargs = dict(fp32_head=spec.fp32_head, **spec.logprob_kwargs)
        self.runner = EpisodeRunner(self.generator, tokenizer, spec.task)
        self.weights_id: int | None = None  # the initial weights are the directory's; the driver always sends its own

    def pid(self) -> int:
        return os.getpid()

    def whoami(self) -> str:
        """This incarnation (the pool records each actor's first at start, so a restart before any reply counts)."""
        return self.incarnation

    def run(self, episodes: list[Episode], params: SamplingParams, key_offset: int, weights: tuple[int, list],
            beta: float) -> WorkerReply:
        """Continue ``episodes`` to their end with the weights ``(id, [ref])`` and agency mixture ``beta``."""
        import ray

        started = time.perf_counter()
        weights_id, (ref,) = weights
        if weights_id != self.weights_id:
            self.generator.load_weights(ray.get(ref))
            self.weights_id = weights_id
        loaded = time.perf_counter()
        if self.generator.arbiter is not None:
            self.generator.arbiter.beta = beta
        self.runner.run(episodes, params, key_offset=key_offset)
        if self.reference is not None:
            self._score_reference(episodes)
        return WorkerReply(episodes, self.incarnation, time.perf_counter() - loaded, loaded - started)

    def _score_reference(self, episodes: list[Episode]) -> None:
        from polyrl.batch import TokenBatch, logprobs_nograd

        samples = self.runner.to_samples(episodes, list(range(len(episodes))))
        logp = logprobs_nograd(self.reference, TokenBatch.from_samples(samples, self.generator.pad_id),
                               **self.logprob_kwargs).logp
        for i, e in enumerate(episodes):
            e.ref_logprobs = logp[i, : len(e.token_ids)].tolist()
