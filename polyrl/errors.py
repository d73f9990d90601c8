"""Errors that the CLI turns into one line; kept free of heavy imports so that `polyrl.cli` can catch them cheaply.

``TrainingError`` (exit code 1): the run failed, not its configuration. ``RewardError`` (exit code 2): a reward
function failed or returned something unusable. ``CheckpointError`` (exit code 2): a
checkpoint that cannot be used; it is defined here rather than in ``polyrl.checkpoint`` (which imports torch)
and re-exported there.
"""


FLOAT32_MAX = 3.4028234663852886e38  # a setting or reward beyond it is inf in a float32 tensor
FLOAT32_TINY = 1.1754943508222875e-38  # float32's smallest normal number: below it a value loses its precision, or is 0


class ConfigError(ValueError):
    """A configuration value that cannot be used; one line naming field, value and what is allowed (exit code 2).
    Defined here, not in ``polyrl.config``, so that light modules (``polyrl.model``) can raise it without importing
    the configuration and its sub-configs; ``polyrl.config`` re-exports it."""


class TrainingError(RuntimeError):
    """Training cannot go on (e.g. too many non-finite losses in a row); the message says why."""


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message names the path and what is wrong."""


class RewardError(Exception):
    """A reward function failed or returned something unusable; the CLI prints one line and exits with 2.

    ``str()`` names the function, the step (set by the trainer), the completion and its prompt; the
    function's own traceback, if it raised, is in ``traceback`` for the run's log, not the console.
    """

    def __init__(self, function: str, problem: str, *, completion: int | None = None,
                 prompt_index: int | None = None, traceback: str | None = None) -> None:
        super().__init__(problem)
        self.function, self.problem, self.completion, self.prompt_index = function, problem, completion, prompt_index
        self.traceback = traceback
        self.step: int | None = None
        self.log_path: str | None = None

    def __reduce__(self):  # pickled whole: rank 0 sends it to the other training processes
        return type(self), (self.function, self.problem), self.__dict__

    def __str__(self) -> str:
        where = [f"step {self.step}"] if self.step is not None else []
        if self.completion is not None:
            of = f" of prompt index {self.prompt_index}" if self.prompt_index is not None else ""
            where.append(f"completion {self.completion}{of}")
        log = f"; traceback in {self.log_path}" if self.log_path and self.traceback else ""
        return f"reward function {self.function!r} {self.problem}" + (f" at {', '.join(where)}" if where else "") + log


class Terminated(SystemExit):
    """SIGTERM or SIGHUP arrived (``runs.signals_unwind``): the command unwinds with exit code 128 + signal. Code that
    catches a user function's ``sys.exit`` lets this one through, so a signal is not reported as the function's."""
