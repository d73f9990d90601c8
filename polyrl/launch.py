"""Where a run computes: ``ScaleConfig`` (Ray rollout workers, training processes) and the launch under torchrun.

Rollout workers (``--rollout-workers N``, built in ``rollout/remote/``) generate on Ray actors. Training processes:

``--nproc N`` (N >= 2) re-executes the same command as ``torchrun --standalone --nproc-per-node N -m polyrl
...`` (``torch.distributed.run``, the code behind ``torchrun``: a standalone rendezvous on this machine, one process
per rank, a failed rank stops the others). Every rank then trains with the FSDP2 learner; rank 0 also
generates (or drives the Ray rollout workers), logs, evaluates and writes the run directory. Launching
with ``torchrun`` directly works the same way and is how several machines join (``--nnodes``,
``--rdzv-endpoint``). Settings only; this module imports no torch until it launches.

Network: the ranks' gloo traffic runs over 127.0.0.1, but torch's launcher (its rendezvous store) and a local Ray
instance listen on every interface of the machine (neither offers a bind address), on ports they choose: on a
machine others can reach, keep those ports behind a firewall.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import ClassVar, Literal


@dataclass
class ScaleConfig:
    """Where the run computes: flags ``--rollout-workers``, ``--ray-*``, ``--rollout-worker-gpus``, ``--nproc``,
    ``--device``;
    TOML table ``[scale]``; ``TrainConfig.scale``. Batches and gradients do not depend on these settings."""

    PREFIX: ClassVar[str] = "scale"

    rollout_workers: int = field(default=0, metadata={"flag": "rollout_workers"})
    """Ray generator actors that sample the rollouts (0 = in the trainer process; --async-staleness k > 0 uses 1)"""
    ray_address: str | None = field(default=None, metadata={"flag": "ray_address"})
    """join this Ray cluster ('auto' or HOST:PORT) instead of starting a local Ray instance (stopped at the end)"""
    ray_cpus: int = field(default=0, metadata={"flag": "ray_cpus"})
    """CPUs of the local Ray instance polyrl starts (0 = the machine's cores)"""
    rollout_worker_gpus: float = field(default=0.0, metadata={"flag": "rollout_worker_gpus"})
    """GPUs each generator actor asks Ray for (0 = none; 1 puts each actor on a GPU of its own)"""
    nproc: int = field(default=1, metadata={"flag": "nproc"})
    """training processes on this machine, sharding policy, reference and critic with FSDP2 (1 = one process)"""
    device: Literal["auto", "cpu", "cuda"] = field(default="auto", metadata={"flag": "device"})
    """where the learner and in-process generation compute: cuda (a GPU per training process; NCCL between several),
    cpu (gloo between several), or auto (cuda where torch sees enough GPUs, else the CPU)"""

    def actors(self, staleness: int) -> int:
        """How many generator actors run: ``rollout_workers``, or one when only asynchronous generation asks."""
        return self.rollout_workers or (1 if staleness else 0)


LAUNCHER_PID = "POLYRL_LAUNCHER_PID"  # set by ``relaunch`` for its ranks


def under_launcher() -> bool:
    """Whether this process is a rank started by torchrun / torch.distributed.run."""
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def world() -> tuple[int, int]:
    """(rank, world size) of this process: (0, 1) outside a launcher."""
    if not under_launcher():
        return 0, 1
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


def local_processes() -> int:
    """Training processes on this machine: torchrun's LOCAL_WORLD_SIZE, 1 outside a launcher."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if under_launcher() else 1


def relaunches(nproc: int) -> bool:
    """Whether a command asked for ``nproc`` processes starts them itself (``relaunch``): not when a launcher did."""
    return nproc > 1 and not under_launcher()


def relaunch(nproc: int, argv: list[str]) -> int:
    """Run ``python -m polyrl *argv`` as ``nproc`` ranks on this machine; return the launcher's exit code."""
    from torch.distributed.run import get_args_parser, run

    # "--" keeps the launcher from reading polyrl's own flags (argparse would take --nproc for --nproc-per-node)
    args = get_args_parser().parse_args(["--standalone", "--nproc-per-node", str(nproc), "--module", "--", "polyrl",
                                         *argv])
    import signal

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    os.environ[LAUNCHER_PID] = str(os.getpid())  # the ranks' parent: they end when it does (die_with_launcher)
    try:
        run(args)
    except SignalException as e:  # SIGTERM / Ctrl-C to the launcher: it stopped the ranks; exit as one process would
        return 128 + int(e.sigval)
    except ChildFailedError as e:  # a rank failed and printed why: exit with its code, as one process would
        # the lowest rank that exited by itself, not one torchrun stopped (it unwinds and exits 143) nor one killed by
        # a signal (a rank aborting in a collective another left); else the lowest of those
        codes = {rank: failure.exitcode for rank, failure in e.failures.items()}
        stopped = (128 + signal.SIGTERM, -signal.SIGTERM)  # a rank torchrun stopped after another failed exits so
        code = codes[min(codes, key=lambda rank: (codes[rank] in stopped, codes[rank] <= 0, rank))]
        return 128 - code if code < 0 else code  # killed by a signal: its negative number, as the shell reports it
    return 0


def die_with_launcher() -> None:
    """Under a launcher, end (SIGTERM, which unwinds as Ctrl-C) when the launcher process dies: a SIGKILLed
    ``--nproc`` launcher left its ranks training on, re-parented, writing and holding the run directory. Linux only
    (prctl PR_SET_PDEATHSIG); elsewhere nothing changes."""
    import signal
    import sys

    # polyrl's relaunch, or torchrun started by hand (its agent is the parent); not RANK/WORLD_SIZE alone, which other
    # tools set for processes whose parent may end first (a script that backgrounds the run)
    if not (LAUNCHER_PID in os.environ or "TORCHELASTIC_RUN_ID" in os.environ) or not sys.platform.startswith("linux"):
        return
    import ctypes

    parent = int(os.environ.get(LAUNCHER_PID, os.getppid()))
    ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # 1 = PR_SET_PDEATHSIG
    if os.getppid() != parent:  # it died before the request was in place (while this process started up)
        os.kill(os.getpid(), signal.SIGTERM)
