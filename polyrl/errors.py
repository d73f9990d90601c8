"""Errors that the CLI turns into one line (exit code 1): the run failed, not its configuration."""


class TrainingError(RuntimeError):
    """Training cannot go on (e.g. too many non-finite losses in a row); the message says why."""
