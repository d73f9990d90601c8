"""Ray generator actors: start them (and Ray), broadcast weights, split calls across them, survive restarts.

Ray does the scheduling, transport and fault tolerance; this module only decides what each actor gets:

- **Ray itself.** With no address polyrl starts a local instance sized to the machine (``ray_cpus``, at least
  one CPU per actor) and shuts it down in ``close``; with ``--ray-address auto|HOST:PORT`` it joins a
  cluster and leaves it running.
- **Weights.** ``publish`` marks the trainer's weights as new; the next call puts them into the object
  store once (``ray.put``) under a new id, and every actor fetches them from there before sampling.
  A call carries the reference wrapped in a list, so Ray does not fetch it for an actor that already
  holds those weights.
- **Dispatch.** A call's episodes are cut into one contiguous chunk per actor; chunk ``i`` starts at key
  ``offset_i``, so the episodes equal those of one in-process ``EpisodeRunner.run`` over the whole list.
- **Restarts.** Actors are created with ``max_restarts`` and ``max_task_retries``: when an actor's process
  dies, Ray starts a new one and re-issues the calls it had in flight, with the same arguments. The reply
  names the actor's incarnation; a new incarnation is counted (``rollout/worker_restarts``). A call whose
  retries run out raises ``WorkerError`` (one line), never a partial batch.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor

from polyrl.errors import ConfigError, TrainingError
from polyrl.plugins import file_modules
from polyrl.rollout.episodes import Episode
from polyrl.rollout.generator import SamplingParams
from polyrl.rollout.remote.worker import RolloutWorker, WorkerReply, WorkerSpec
from polyrl.runs import cores

MAX_RESTARTS = 8  # per actor: Ray restarts a dead actor and re-issues its in-flight calls this many times
REPLY_TIMEOUT_S = 3600.0  # a call that takes longer than this is a hang, not a slow batch


class WorkerError(TrainingError):
    """The rollout workers cannot go on: Ray is missing or unreachable, an actor's restarts ran out, its code raised."""


@dataclass
class Pending:
    """Calls in flight for one list of episodes: one per chunk."""

    episodes: list[Episode]
    bounds: list[tuple[int, int]]  # [start, end) of each chunk
    refs: list  # ray.ObjectRef of each chunk's WorkerReply
    actors: list[int]  # which actor serves each chunk


class WorkerPool:
    """N generator actors on Ray (see the module docstring)."""

    def __init__(self, spec: WorkerSpec, *, workers: int, address: str | None = None, cpus: int = 0,
                 gpus_per_worker: float = 0.0, trainer_gpus: int = 0,
                 weights: Callable[[], dict[str, Tensor]]) -> None:
        """``trainer_gpus``: GPUs 0 .. trainer_gpus - 1 of this machine train (one per local rank, --device cuda);
        a local Ray instance polyrl starts is given the others."""
        try:
            import ray
        except ImportError:
            raise WorkerError("rollout workers need Ray: pip install 'polyrl[scale]'") from None
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.owns_ray = not ray.is_initialized()
        if not self.owns_ray and (address or cpus):
            raise WorkerError(f"Ray is already running in this process, so ray_address = {address!r} and ray_cpus = "
                              f"{cpus} would be ignored; leave them out to use it, or run polyrl in its own process")
        if self.owns_ray:
            _start_ray(address, cpus or max(cores(), workers), gpus_per_worker, trainer_gpus)  # cpus >= workers
        self.actors: list = []
        self._closed = False
        try:  # a refusal or a failed start stops the actors and the Ray instance started here (a later run in this
            _check_resources(ray.cluster_resources(), workers, gpus_per_worker)  # process could not start its own)
            for module in file_modules():  # a task from a --plugin file.py: its classes travel by value
                ray.cloudpickle.register_pickle_by_value(module)
            actor = ray.remote(RolloutWorker).options(max_restarts=MAX_RESTARTS, max_task_retries=MAX_RESTARTS,
                                                      num_cpus=1, num_gpus=gpus_per_worker)
            self.actors = [actor.remote(spec) for _ in range(workers)]
            # every incarnation seen, per actor, the first from the start: a restart before any reply counts too
            self.incarnations: list[set[str]] = [{who} for who in self._get([a.whoami.remote() for a in self.actors])]
        except BaseException:
            self.close()
            raise
        self._weights, self._ref, self._next_id = weights, None, 0
        self._busy_s = self._load_s = 0.0
        self._since = time.perf_counter()  # start of the period take_stats reports on

    @property
    def size(self) -> int:
        return len(self.actors)

    @property
    def restarts(self) -> int:
        """Actor restarts seen so far (a restart shows as a new incarnation in a reply)."""
        return sum(max(0, len(seen) - 1) for seen in self.incarnations)

    def publish(self, weights: Callable[[], dict[str, Tensor]]) -> None:
        """New trainer weights: the next call sends them (``weights()`` is called then, once)."""
        self._weights, self._ref = weights, None

    def submit(self, episodes: list[Episode], params: SamplingParams, key_offset: int = 0,
               beta: float = 0.0) -> Pending:
        """Start generating ``episodes`` (keys from ``key_offset``) on the actors; ``wait`` collects them."""
        import ray

        if self._closed:
            raise WorkerError("the rollout workers are closed")
        if self._ref is None:  # the weight broadcast: into the object store once, fetched by every actor
            t0 = time.perf_counter()
            self._ref = (self._next_id, [ray.put({k: v.detach().cpu() for k, v in self._weights().items()})])
            self._next_id += 1
            self._load_s += time.perf_counter() - t0
        n = len(episodes)
        cuts = [round(i * n / self.size) for i in range(self.size + 1)]
        bounds = [(a, b) for a, b in zip(cuts, cuts[1:]) if b > a]
        refs = [self.actors[i].run.remote(episodes[a:b], params, key_offset + a, self._ref, beta)
                for i, (a, b) in enumerate(bounds)]
        return Pending(episodes, bounds, refs, list(range(len(bounds))))

    def wait(self, pending: Pending) -> list[Episode]:
        """The episodes of ``pending``, complete, in order; the given Episode objects are updated in place."""
        replies: list[WorkerReply] = self._get(pending.refs)
        for actor, (a, b), reply in zip(pending.actors, pending.bounds, replies):
            self.incarnations[actor].add(reply.incarnation)
            for mine, got in zip(pending.episodes[a:b], reply.episodes):
                got.prompt = mine.prompt  # keep the caller's Prompt objects
                vars(mine).update(vars(got))
            self._busy_s += reply.busy_s
            self._load_s += reply.load_s
        return pending.episodes

    @staticmethod
    def _get(refs: list) -> list:
        """``ray.get(refs)``, its failures as one-line WorkerErrors (a ConfigError a worker raised as itself)."""
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError, RayError, RayTaskError

        try:
            return ray.get(refs, timeout=REPLY_TIMEOUT_S)
        except RayTaskError as e:
            if isinstance(e.cause, ConfigError):  # a setting the worker found unusable (a prompt beyond the context)
                raise e.cause from None
            raise WorkerError(f"a rollout worker raised: {e.cause!r}") from None
        except RayActorError as e:
            cause = getattr(e, "cause", None)  # a failure in the actor's start-up (a model directory missing...)
            if isinstance(cause, RayTaskError):
                raise WorkerError(f"a rollout worker failed to start: {cause.cause!r}") from None
            raise WorkerError(f"a rollout worker died and could not be restarted ({MAX_RESTARTS} restarts "
                              f"allowed): {str(e).splitlines()[0]}") from None
        except GetTimeoutError:
            raise WorkerError(f"no reply from the rollout workers in {REPLY_TIMEOUT_S:.0f} s") from None
        except RayError as e:  # out of memory, a lost object, ...
            raise WorkerError(f"the rollout workers failed: {type(e).__name__}: {str(e).splitlines()[0]}") from None

    def take_stats(self) -> dict[str, float]:
        """Metrics since the last call: restarts so far, weight-sync seconds, and the share of the period the actors
        spent sampling (replies collected in it; a prefetched batch counts when it is collected)."""
        now = time.perf_counter()
        out = {"rollout/worker_restarts": float(self.restarts), "perf/weight_sync_s": self._load_s,
               "rollout/worker_utilization": min(1.0, self._busy_s / max((now - self._since) * self.size, 1e-9))}
        self._busy_s = self._load_s = 0.0
        self._since = now
        return out

    def pids(self) -> list[int]:
        """The actors' process ids (to watch them, or to kill one in a test)."""
        import ray

        return ray.get([a.pid.remote() for a in self.actors])

    def cancel(self, pending: Pending) -> None:
        """Give up on calls in flight (a prefetch that will never be used)."""
        import ray

        for ref in pending.refs:
            with contextlib.suppress(Exception):
                ray.cancel(ref)

    def close(self) -> None:
        """Stop the actors, and Ray when polyrl started it; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        import ray

        for a in self.actors:
            with contextlib.suppress(Exception):
                ray.kill(a, no_restart=True)
        if self.owns_ray:
            ray.shutdown()


def _start_ray(address: str | None, cpus: int, gpus_per_worker: float, trainer_gpus: int = 0) -> None:
    """Join the cluster at ``address``, or start a fresh local instance (never one RAY_ADDRESS points at).

    The local instance gets the GPUs the training processes do not use (``trainer_gpus``: the first ones, rank r on
    GPU r; none when they train on the CPU), so that generator actors never land on a trainer's device (separated
    placement). ``ray.init`` installs its own SIGTERM
    handler (``sys.exit(15)``) and never removes it; the one before it comes back at once, so that a run under nohup
    still ignores SIGTERM and ``polyrl train`` still unwinds on it (putting back a run ``--overwrite`` set aside).
    """
    main = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGTERM) if main else None
    try:
        _init_ray(address, cpus, gpus_per_worker, trainer_gpus)
    finally:
        if previous is not None:  # None: not the main thread, or a handler set outside Python
            signal.signal(signal.SIGTERM, previous)


def _check_reachable(address: str, timeout_s: float = 10.0) -> None:
    """Refuse a HOST:PORT (or ray://HOST:PORT) that no server answers: ``ray.init`` retries such an address forever,
    printing "Failed to connect to GCS" every 30 s. 'auto' and other forms are left to Ray."""
    import socket

    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not host or not port.isdigit():
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as e:
        raise WorkerError(f"ray_address = {address!r}: nothing answers there ({e.strerror or e}); start the cluster "
                          "(ray start --head) or give the address `ray status` prints on one of its nodes") from None


def _init_ray(address: str | None, cpus: int, gpus_per_worker: float, trainer_gpus: int = 0) -> None:
    import ray

    quiet = dict(include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    if address:
        _check_reachable(address)
        try:
            ray.init(address=address, **quiet)
        except (ConnectionError, ValueError) as e:  # no cluster there, or an address Ray cannot parse
            raise WorkerError(f"ray_address = {address!r}: {e}; a cluster with token authentication (Ray's "
                              "default) also needs RAY_AUTH_MODE=token and its token (RAY_AUTH_TOKEN or "
                              "~/.ray/auth_token) here, or use 'auto' on one of its nodes") from None
        return
    saved = os.environ.get("CUDA_VISIBLE_DEVICES")
    if gpus_per_worker and trainer_gpus:
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(free_gpus(trainer_gpus, saved))
    try:
        ray.init(address="local", num_cpus=cpus, num_gpus=None if gpus_per_worker else 0, **quiet)
    finally:  # this process's own view of its devices is unchanged
        if saved is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = saved


def free_gpus(trainer_gpus: int, visible: str | None) -> list[str]:
    """The GPUs left to generator actors, as CUDA_VISIBLE_DEVICES entries: this process's visible ones (all of the
    machine's when ``visible`` is None) but the first ``trainer_gpus``, which the training ranks use."""
    import torch

    seen = [v for v in visible.split(",") if v] if visible is not None else \
        [str(i) for i in range(torch.cuda.device_count())]
    return seen[trainer_gpus:]


def _check_resources(have: dict, workers: int, gpus_per_worker: float) -> None:
    """Refuse at once what Ray could never place (its actors would wait for resources forever)."""
    need = {"CPU": float(workers), "GPU": workers * gpus_per_worker}
    short = {k: v for k, v in need.items() if v > have.get(k, 0.0) + 1e-9}
    if short:
        said = ", ".join(f"{v:g} {k} (the cluster has {have.get(k, 0.0):g})" for k, v in short.items())
        raise WorkerError(f"{workers} rollout workers need {said}; lower --rollout-workers or "
                          "--rollout-worker-gpus, or give Ray more (--ray-cpus, a bigger cluster)")
