"""Reward functions used by the trainer tests (loaded by import path, as a user would)."""


def digit_fraction(prompts, completions, **kwargs):
    """Share of digit characters in each completion: varies even for an untrained model."""
    return [sum(ch.isdigit() for ch in c) / max(1, len(c)) for c in completions]


def even_length(prompts, completions, **kwargs):
    """1 for a completion of even length: about half succeed for any model, so groups are mixed."""
    return [float(len(c) % 2 == 0) for c in completions]


def zero(prompts, completions, **kwargs):
    """0 for everything: every group has zero variance, so a group filter drops them all."""
    return [0.0 for _ in completions]
