"""The one exception type that the CLI turns into a single line on stderr and exit code 2."""


class UserError(Exception):
    """Bad input from the user: the message names what is wrong and how to fix it, in one line."""


class RunAborted(Exception):
    """The run was stopped on purpose (e.g. reward.on_failure=abort); the message says why and what to check."""


class Interrupted(Exception):
    """SIGINT/SIGTERM stopped the run at a step boundary; `checkpoint` holds that step (None if nothing was trained)."""

    def __init__(self, step: int, checkpoint, signum: int):
        super().__init__(f"interrupted after step {step}" + (f"; checkpoint {checkpoint}" if checkpoint else ""))
        self.step, self.checkpoint, self.signum = step, checkpoint, signum
