"""The alignment and safety toolkit: `polyrl safety TOOL`, beside the training loop (no copy of the trainer).

Each tool is a module of this package with ``add_parser(subparsers)`` (its `polyrl safety NAME` command, whose
function runs an experiment and writes ``report.html`` and ``results.json``) and a short library API:

- ``bias_probe``: one-shot bias -- GRPO on one flipped example; the closed-form onset time (spec §4);
- ``probe``: the neutral mask -- probe directions, their persistence, a sparse autoencoder, steering (spec §7);
- ``redteam``: AdvGRPO -- attacker/defender co-training with decoupled per-channel normalisation (spec §10);
- ``ggro``: gradient-guided reward optimisation at decoding time vs best-of-N (spec §11);
- ``unlearn``: Safe-RULE -- offline safe RL on poisoned data and its unlearning (spec §12).

``TOOLS`` names them for `polyrl --help` and `polyrl methods` without importing any of them (nothing heavy here).
Shared pieces: ``report.write_report`` (the self-contained page) and ``polyrl.lab.stats.bootstrap_ci``.
"""

from __future__ import annotations

HELP = "alignment and safety toolkit: bias-probe, probe, redteam, ggro, unlearn"

# command -> (module under polyrl.safety, one line for --help and `polyrl methods`)
TOOLS: dict[str, tuple[str, str]] = {
    "bias-probe": ("bias_probe", "one-shot bias: GRPO on one flipped example, onset step vs the closed form"),
    "probe": ("probe", "neutral mask: probe directions before/after RL, persistence, SAE, steering"),
    "redteam": ("redteam", "AdvGRPO: attacker/defender co-training with per-channel (GDPO) normalisation"),
    "ggro": ("ggro", "GGRO: reward-gradient token swaps at decoding time vs best-of-N at matched compute"),
    "unlearn": ("unlearn", "Safe-RULE: offline safe RL on poisoned transitions, unlearning vs clean retraining"),
}
