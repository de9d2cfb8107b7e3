"""common/cliargs.py: declared commands become the argparse parsers they describe."""

from __future__ import annotations

import argparse

import pytest

from common.cliargs import Command, Group, add_commands, arg


def build(*commands: Command, wrap=None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ow")
    add_commands(parser.add_subparsers(dest="command"), commands, wrap=wrap)
    return parser


def test_arguments_groups_and_handler_are_registered():
    shared = argparse.ArgumentParser(add_help=False)
    shared.add_argument("--keys", default="keys")
    parser = build(
        Command(
            "go",
            help="go somewhere",
            handler=lambda args: 7,
            description="first line\n  second line",
            raw=True,
            parents=(shared,),
            defaults={"origin": "test"},
            args=(
                arg("target", help="where"),
                Group((arg("--fast", action="store_true"), arg("--slow", action="store_true")), exclusive=True),
                Group((arg("--retries", type=int, default=3),), title="delivery"),
            ),
        )
    )
    args = parser.parse_args(["go", "home", "--fast", "--keys", "k2"])
    assert (args.target, args.fast, args.slow, args.retries, args.keys, args.origin) == (
        "home",
        True,
        False,
        3,
        "k2",
        "test",
    )
    assert args.func(args) == 7
    help_text = parser._subparsers._group_actions[0].choices["go"].format_help()  # noqa: SLF001
    assert "first line\n  second line" in help_text and "delivery:" in help_text


def test_an_exclusive_group_refuses_both(capsys):
    parser = build(
        Command(
            "go",
            help="go",
            handler=None,
            args=(
                Group(
                    (arg("--fast", action="store_true"), arg("--slow", action="store_true")),
                    exclusive=True,
                    required=True,
                ),
            ),
        )
    )
    with pytest.raises(SystemExit) as stop:
        parser.parse_args(["go", "--fast", "--slow"])
    assert stop.value.code == 2 and "not allowed with argument" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parser.parse_args(["go"])


def test_wrap_wraps_every_handler():
    seen = []

    def wrap(handler):
        def wrapped(args):
            seen.append(args.command)
            return handler(args) + 1

        return wrapped

    parser = build(
        Command("a", help="a", handler=lambda args: 1), Command("b", help="b", handler=lambda args: 2), wrap=wrap
    )
    args = parser.parse_args(["b"])
    assert args.func(args) == 3 and seen == ["b"]


def test_an_argument_needs_a_name():
    with pytest.raises(ValueError):
        arg()
