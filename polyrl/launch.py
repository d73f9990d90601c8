"""Training across processes: ``polyrl train --nproc N`` runs itself under PyTorch's elastic launcher.

``--nproc N`` (N >= 2) re-executes the same command as ``torchrun --standalone --nproc-per-node N -m polyrl
...`` (``torch.distributed.run``, the code behind ``torchrun``: rendezvous on 127.0.0.1, one process per
rank, a failed rank stops the others). Every rank then trains with the FSDP2 learner; rank 0 also
generates (or drives the Ray rollout workers), logs, evaluates and writes the run directory. Launching
with ``torchrun`` directly works the same way and is how several machines join (``--nnodes``,
``--rdzv-endpoint``). Settings only; this module imports no torch until it launches.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import ClassVar


@dataclass
class DistConfig:
    """Training processes: flag ``--nproc``, TOML table ``[dist]``, ``TrainConfig.dist``."""

    PREFIX: ClassVar[str] = "dist"

    nproc: int = field(default=1, metadata={"flag": "nproc"})
    """training processes on this machine, sharding policy, reference and critic with FSDP2 (1 = one process)"""


def under_launcher() -> bool:
    """Whether this process is a rank started by torchrun / torch.distributed.run."""
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def world() -> tuple[int, int]:
    """(rank, world size) of this process: (0, 1) outside a launcher."""
    if not under_launcher():
        return 0, 1
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


def relaunch(nproc: int, argv: list[str]) -> int:
    """Run ``python -m polyrl *argv`` as ``nproc`` ranks on this machine; return the launcher's exit code."""
    from torch.distributed.run import get_args_parser, run

    # "--" keeps the launcher from reading polyrl's own flags (argparse would take --nproc for --nproc-per-node)
    args = get_args_parser().parse_args(["--standalone", "--nproc-per-node", str(nproc), "--module", "--", "polyrl",
                                         *argv])
    try:
        run(args)
    except Exception as e:  # ChildFailedError: a rank failed; its own message was printed above
        print(f"polyrl: a training process failed ({type(e).__name__}); see the messages above")
        return 1
    return 0
