"""`ow bus ...` (the mock spacecraft bus) and `ow hil ...` (traces and the testbench)."""

from __future__ import annotations

from hil.bus.cli import register_bus
from traces.cli import register_trace_commands


def register(sub) -> None:
    register_bus(sub)
    hil = sub.add_parser(
        "hil",
        help="hardware-in-the-loop: traces, testbench, campaigns, replay, deployment",
        description="Interruption traces and the hardware-in-the-loop testbench that runs the real "
        "bus and payload processes against them.",
    )
    hsub = hil.add_subparsers(dest="hil_command", metavar="SUBCOMMAND")
    hsub.required = True
    register_trace_commands(hsub)
    try:
        # lazy: `ow --help` imports this module; the subcommand's own modules load when it runs
        from hil.testbench_cli import register_testbench
    except ModuleNotFoundError as exc:
        if exc.name != "hil.testbench_cli":
            raise
        return
    register_testbench(hsub)
