"""Settings of the rollout workers: flags ``--rollout-workers``, ``--ray-address``, ``--ray-cpus``,
``--rollout-worker-gpus``; TOML table ``[rollout]``; ``TrainConfig.rollout``. Imports neither torch nor ray."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar


@dataclass
class WorkersConfig:
    """Where rollouts are generated: in the trainer process (the default) or by Ray generator actors."""

    PREFIX: ClassVar[str] = "rollout"

    workers: int = 0
    """Ray generator actors that sample the rollouts (0 = in the trainer process; --async-staleness k > 0 uses 1)"""
    ray_address: str | None = field(default=None, metadata={"flag": "ray_address"})
    """join this Ray cluster ('auto' or HOST:PORT) instead of starting a local Ray instance (stopped at the end)"""
    ray_cpus: int = field(default=0, metadata={"flag": "ray_cpus"})
    """CPUs of the local Ray instance polyrl starts (0 = the machine's cores)"""
    worker_gpus: float = 0.0
    """GPUs each generator actor asks Ray for (0 = none; 1 puts each actor on a GPU of its own)"""

    def actors(self, staleness: int) -> int:
        """How many actors run: ``workers``, or one when only asynchronous generation asks for them."""
        return self.workers or (1 if staleness else 0)
