"""What a run logs and where: `--log-every`, `--[no-]tensorboard`, `--[no-]wandb`, TOML table `[log]`,
`TrainConfig.log`; and how often it measures held-out accuracy: `--eval-every`, `--eval-prompts`, TOML table
`[eval]`, `TrainConfig.eval`. Kept apart from ``logging.py`` so that reading settings imports nothing heavy."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar


@dataclass
class LogConfig:
    """The console table and the event files a run writes besides metrics.jsonl."""

    PREFIX: ClassVar[str] = "log"

    every: int = field(default=10, metadata={"flag": "log_every"})
    """print the compact console table every N logged rows (evaluation rows count) and write a few samples to
    samples.jsonl every N steps; 0: no samples, and one table of every row at the end"""
    tensorboard: bool = field(default=True, metadata={"flag": "tensorboard"})
    """write TensorBoard event files to run_dir/tb"""
    wandb: bool = field(default=False, metadata={"flag": "wandb"})
    """also log to Weights & Biases (offline mode)"""


@dataclass
class EvalConfig:
    """The held-out greedy evaluation (``polyrl.evaluation``): how often, and on how many prompts."""

    PREFIX: ClassVar[str] = "eval"

    every: int = field(default=25, metadata={"flag": "eval_every"})
    """held-out greedy evaluation every N steps (0 = only before and after)"""
    prompts: int = field(default=200, metadata={"flag": "eval_prompts"})
    """held-out prompts per evaluation"""
