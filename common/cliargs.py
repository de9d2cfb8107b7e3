"""Command lines declared as data: each command is a `Command` holding its `Arg`s (and titled or
mutually exclusive `Group`s of them), and `add_commands` turns a tuple of them into argparse
subcommands. argparse stays the parser (its help, errors and exit codes are what users see); this
only keeps the declarations in one readable table per component instead of functions of hundreds of
`add_argument` calls (docs/architecture.md "Command lines")."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Arg:
    """One `add_argument` call: its flags (or positional name) and keyword options."""

    flags: tuple[str, ...]
    options: Mapping[str, Any]


def arg(*flags: str, **options: Any) -> Arg:
    """`arg("--seed", type=int, help=...)` declares what `add_argument` would be given."""
    if not flags:
        raise ValueError("an argument needs a name or at least one flag")
    return Arg(flags, options)


@dataclass(frozen=True)
class Group:
    """Arguments shown under one title in `--help`, or of which at most one may be given."""

    args: tuple[Arg, ...]
    title: str | None = None
    exclusive: bool = False
    #: for an exclusive group: one of them must be given
    required: bool = False


@dataclass(frozen=True)
class Command:
    """One subcommand: its name, help line, handler (`args -> exit status`) and arguments."""

    name: str
    help: str
    handler: Callable[[argparse.Namespace], int] | None
    description: str | None = None
    args: tuple[Arg | Group, ...] = ()
    epilog: str | None = None
    #: keep the description's and epilog's own line breaks (examples, tables)
    raw: bool = False
    #: parsers whose arguments this command shares (argparse's `parents`)
    parents: Sequence[argparse.ArgumentParser] = field(default=())
    #: further defaults set on the parsed namespace besides `func`
    defaults: Mapping[str, Any] = field(default_factory=dict)
    #: called with the built parser, for what argparse has no keyword for
    setup: Callable[[argparse.ArgumentParser], None] | None = None


def add_args(parser: argparse.ArgumentParser | Any, items: Iterable[Arg | Group]) -> None:
    """Add declared arguments and groups to a parser (or to an argument group)."""
    for item in items:
        if isinstance(item, Arg):
            parser.add_argument(*item.flags, **item.options)
            continue
        if item.exclusive:
            target = parser
            if item.title is not None:
                target = parser.add_argument_group(item.title)
            group = target.add_mutually_exclusive_group(required=item.required)
        else:
            group = parser.add_argument_group(item.title)
        add_args(group, item.args)


def add_commands(
    subparsers: Any,
    commands: Iterable[Command],
    wrap: Callable[[Callable[[argparse.Namespace], int]], Callable[[argparse.Namespace], int]] | None = None,
    *,
    parents: Sequence[argparse.ArgumentParser] = (),
    epilog: str | None = None,
) -> dict[str, argparse.ArgumentParser]:
    """Register each command with an argparse `add_subparsers()` object; `wrap`, when given, wraps
    every handler (e.g. to turn a component's errors into exit codes); `parents` and `epilog` are
    every command's (shared options built at run time, a common footer) unless it has its own
    epilog. Returns the parsers by name."""
    made = {}
    for command in commands:
        extra: dict[str, Any] = {}
        if command.raw:
            extra["formatter_class"] = argparse.RawDescriptionHelpFormatter
        if command.parents or parents:
            extra["parents"] = [*parents, *command.parents]
        parser = subparsers.add_parser(
            command.name,
            help=command.help,
            description=command.description,
            epilog=command.epilog if command.epilog is not None else epilog,
            **extra,
        )
        add_args(parser, command.args)
        if command.setup is not None:
            command.setup(parser)
        if command.handler is not None:
            handler = wrap(command.handler) if wrap is not None else command.handler
            parser.set_defaults(func=handler, **command.defaults)
        elif command.defaults:
            parser.set_defaults(**command.defaults)
        made[command.name] = parser
    return made
