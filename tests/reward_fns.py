"""Reward functions used by the trainer tests (loaded by import path, as a user would)."""


def digit_fraction(prompts, completions, **kwargs):
    """Share of digit characters in each completion: varies even for an untrained model."""
    return [sum(ch.isdigit() for ch in c) / max(1, len(c)) for c in completions]
