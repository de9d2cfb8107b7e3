"""Errors shared across components, and the checks of command-line values every command shares."""

from __future__ import annotations

import errno
import math

#: `ow` exit status when the process runs out of memory or address space (a MemoryError, a
#: library that cannot be mapped, a thread that cannot be started): one line, not a traceback,
#: whatever the command. No command uses 6 for anything else.
EXIT_OUT_OF_MEMORY = 6


class CliError(Exception):
    """A user-facing command error: printed as one line (`ow CMD: error: ...`), exit status `code`."""

    def __init__(self, message: str, code: int = 2):
        super().__init__(message)
        self.code = code


def check_number(
    value: float | None,
    flag: str,
    *,
    at_least: float | None = None,
    above: float | None = None,
    at_most: float | None = None,
    code: int = 2,
    error: type[Exception] | None = None,
) -> float | None:
    """A numeric command-line value: finite (no nan, no inf) and within the bounds given, or a
    one-line error naming the option (`CliError(..., code)`, or `error(message)` for commands
    with their own error class). None (an option not given) passes."""
    if value is None:
        return None
    bounds = []
    if at_least is not None:
        bounds.append(f">= {at_least:g}")
    if above is not None:
        bounds.append(f"> {above:g}")
    if at_most is not None:
        bounds.append(f"<= {at_most:g}")
    ok = (
        math.isfinite(value)
        and (at_least is None or value >= at_least)
        and (above is None or value > above)
        and (at_most is None or value <= at_most)
    )
    if not ok:
        wanted = f"a finite number {' and '.join(bounds)}" if bounds else "a finite number"
        message = f"{flag} must be {wanted}, not {value!r}"
        raise error(message) if error is not None else CliError(message, code)
    return value


def memory_limited() -> bool:
    """Whether this process runs under an address-space or data-segment limit."""
    try:
        import resource  # lazy: an error path; not on every platform
    except ImportError:
        return False
    return any(
        resource.getrlimit(limit)[0] != resource.RLIM_INFINITY for limit in (resource.RLIMIT_AS, resource.RLIMIT_DATA)
    )


def out_of_memory(exc: BaseException | None) -> BaseException | None:
    """`exc`, or the exception it was raised from, that says the process ran out of memory or
    address space; None if none does. Under an address-space limit (`ulimit -v`, `prlimit --as`)
    that surfaces as more than MemoryError: a shared library that cannot be mapped (ImportError
    "failed to map segment"), ENOMEM from the kernel, a thread that cannot get its stack, torch's
    allocator ("can't allocate memory"), and, under a limit only, a SystemError from an extension
    whose allocation failed without setting an error."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        text = str(exc)
        if (
            isinstance(exc, MemoryError)
            or (isinstance(exc, OSError) and exc.errno == errno.ENOMEM)
            or (isinstance(exc, ImportError) and ("failed to map segment" in text or "Cannot allocate memory" in text))
            or (
                isinstance(exc, RuntimeError)
                and any(s in text for s in ("can't start new thread", "can't allocate memory", "out of memory"))
            )
            or (isinstance(exc, SystemError) and memory_limited())
        ):
            return exc
        exc = exc.__cause__ or exc.__context__
    return None
