"""The `ow` command: one root parser; each component's `cli.py` adds its own subcommand group.

Component modules are imported lazily so that `ow --help` stays fast and a component that is
not installed does not break the others.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from common.errors import EXIT_OUT_OF_MEMORY, CliError, out_of_memory

# (module, what it adds). Each module defines `register(subparsers) -> None`.
COMPONENTS = [
    ("flight.cli", "ow model, ow infer, ow flight"),
    ("hil.cli", "ow bus, ow hil"),
    ("ground.cli", "ow ground"),
    ("common.vla.cli", "ow vla"),
]

#: Commands whose start-up time matters, with the one component they need: `ow flight run` is
#: what the bus powers on, and it must answer the bus within a fraction of a second of exec.
FAST_PATHS: dict[tuple[str, ...], str] = {("flight", "run"): "flight.runtime.cli"}


def build_parser(components: list[str] | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ow",
        description="OrbitWeaver: VLM inference on satellite payloads that survives power cuts.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for module_name in components or [name for name, _ in COMPONENTS]:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name and module_name.startswith(exc.name):
                continue  # component not present in this build
            raise
        module.register(sub)
    return parser


__all__ = ["COMPONENTS", "FAST_PATHS", "CliError", "build_parser", "main"]  # CliError: components raise it


def one_line(text: str) -> str:
    """An error message as the one line it must be: line breaks and every other character a
    terminal would act on (a reason the payload sent, a path an operator typed) made visible."""
    from common.wire.text import display_text  # lazy: an error path; `ow --help` does not need it

    return display_text(text)


def _memory_message(exc: BaseException) -> str:
    detail = str(exc).strip().splitlines()
    what = f"{type(exc).__name__}: {detail[0][:200]}" if detail else type(exc).__name__
    return f"out of memory ({what}); the process needs more memory or a higher address-space limit"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = argv[0] if argv and not argv[0].startswith("-") else "?"
    try:
        fast = FAST_PATHS.get(tuple(argv[:2]))
        parser = build_parser([fast] if fast else None)
        args = parser.parse_args(argv)
        command = args.command
        return int(args.func(args) or 0)
    except CliError as exc:
        print(f"ow {command}: error: {one_line(str(exc))}", file=sys.stderr)
        return exc.code
    except KeyboardInterrupt:
        print(f"ow {command}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - only running out of memory is turned into one line
        cause = out_of_memory(exc)
        if cause is None:
            raise  # a bug: the traceback is what a developer needs
        print(f"ow {command}: error: {_memory_message(cause)}", file=sys.stderr)
        return EXIT_OUT_OF_MEMORY


if __name__ == "__main__":
    sys.exit(main())
