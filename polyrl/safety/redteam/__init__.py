"""AdvGRPO (`polyrl safety redteam`): attacker/defender co-training with per-channel (GDPO) normalisation.

Spec ``methods-seedblog.md`` §10 (arXiv:2606.09701). ``trainer``: ``gdpo_advantages``, ``summed_advantages``,
``AdversarialCoTrainer``; ``game``: the tabular toy game; ``judges``: its synthetic judges (reward functions by
import path); ``experiment``: the command (summed vs decoupled over seeds, report.html + results.json).
"""

from __future__ import annotations

from polyrl.safety.redteam.experiment import add_parser
from polyrl.safety.redteam.trainer import AdversarialCoTrainer, gdpo_advantages, summed_advantages

__all__ = ["add_parser", "AdversarialCoTrainer", "gdpo_advantages", "summed_advantages"]
