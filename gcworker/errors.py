"""Errors an operator or a scheduler can cause, each with a message meant to be read."""


class GcworkerError(Exception):
    """A refused request: the message says what and why; nothing was changed."""


class NotFound(GcworkerError):
    pass


class Conflict(GcworkerError):
    pass
