"""polyrl: RL post-training where every method is a preset of small composable parts."""

__version__ = "0.1.0"
