"""Training on several processes: rank 0 generates and evaluates, every rank trains on the same batch.

Under ``polyrl train --nproc N`` (or ``torchrun``) each rank runs the same loop with the FSDP2 learner; the
rollout source and the evaluator live on rank 0 only (generation needs the full weights: rank 0 keeps an
unsharded copy for its in-process generator, or drives the Ray rollout workers). These two wrappers keep
every rank in step without the loop knowing: rank 0's batch (or the exception that replaced it) and its
evaluation are broadcast, and after each update every rank joins the full-weight gather that feeds rank 0's
generator. Only rank 0 writes the run directory (``writes``). Without a process group nothing is wrapped.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.distributed as dist
from torch import Tensor


def _broadcast(obj: Any) -> Any:
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


class RankSource:
    """Rank 0 collects with ``inner`` and broadcasts; other ranks (``inner`` None) receive the same batch."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def collect(self, method, stream, step: int):
        payload = None
        if self.inner is not None:
            try:
                payload = (self.inner.collect(method, stream, step), stream.pos)
            except Exception as error:  # NoUsableGroups, RewardError, ...: every rank raises it
                payload = (error, stream.pos)
        batch, stream.pos = _broadcast(payload)
        if isinstance(batch, Exception):
            if self.inner is None:
                batch.relayed = True  # rank 0's own error, which rank 0 reports: the others need not say it again
            raise batch
        return batch

    def after_update(self, weights: Callable[[], dict[str, Tensor]], version: int) -> None:
        full = weights()  # a collective: every rank joins the gather, rank 0 receives the full state dict
        if self.inner is not None:
            self.inner.after_update(lambda: full, version)

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict() if self.inner is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.inner is not None:
            self.inner.load_state_dict(state)

    def close(self) -> None:
        if self.inner is not None:
            self.inner.close()


class RankEvaluator:
    """Rank 0 evaluates with ``inner`` and broadcasts the metrics, so every rank's loop sees the same values."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def __call__(self, step: int, solved_before: list[bool] | None = None) -> tuple[dict[str, float], list[bool]]:
        return _broadcast(self.inner(step, solved_before) if self.inner is not None else None)

    @staticmethod
    def summary(metrics: dict[str, float]) -> dict[str, float]:
        from polyrl.evaluation import Evaluator

        return Evaluator.summary(metrics)
