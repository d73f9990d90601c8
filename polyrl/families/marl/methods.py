"""MARL presets: which critic the shared actor is trained with (everything else is the config's).

``mappo``: centralised critic (arXiv:2103.01955); ``ippo``: per-agent local critic with the actor's inputs
(independent PPO, arXiv:2011.09533) -- the ablation without the centralised critic. Both use GAE from the shared
``ADVANTAGES`` registry, the PPO ``clip`` trust region, ``token_mean`` aggregation and the clipped value loss.
"""

from __future__ import annotations

from dataclasses import dataclass

from polyrl.config import ConfigError


@dataclass(frozen=True)
class MarlMethod:
    name: str
    critic: str  # central | local
    paper: str
    summary: str


MARL_METHODS = {
    "mappo": MarlMethod("mappo", "central", "arXiv:2103.01955",
                        "shared deep-sets actor, centralised critic over all agents' features and team state"),
    "ippo": MarlMethod("ippo", "local", "arXiv:2011.09533",
                       "shared deep-sets actor, per-agent critic that sees only the agent's own observation"),
}


def get_marl_method(name: str) -> MarlMethod:
    if name not in MARL_METHODS:
        raise ConfigError(f"method = {name!r} is not allowed; allowed: {', '.join(MARL_METHODS)}")
    return MARL_METHODS[name]
