"""The critic's settings (GAE presets): `--critic-lr`, `--value-clip`, TOML `[critic]`, `TrainConfig.critic`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar


@dataclass
class CriticConfig:
    """The value model of critic presets (ppo, a2c, spo, ...): its optimizer and its loss clipping."""

    PREFIX: ClassVar[str] = "critic"

    lr: float = 1e-4
    """learning rate of the critic (GAE presets only)"""
    value_clip: float = field(default=0.5, metadata={"flag": "value_clip"})
    """critic value clipping range eps_v (GAE presets only)"""
