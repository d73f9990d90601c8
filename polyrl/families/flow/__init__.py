"""RL for flow-matching and diffusion policies: SDE sampler with step log-probs, flow losses, toy tasks.

Modules: ``policy`` (MLP velocity field, targets, cached pretraining), ``sampler`` (Flow-GRPO, Dance and
CPS noise schedules, Gaussian step log-probs and exact KL), ``losses`` (Flow-GRPO clip, Flow-DPPO,
GRPO-Guard, LOOP, FPO; the ``FLOW_LOSSES`` registry), ``methods`` (``FLOW_METHODS`` presets), ``tasks``,
``train`` (the loop), ``plots`` and ``cli`` (``polyrl flow ...``). Advantages come from the shared
``polyrl.registry.ADVANTAGES`` registry; logging from ``polyrl.logging``. Registered as the ``flow`` family.
"""

from polyrl.families import register_family

HELP = "RL for flow-matching / diffusion policies (Flow-GRPO, Flow-DPPO, FPO)"
register_family("flow", HELP, "polyrl.families.flow.cli")
