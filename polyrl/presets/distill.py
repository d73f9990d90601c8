"""On-policy distillation presets (Thinking Machines' "On-Policy Distillation", prime-rl's teacher, GKD).

Both put k1 x 1 in the reward, so with ``--teacher DIR`` (``polyrl.distill``: the teacher is the scored
reference) each sampled token earns log pi_teacher(y_t) - log pi_student(y_t); without ``--teacher`` the
reference is the starting policy (self-distillation to the start, the blog's continual-learning use). The
``opd`` advantage centres that reward over the batch's tokens (Tinker), adds the group-centred task reward on
every token and whitens nothing; with one optimizer step per batch the ratio is exactly 1 and the PPO clip
only guards epochs_per_batch / minibatches > 1. The loss is a token mean (prime-rl's loss_scale = tokens).
"""

from __future__ import annotations

from polyrl.objectives import build_method

BLOG = "https://thinkingmachines.ai/blog/on-policy-distillation/ (GKD: arXiv:2306.13649)"


def opd():
    """On-policy distillation: token reward log pi_teacher - log pi_student on own samples, plus the task reward
    (arXiv:2306.13649)."""
    return build_method("opd", paper=BLOG, advantage="opd:task_weight=1.0", trust_region="clip",
                        aggregation="token_mean", kl="k1", kl_coef=1.0, kl_placement="reward")


def opd_pure():
    """Pure on-policy distillation: only the token reward log pi_teacher - log pi_student, no task reward
    (arXiv:2306.13649)."""
    return build_method("opd_pure", paper=BLOG, advantage="opd:task_weight=0.0", trust_region="clip",
                        aggregation="token_mean", kl="k1", kl_coef=1.0, kl_placement="reward")


PRESETS = (opd, opd_pure)
