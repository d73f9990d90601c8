"""Where a task's prompts come from and how they are put to the model: `--data-file`, `--heldout-percent`,
`--chat-template`, `--system-prompt`, TOML table `[data]`, `TrainConfig.data`. Imports nothing heavy."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar


@dataclass
class DataConfig:
    """The data file of file-backed tasks (math, code) and the prompt format of every task."""

    PREFIX: ClassVar[str] = "data"

    file: str | None = field(default=None, metadata={"flag": "data_file"})
    """math task: local JSONL, JSON or Parquet file with a question (or problem, prompt, messages) and an answer (or
    solution, ground_truth) column; code task: JSONL with prompt, tests (asserts) and optional entry_point"""
    heldout_percent: int = field(default=10, metadata={"flag": "heldout_percent"})
    """math or code task: percent of the data file's rows held out for evaluation (chosen by a hash of the prompt)"""
    chat_template: str = field(default="auto", metadata={"flag": "chat_template"})
    """prompts as chat: auto (the tokenizer's template when it has one), none (plain text), or a Jinja file"""
    system_prompt: str | None = field(default=None, metadata={"flag": "system_prompt"})
    """system message put before each prompt's messages (needs a chat template)"""
