"""Multi-agent RL for cooperative formations: N robots move under a polygon object to carry it (MAPPO vs IPPO).

Modules: ``env`` (batched 2D environment: polygon with point masses, obstacles, support margin, load shares,
team reward), ``nets`` (shared deep-sets actor; centralised or local critic), ``methods`` (``MARL_METHODS``
presets), ``train`` (the PPO loop with checkpoints), ``report`` (seeds x {mappo, ippo} -> report.html) and
``cli`` (``polyrl marl ...``). Spec section 13 (arXiv:2606.09610; observations and reward are ours).
"""

from polyrl.families import register_family

HELP = "multi-agent formation under arbitrary objects (MAPPO, IPPO ablation)"
register_family("marl", HELP, "polyrl.families.marl.cli")
