"""The one exception type that the CLI turns into a single line on stderr and exit code 2."""


class UserError(Exception):
    """Bad input from the user: the message names what is wrong and how to fix it, in one line."""


class RunAborted(Exception):
    """The run was stopped on purpose (e.g. reward.on_failure=abort); the message says why and what to check."""
