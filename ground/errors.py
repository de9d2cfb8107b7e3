"""What can go wrong in a ground operation, each with the exit status `ow ground` reports.

0 ok · 2 usage (argparse) · 3 rejected or failed by the payload · 4 no answer / link refused
5 local input error (bad file, bad prompt, bad name, bad number, damaged local state)
6 out of memory (common.errors.EXIT_OUT_OF_MEMORY, whatever the command)
"""

from __future__ import annotations

from common.wire import ResponseCode

EXIT_OK = 0
EXIT_USAGE = 2
EXIT_REJECTED = 3
EXIT_NO_ANSWER = 4
EXIT_LOCAL_INPUT = 5


class GroundError(Exception):
    """Base of every error a ground operation raises on purpose; `exit_code` is the CLI status."""

    exit_code = EXIT_LOCAL_INPUT


class LocalInputError(GroundError):
    """The operator's input was refused before anything was sent."""

    exit_code = EXIT_LOCAL_INPUT


class CommandRejected(GroundError):
    """The payload (or the bus, refusing to relay) answered REJECTED, or the payload FAILED."""

    exit_code = EXIT_REJECTED

    def __init__(self, what: str, code: ResponseCode, reason: str, *, failed: bool = False, by: str = "payload"):
        self.what = what
        self.code = ResponseCode(code)
        self.reason = reason
        self.failed = failed
        #: who refused it: "payload", or "bus" (the bus answers for itself when it refuses to relay)
        self.by = by
        verb = "failed" if failed else f"rejected by the {by}"
        super().__init__(f"{what} {verb}: {self.code.name} ({int(self.code)}): {reason}")


class NoAnswer(GroundError):
    """Nothing answered within the timeout (payload off, bus down, link lost)."""

    exit_code = EXIT_NO_ANSWER


class LinkRefused(GroundError):
    """The bus refused the CURVE handshake: this station's key is not authorized, or the bus
    public key in the keys directory is not the bus's."""

    exit_code = EXIT_NO_ANSWER
