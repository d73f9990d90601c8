"""Safe-RULE (arXiv 2606.09559, spec §12): offline safe RL on poisoned data and its unlearning.

- ``gridworld``: the gridworld with a hazardous shortcut, behaviour data, the poisoning attack, exact evaluation;
- ``agent``: the offline Lagrangian agent (reward critic, cost critic, actor) and ``safe_unlearn`` with the
  spec's losses (``critic_losses``, ``forget_reward_term``, ``forget_cost_term``, ``actor_loss``);
- ``experiment``: clean / poisoned / retrained / unlearned agents over seeds; ``command``: `polyrl safety unlearn`.
"""

from polyrl.safety.unlearn.command import add_parser, command

__all__ = ["add_parser", "command"]
