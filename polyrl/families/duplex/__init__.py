"""Full-duplex turn-taking RL (arXiv:2606.11167, spec section 6): a frame-level interaction simulator, the four
interactivity-axis rewards plus a quality term, a GRU policy, imitation of a scripted agent, then GRPO.

Modules: ``rewards`` (Timeline, the axis rewards, quality, ``combined_reward``), ``sim`` (scripted user,
features, natural agent, per-axis metrics), ``policy`` (GRU), ``methods`` (``DUPLEX_METHODS`` presets), ``train``
(the loop, checkpoints and resume), ``report`` (multi-seed before/after report) and ``cli`` (``polyrl duplex ...``).
Registered as the ``duplex`` family.
"""

from polyrl.families import register_family

HELP = "full-duplex turn-taking RL on a frame simulator (pauses, turn ends, backchannels, barge-ins)"
register_family("duplex", HELP, "polyrl.families.duplex.cli")
