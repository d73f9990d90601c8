"""Asynchronous generation: a separate process samples the next batches while the trainer trains.

Why a process and not a thread: sampling and training are both CPU/GPU-bound Python loops, and a
thread would share the interpreter lock and the trainer's torch thread pool. The generation process
(``spawn`` start method, so no forked CUDA or OpenMP state) loads its own copy of the policy and an
``EpisodeRunner`` over an ``HFGenerator``; the task is rebuilt there by name, so multi-turn tool
tasks work unchanged.

Weights travel through shared memory: at start the trainer's state dict is cloned into shared
tensors; ``push`` copies the new weights into them under a lock and sets a shared version counter
(the number of optimizer steps those weights have seen). Nothing is pickled per step. The cost is
two more copies of the weights in host memory (the shared buffer and the child's model).

The frozen reference scores there too (``reference=True``): its log-probs depend on the sample alone,
so the process that generated a batch annotates it (``Sample.ref_logprobs``) while the trainer is busy,
and the trainer's critical path loses a forward pass -- what verl and OpenRLHF do with a separate
reference worker. A reference synced to the policy (Humanline) stays in the trainer.

The staleness bound. Requests are FIFO, one per trainer step ``m`` (the batch the trainer consumes
at step ``m``). Before generating request ``m`` the process waits until ``version >= m - k``, then
loads the newest weights and stamps every ``Sample.policy_version`` with the version it used. So a
batch consumed at step ``m`` was sampled by weights that are at most ``k`` optimizer steps old
(``0 <= m - policy_version <= k``); with ``k = 0`` generation waits for the latest weights.

Failures never hang the trainer: the child sends its traceback, ``result`` raises it as a
``PipelineError``, ``result`` polls with a timeout and checks the child is alive, a request that
could only be served by weights never pushed is refused at once, and ``close`` joins with a timeout
and then terminates.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import os
import queue
import signal
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.multiprocessing as mp
from torch import Tensor

from polyrl.batch import TokenBatch, logprobs_nograd
from polyrl.model import load_policy
from polyrl.rollout.episodes import EpisodeRunner
from polyrl.rollout.generator import Sample, SamplingParams
from polyrl.rollout.hf import HFGenerator
from polyrl.tasks import Prompt, get_task

POLL_S = 0.1  # how often the child re-checks the stop flag and the parent while it waits
RESULT_POLL_S = 1.0  # how often result() checks that the child is alive while it waits
JOIN_S = 5.0  # how long close() waits for the child to exit before terminating it


class PipelineError(RuntimeError):
    """The generation process failed or exited; the message carries its traceback."""


@dataclass(frozen=True)
class _Request:
    step: int
    prompts: list[Prompt]
    params: SamplingParams


@dataclass(frozen=True)
class _ChildConfig:
    """What the generation process builds its models from (passed once, at process start)."""

    model_dir: str
    task_name: str
    data_file: str | None
    staleness: int
    dtype: str
    fp32_head: bool
    threads: int
    reference: bool  # also load the starting model as the frozen reference and score every sample with it
    logprob_kwargs: dict  # micro_batch_size, temperature, top_p, top_k: as the trainer scores
    heldout_percent: int = 10  # math task: the same held-out split as the trainer's


@dataclass
class _Shared:
    """Everything the child shares with the parent (passed once, at process start)."""

    weights: dict[str, Tensor]  # shared-memory tensors, written by push() under `cond`
    cond: object  # multiprocessing Condition: guards weights and version; push() notifies
    version: object  # multiprocessing Value("q"): optimizer steps the shared weights have seen
    discard_below: object  # multiprocessing Value("q"): requests for earlier steps are skipped, not generated
    stop: object  # multiprocessing Event: set by close()
    requests: object  # multiprocessing Queue of _Request (None = stop)
    results: object  # multiprocessing Queue of (kind, step, payload); kind in ok | skipped | error


class AsyncPipeline:
    """Generate the batches of future trainer steps in a separate process, at most ``staleness`` versions old.

    ``reference=True`` also scores every sample under the starting model (``Sample.ref_logprobs``);
    ``micro_batch_size``, ``temperature``, ``top_p`` and ``top_k`` are that scoring's (as the trainer's
    ``logprobs_nograd``) and matter only then.
    """

    def __init__(
        self,
        model_dir: str,
        *,
        task_name: str,
        data_file: str | None,
        staleness: int,
        heldout_percent: int = 10,
        weights: dict[str, Tensor],
        dtype: str = "float32",
        fp32_head: bool = False,
        threads: int = 1,
        version: int = 0,
        reference: bool = False,
        micro_batch_size: int = 8,
        temperature: float = 1.0,
        top_p: float | None = None,
        top_k: int | None = None,
    ) -> None:
        if staleness < 0:
            raise ValueError(f"staleness must be >= 0, got {staleness}")
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        if version < 0:
            raise ValueError(f"version must be >= 0, got {version}")
        if not weights:
            raise ValueError("weights must be the trainer's state dict, got an empty dict")
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
        self.staleness = staleness
        self._version = version  # last version pushed (initial weights: `version`, default 0)
        self._pending: dict[int, tuple[tuple[str, ...], SamplingParams]] = {}  # step -> request, in FIFO order
        self._floor = 0  # smallest step submit() accepts: past every submitted or discarded step
        self._done: dict[int, list[Sample]] = {}  # results received and not yet returned
        self._error: str | None = None
        self._closed = False
        ctx = mp.get_context("spawn")
        self._shared = _Shared(
            weights={name: t.detach().to("cpu", copy=True).contiguous().share_memory_() for name, t in weights.items()},
            cond=ctx.Condition(ctx.Lock()),
            version=ctx.Value("q", version, lock=False),
            discard_below=ctx.Value("q", -1),
            stop=ctx.Event(),
            requests=ctx.Queue(),
            results=ctx.Queue(),
        )
        self._process = ctx.Process(
            target=_worker,
            args=(_ChildConfig(model_dir, task_name, data_file, staleness, dtype, fp32_head, threads, reference,
                               dict(micro_batch_size=micro_batch_size, temperature=temperature, top_p=top_p,
                                    top_k=top_k), heldout_percent), self._shared),
            name="polyrl-generation",
            daemon=True,  # never outlives the trainer
        )
        self._process.start()

    # ----------------------------------------------------------------------------------------- trainer side

    def submit(self, step: int, prompts: list[Prompt], params: SamplingParams) -> None:
        """Queue the generation of the batch the trainer will consume at ``step`` (steps strictly increase)."""
        self._check_open()
        if step < self._floor:
            raise ValueError(f"submit: step must be >= {self._floor} (past every submitted or collected step), "
                             f"got {step}")
        if not prompts:
            raise ValueError(f"submit: step {step} has no prompts")
        self._floor = step + 1
        self._pending[step] = (tuple(p.id for p in prompts), params)
        self._shared.requests.put(_Request(step, list(prompts), params))

    def result(self, step: int, prompts: list[Prompt], params: SamplingParams) -> list[Sample] | None:
        """The samples generated for ``step``, or None when ``step`` was not submitted with these prompts/params.

        Blocks until the child has generated them. Pending requests of earlier steps are discarded (never
        generated if not started). A mismatch discards the request for ``step`` too; the caller then
        generates synchronously.
        """
        self._check_open()
        self._discard_before(step)
        request = self._pending.get(step)
        if request is None:
            return None
        if request != (tuple(p.id for p in prompts), params):
            self._discard_before(step + 1)
            return None
        if step - self.staleness > self._version:
            raise ValueError(
                f"result: step {step} needs weights of version >= {step - self.staleness} (staleness "
                f"{self.staleness}) but the last pushed version is {self._version}; it would wait forever"
            )
        while step not in self._done:
            self._receive()
        del self._pending[step]
        return self._done.pop(step)

    def push(self, state_dict: dict[str, Tensor], version: int) -> None:
        """Publish the trainer's weights after an optimizer step; ``version`` = optimizer steps done."""
        self._check_open()
        if version <= self._version:
            raise ValueError(f"push: version must increase, got {version} after {self._version}")
        shared = self._shared.weights
        if state_dict.keys() != shared.keys():
            missing, extra = sorted(shared.keys() - state_dict.keys()), sorted(state_dict.keys() - shared.keys())
            raise ValueError(f"push: state dict keys differ from the initial weights: missing {missing[:5]}, "
                             f"unexpected {extra[:5]}")
        for name, tensor in state_dict.items():
            if tensor.shape != shared[name].shape:
                raise ValueError(f"push: {name} has shape {tuple(tensor.shape)}, expected {tuple(shared[name].shape)}")
        with self._locked(), torch.no_grad():
            for name, tensor in state_dict.items():
                shared[name].copy_(tensor)
            self._shared.version.value = version
            self._shared.cond.notify_all()
        self._version = version

    @property
    def version(self) -> int:
        """The version of the last weights pushed (the initial weights' version before any push)."""
        return self._version

    @property
    def next_step(self) -> int:
        """The smallest step submit() accepts (past every step submitted, collected or discarded)."""
        return self._floor

    @property
    def alive(self) -> bool:
        """Whether the generation process is running."""
        return self._process.is_alive()

    def pending(self) -> list[int]:
        """Steps submitted and not yet collected or discarded, oldest first."""
        return list(self._pending)

    def close(self) -> None:
        """Stop the generation process; never hangs (join with a timeout, then terminate, then kill)."""
        if self._closed:
            return
        self._closed = True
        self._shared.stop.set()
        with contextlib.suppress(Exception):
            self._shared.requests.put_nowait(None)
        process = self._process
        process.join(JOIN_S)
        if process.is_alive():
            process.terminate()
            process.join(JOIN_S)
        if process.is_alive():
            process.kill()
            process.join()
        for q in (self._shared.requests, self._shared.results):
            q.cancel_join_thread()  # never block interpreter exit on undelivered messages
            q.close()

    def __enter__(self) -> AsyncPipeline:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ----------------------------------------------------------------------------------------- helpers

    def _check_open(self) -> None:
        if self._closed:
            raise PipelineError("the asynchronous pipeline is closed")
        if self._error is not None:
            raise PipelineError(self._error)

    def _discard_before(self, bound: int) -> None:
        """Forget pending requests of steps < bound; the child skips those it has not started."""
        old = [s for s in self._pending if s < bound]
        for s in old:
            del self._pending[s]
            self._done.pop(s, None)
        self._floor = max(self._floor, bound)
        if old:  # every pending step < bound is gone and none will be submitted again: the child may skip them
            self._shared.discard_below.value = max(self._shared.discard_below.value, bound)

    def _receive(self) -> None:
        """Take one message from the child (waiting at most RESULT_POLL_S) and file it; raise if the child died."""
        try:
            kind, step, payload = self._shared.results.get(timeout=RESULT_POLL_S)
        except queue.Empty:
            if self._process.is_alive():
                return
            try:  # it may have exited right after sending its last message
                kind, step, payload = self._shared.results.get(timeout=RESULT_POLL_S)
            except queue.Empty:
                self._error = f"the generation process exited (exit code {self._process.exitcode}) without a result"
                raise PipelineError(self._error) from None
        if kind == "error":
            self._error = payload
            raise PipelineError(payload)
        if kind == "ok" and step in self._pending:
            self._done[step] = payload

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """Hold the weights lock; refuse (instead of hanging) if the child died holding it."""
        while not self._shared.cond.acquire(timeout=RESULT_POLL_S):
            if not self._process.is_alive():
                raise PipelineError(f"the generation process exited (exit code {self._process.exitcode}) "
                                    "holding the weights lock")
        try:
            yield
        finally:
            self._shared.cond.release()


# --------------------------------------------------------------------------------------------- child side


def _worker(cfg: _ChildConfig, shared: _Shared) -> None:
    """The generation process: serve requests until stopped; any failure is sent to the trainer as text."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle; it closes us
    code = 0
    try:
        torch.set_num_threads(cfg.threads)
        model, tokenizer = load_policy(cfg.model_dir, dtype=cfg.dtype, threads=cfg.threads)
        generator = HFGenerator(model, tokenizer, fp32_head=cfg.fp32_head)
        score = None
        if cfg.reference:  # the starting model, as the trainer's frozen reference is
            reference = load_policy(cfg.model_dir, dtype=cfg.dtype, threads=cfg.threads)[0].requires_grad_(False)
            score = functools.partial(_score_reference, reference, generator.pad_id,
                                      dict(fp32_head=cfg.fp32_head, **cfg.logprob_kwargs))
        runner = EpisodeRunner(generator, tokenizer, get_task(cfg.task_name, cfg.data_file, cfg.heldout_percent))
        _serve(runner, generator, cfg.staleness, shared, score)
        shared.results.cancel_join_thread()  # stopping: undelivered results do not matter
    except BaseException as error:  # every failure must reach the trainer, never hang it
        code = 1
        shared.results.put(("error", None, f"generation process failed: {type(error).__name__}: {error}\n"
                                           f"{traceback.format_exc()}"))
    shared.results.close()
    shared.results.join_thread()  # the error message, if any, is in the pipe
    # Exit right after multiprocessing's own clean-up (it runs when this function returns), skipping the
    # interpreter's module teardown: with transformers loaded that takes seconds, and close() waits for it.
    atexit.register(os._exit, code)


def _score_reference(reference: torch.nn.Module, pad_id: int, kwargs: dict, samples: list[Sample]) -> None:
    """Annotate every sample with its completion tokens' log-probs under the frozen reference."""
    logp = logprobs_nograd(reference, TokenBatch.from_samples(samples, pad_id), **kwargs).logp
    for i, sample in enumerate(samples):
        sample.ref_logprobs = logp[i, : len(sample.completion_token_ids)].tolist()


def _serve(runner: EpisodeRunner, generator: HFGenerator, staleness: int, shared: _Shared,
           score: Callable[[list[Sample]], None] | None = None) -> None:
    """Serve requests in order, each at weights at most ``staleness`` versions older than its step."""
    loaded = None  # version of the weights in the model; the shared initial weights are loaded first
    while (request := _next_request(shared)) is not None:
        if request.step < shared.discard_below.value:
            shared.results.put(("skipped", request.step, None))
            continue
        if not _wait_for_version(shared, request.step - staleness):
            return
        with shared.cond:
            if shared.version.value != loaded:
                generator.load_weights(shared.weights)
                loaded = shared.version.value
        samples = runner.sample(request.prompts, request.params)
        for sample in samples:
            sample.policy_version = loaded
        if score is not None:
            score(samples)
        shared.results.put(("ok", request.step, samples))


def _parent_alive() -> bool:
    parent = mp.parent_process()
    return parent is None or parent.is_alive()


def _next_request(shared: _Shared) -> _Request | None:
    """The next request, or None when stopped (close(), or the trainer process is gone)."""
    while not shared.stop.is_set() and _parent_alive():
        try:
            return shared.requests.get(timeout=POLL_S)
        except queue.Empty:
            continue
    return None


def _wait_for_version(shared: _Shared, needed: int) -> bool:
    """Wait until the shared weights have seen ``needed`` optimizer steps; False when stopped first."""
    with shared.cond:
        while shared.version.value < needed:
            if shared.stop.is_set() or not _parent_alive():
                return False
            shared.cond.wait(timeout=POLL_S)
    return True


def prefetched(pipeline: AsyncPipeline, runner: EpisodeRunner, step: int) -> Callable[[list[Prompt], SamplingParams],
                                                                                     list[Sample]]:
    """A sample function for ``collect``: the batch prefetched for ``step`` when it matches, else sampled here.

    The first step, a dynamic-sampling refill round, or a stream that moved (a refill drew extra prompts)
    fall back to in-process sampling with the current weights (version ``step``, staleness 0).
    """
    def sample(prompts: list[Prompt], params: SamplingParams) -> list[Sample]:
        got = pipeline.result(step, prompts, params) if step in pipeline.pending() else None
        if got is None:
            got = runner.sample(prompts, params)
            for s in got:
                s.policy_version = step
        return got

    return sample
