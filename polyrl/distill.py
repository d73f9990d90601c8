"""On-policy distillation from a teacher: `--teacher DIR`, TOML table `[distill]`, `TrainConfig.distill`.

The teacher IS the scored reference: with ``--teacher DIR`` the frozen reference that a KL preset scores is
loaded from DIR instead of being a copy of the policy's starting weights, so every KL estimator and both
placements measure the policy against the teacher. The ``opd`` preset (``polyrl/presets/distill.py``) puts
k1 x 1 in the reward: each sampled token earns r_t = log pi_teacher(y_t) - log pi_student(y_t), minus the
per-token reverse-KL estimate, on the student's OWN samples (Thinking Machines' "On-Policy Distillation";
GKD arXiv:2306.13649 with reverse KL, as prime-rl's ``teacher_tau`` and Tinker's ``kl_penalty_coef``).

The teacher must read the student's tokens the way the student writes them: the two tokenizers must hold the
same vocabulary (token -> id), checked before training (``check_vocab``). Its architecture and size are free.
With LoRA the teacher is a separate frozen model (the adapters-off base is the reference only without a
teacher); Ray rollout workers that score a frozen reference load the teacher directory instead of the base.

This module imports nothing heavy at import time (``polyrl.config`` reads ``DistillConfig``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from torch import Tensor, nn


@dataclass
class DistillConfig:
    """The teacher of on-policy distillation (``polyrl.distill``)."""

    PREFIX: ClassVar[str] = "distill"

    teacher: str | None = field(default=None, metadata={"flag": "teacher"})
    """teacher model directory: the KL term's reference instead of the starting weights (e.g. --method opd)"""


def teacher_problem(teacher: str | None, method) -> str | None:
    """Why ``--teacher`` cannot be used with ``method``, or ``method`` not without it (one line), or None.

    Without a teacher the reference is the starting policy, so a method whose only reward is the per-token
    reward against it (``opd_pure``: task_weight 0) starts with zero advantage everywhere and never moves.
    """
    if teacher is None:
        if method.advantage.params.get("task_weight") == 0:
            return (f"method {method.name!r} needs --teacher DIR: its only reward is the teacher's per-token "
                    "log-prob, and without a teacher the reference is the starting policy (zero advantage)")
        return None
    if method.kl is None or method.kl_coef == 0:
        return (f"teacher = {teacher!r} is not allowed with method {method.name!r}: it has no KL term to measure "
                "the policy against the teacher (use --method opd, or give --kl k1 --kl-coef 1 --kl-placement "
                "reward)")
    if method.ref_sync_every:
        return (f"teacher = {teacher!r} is not allowed with method {method.name!r}: its reference follows the "
                f"policy (copied every {method.ref_sync_every} steps), so it could not stay the teacher")
    if not (Path(teacher) / "config.json").is_file():
        return f"teacher = {teacher!r} must be a local Hugging Face model directory (it has no config.json)"
    return None


def check_vocab(student_tokenizer, teacher: str, setting: str = "teacher",
                why: str = "on-policy distillation scores the student's token ids under the teacher") -> str | None:
    """Why the model in directory ``teacher`` (given as ``setting``) cannot score the student's tokens (one line), or
    None: the same token -> id map."""
    from polyrl.model import load_tokenizer

    theirs = load_tokenizer(teacher, setting=setting).get_vocab()  # a missing or damaged one: one line naming it
    ours = student_tokenizer.get_vocab()
    if theirs == ours:
        return None
    differ = sorted(set(ours.items()) ^ set(theirs.items()), key=lambda kv: (kv[1], kv[0]))
    return (f"{setting} = {teacher!r} does not share the student's tokenizer ({len(theirs)} vs {len(ours)} tokens; "
            f"first difference: {differ[0][0]!r} -> id {differ[0][1]}); {why}, so both need the same vocabulary")


def load_teacher(teacher: str, *, dtype: str, threads: int | None) -> nn.Module:
    """The teacher as a frozen reference: loaded from its directory, eval mode, no gradient."""
    from polyrl.model import load_policy

    model, _ = load_policy(teacher, dtype=dtype, threads=threads, setting="teacher")  # type: ignore[arg-type]
    return model.eval().requires_grad_(False)


def reverse_kl_metrics(student_logp: Tensor, teacher_logp: Tensor | None, mask: Tensor) -> dict[str, float]:
    """``distill/reverse_kl``: the mean over loss tokens of log pi_student(y_t) - log pi_teacher(y_t) (k1 of
    KL(student || teacher) on the student's samples); empty without teacher log-probs."""
    if teacher_logp is None:
        return {}
    m = mask > 0
    diff = (student_logp.detach() - teacher_logp.detach()).double()
    return {"distill/reverse_kl": float(diff[m].sum() / max(int(m.sum()), 1))}
