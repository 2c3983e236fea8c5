"""Errors an operator or a scheduler can cause, each with a message meant to be read."""


class GcworkerError(Exception):
    """A refused request: the message says what and why; nothing was changed."""


class NotFound(GcworkerError):
    pass


class Conflict(GcworkerError):
    pass


class SetupError(GcworkerError):
    """Something the operator must fix outside gcworker (a file, a folder, a server): the CLI
    exits 2, like for a bad setting."""
