"""The learner's settings: the critic's (GAE presets: `--critic-lr`, `--value-clip`, `--value-loss-agg`, TOML
`[critic]`), LoRA's (`--lora-*`, `[lora]`) and the speed settings (`--[no-]share-prompts`, `--[no-]fused-adam`,
`--micro-batch-tokens`, `--skip-zero-adv`, `[speed]`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal


@dataclass
class CriticConfig:
    """The value model of critic presets (ppo, a2c, spo, ...): its optimizer and its loss clipping."""

    PREFIX: ClassVar[str] = "critic"

    lr: float = 1e-4
    """learning rate of the critic (GAE presets only)"""
    value_clip: float = field(default=0.5, metadata={"flag": "value_clip"})
    """critic value clipping range eps_v around the rollout-time values (0 = unclipped squared error)"""
    value_loss_agg: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "token_sum"] = field(
        default="token_mean", metadata={"flag": "value_loss_agg"})
    """how the critic's per-token losses make its loss (verl critic.loss_agg_mode; an aggregation part's name)"""


@dataclass
class LoraConfig:
    """Low-rank adapters through PEFT: only the adapters train, the reference is the base with them disabled."""

    PREFIX: ClassVar[str] = "lora"

    rank: int = 0
    """LoRA rank r (0 = full fine-tuning); the adapters train, the base weights stay frozen"""
    alpha: float = 16.0
    """LoRA scaling numerator: the update is (alpha / r) * B A"""
    targets: str = "all-linear"
    """modules that get adapters: all-linear (every linear layer but the LM head) or comma-separated module names"""
    dropout: float = 0.0
    """dropout on the adapters' input (0 keeps rollout and training log-probs identical)"""


@dataclass
class SpeedConfig:
    """How the learner computes the same update faster. Each keeps the losses and gradients of the plain path (up to
    float rounding; a test each), so turning one off only costs time."""

    PREFIX: ClassVar[str] = "speed"

    share_prompts: bool = field(default=True, metadata={"flag": "share_prompts"})
    """run each distinct prompt of a micro-batch once and its group's completions on top of its KV cache"""
    fused_adam: bool = field(default=True, metadata={"flag": "fused_adam"})
    """the policy's AdamW runs torch's fused kernel (one pass over all parameters) instead of a loop over them (a
    critic's AdamW keeps the default)"""
    micro_batch_tokens: int = field(default=4096, metadata={"flag": "micro_batch_tokens"})
    """pack training micro-batches by length: rows sorted longest first, at most this many tokens (rows x padded
    length) and micro_batch_size rows each, and every micro-batch cut to its own longest row (verl's dynamic batch
    size); 0 = consecutive chunks of micro_batch_size rows, padded to the batch's longest row"""
    skip_zero_adv: Literal["auto", "yes", "no"] = field(default="auto", metadata={"flag": "skip_zero_adv"})
    """rows whose advantage is 0 at every token (a GRPO group whose completions all scored alike) run forward only,
    for pi_old and the metrics, without a backward, where the method's loss gives them no gradient (its trust region
    is tagged zero_adv_inert, no KL term in the loss, no entropy bonus or entropy_top): auto = where that also costs
    less than the pass it may add (update.plan_passes), yes = wherever a row keeps a gradient (a method without the
    property is refused), no = every row runs forward and backward"""
