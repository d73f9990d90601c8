"""λ-target linear Q-learning (arXiv:2606.10835): exact target map, closed-form gain, four target rules.

Modules: ``core`` (``lambda_target_gain`` K_lambda = (1-lambda) B (I - lambda B)^{-1}, ``lambda_target_map``,
``LinearMDP``, ``LinearQLearner`` with every_step / periodic / lambda_exact / lambda_geometric targets),
``search`` (seeded search for an MDP where every-step Q-learning diverges and lambda -> 1 converges; the
spectral-radius-vs-lambda plot), ``tasks`` (slippery gridworld, tile and one-hot features), ``methods``
(``Q_METHODS`` presets), ``train`` (the sample-based loop, checkpoints, resume) and ``cli`` (``polyrl q ...``).
numpy only; registered as the ``q`` family.
"""

from polyrl.families import register_family

HELP = "λ-target linear Q-learning: every-step, periodic and geometric (λ) hard target updates"
register_family("q", HELP, "polyrl.families.q.cli")
