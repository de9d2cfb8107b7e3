"""Errors shared across components."""


class CliError(Exception):
    """A user-facing command error: printed as one line (`ow CMD: error: ...`), exit status `code`."""

    def __init__(self, message: str, code: int = 2):
        super().__init__(message)
        self.code = code
