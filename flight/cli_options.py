"""What `ow infer` (flight/cli.py) and `ow flight run` (flight/runtime/cli.py) share: the exit
codes, the engine's command-line options and how they become `EngineOptions`, the storage
emulation, the cadence, and the report of options a policy overrides.

Both commands import this module; it imports neither of them. It is on `ow flight run`'s boot
path (flight/runtime/cli.py), so its top-level imports are the light ones parsing needs; two are
imported where they are used, after the boot has asked the kernel to page the weights in:
flight.checkpoint.cadence (crc32c). Nothing here imports torch, and nothing here imports the
recovery planners (the optimal one brings numpy: ~0.2 s idle, over 1 s on a loaded machine):
`--planner` is checked against flight.options.PLANNER_NAMES, and the planner loads with the engine
on the inference worker (docs/flight.md "Boot").
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import json
import math
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from common.durable import DurableFS, ThrottledFS, TokenBucket
from common.errors import EXIT_OUT_OF_MEMORY, CliError, check_number
from flight.checkpoint.policies import POLICIES, Geometry, Policy, adaptive_policies, get_policy, takes_adaptive_cadence
from flight.options import DEFAULT_PLANNER, PLANNER_NAMES, EngineOptions, default_cadence, resolve_cadence

if TYPE_CHECKING:
    from flight.checkpoint.cadence import Cadence

EXIT_OK, EXIT_USAGE, EXIT_MODEL, EXIT_INPUT = 0, 2, 3, 4
#: out of memory or address space (common.errors): one line, whatever the command
EXIT_NO_MEMORY = EXIT_OUT_OF_MEMORY
#: what torch's start-up allocates beyond mapping its shared libraries, as an allowance: with
#: less, its C++ static initialisers throw std::bad_alloc and the process aborts (SIGABRT)
#: before Python can report anything (measured: within about 20 MiB above the libraries)
TORCH_START_ALLOWANCE_BYTES = 64 << 20

#: The geometry options, their flags, and the defaults a command line that does not give them gets.
GEOMETRY_FLAGS = {
    "chunk": "--chunk",
    "group": "--group",
    "decode_every": "--decode-every",
    "vision_every": "--vision-every",
}
DEFAULT_GEOMETRY = Geometry()


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    group.add_argument(
        "--policy",
        default="orbitweaver",
        choices=sorted(POLICIES),
        help="checkpoint policy (default orbitweaver; none = no checkpoints). The baselines fix some of "
        "--group/--decode-every/--vision-every as their definitions give; the command says so when it does",
    )
    # Defaults None, so that a value a policy overrides is known to have been given (or not).
    group.add_argument(
        "--chunk",
        type=int,
        default=None,
        metavar="C",
        help=f"prompt tokens per prefill chunk ({DEFAULT_GEOMETRY.chunk})",
    )
    group.add_argument(
        "--group",
        type=int,
        default=None,
        metavar="G",
        help=f"decoder layers per prefill block ({DEFAULT_GEOMETRY.group})",
    )
    group.add_argument(
        "--decode-every",
        type=int,
        default=None,
        metavar="D",
        help=f"decode steps per record ({DEFAULT_GEOMETRY.decode_every})",
    )
    group.add_argument(
        "--vision-every",
        type=int,
        default=None,
        metavar="K",
        help=f"vision blocks per vision checkpoint ({DEFAULT_GEOMETRY.vision_every})",
    )
    group.add_argument(
        "--planner",
        default=DEFAULT_PLANNER,
        help=f"recovery planner of orbitweaver and the strengthened baselines: {DEFAULT_PLANNER} (default, "
        "OrbitWeaver's own), chunk-first or layer-first; the paper-defined baselines restore as their "
        "definitions say",
    )
    group.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda when present, else cpu")
    group.add_argument(
        "--dtype",
        default=None,
        choices=["float32", "bfloat16", "float16"],
        help="compute dtype (default: the checkpoint's)",
    )
    group.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"], help="attention implementation (sdpa)")
    group.add_argument(
        "--threads", type=int, default=None, help="intra-op threads (default: torch's; pinned per request)"
    )
    group.add_argument(
        "--decode-kv-compression",
        choices=["none", "int8"],
        default="none",
        help="int8: quantise the KV in decode checkpoints (smaller, faster decode-phase recovery). "
        "GIVES UP BITWISE IDENTITY: after a resume in decode the answer may differ from an "
        "uninterrupted run. Off by default",
    )
    group.add_argument(
        "--emulate-read-mbps",
        type=float,
        default=None,
        metavar="MB/S",
        help="throttle checkpoint reads to this bandwidth (emulate a target's storage)",
    )
    group.add_argument(
        "--emulate-weight-read-mbps",
        type=float,
        default=None,
        metavar="MB/S",
        help="throttle model weight reads to this bandwidth (emulate a target's storage)",
    )
    group.add_argument(
        "--emulate-write-mbps",
        type=float,
        default=None,
        metavar="MB/S",
        help="throttle checkpoint writes to this bandwidth (emulate a target's storage)",
    )
    group.add_argument(
        "--emulate-data-weight",
        type=float,
        default=None,
        metavar="W",
        help="with --emulate-read/write-mbps: the payload's own data (task inputs, images, queue) "
        "is charged W device bytes per byte, 0 < W <= 1 (the testbench's small model stands for a "
        "larger one: its checkpoint bytes stand for more target bytes than its inputs do; docs/hil.md)",
    )
    group.add_argument(
        "--pace-ms",
        type=float,
        default=0.0,
        help="stretch each block/step to at least this many ms (emulates a slower payload)",
    )
    # Default None: the policy's (default_cadence), resolved once the policy is parsed.
    group.add_argument(
        "--cadence",
        choices=["fixed", "adaptive"],
        default=None,
        help="adaptive: a record early when a cut is likely before the next one the fixed cadence "
        "would write, from bus warnings, telemetry trends and the window lengths seen since launch "
        "(orbitweaver only; docs/engine.md); fixed: a decode record every D steps, a vision state "
        "every K blocks (the paper's). Default: the policy's, "
        f"{default_cadence('orbitweaver')} for orbitweaver, {default_cadence('hcache')} for the "
        "baselines (their definitions fix it)",
    )
    group.add_argument(
        "--thermal-limit-c",
        type=float,
        default=None,
        metavar="C",
        help="adaptive cadence: payload temperature at which the bus cuts (default 55)",
    )
    group.add_argument(
        "--soc-cutoff",
        type=float,
        default=None,
        metavar="FRACTION",
        help="adaptive cadence: battery state of charge at which the bus cuts (default 0.40)",
    )


def check_room_for_torch() -> None:
    """Under an address-space limit too small for torch even to start, a one-line error
    (EXIT_NO_MEMORY) before it is imported: there, a library that cannot be mapped is an
    ImportError (reported as out of memory by `ow`), but a limit just above its libraries' size
    lets them map and then aborts the process from C++, which no handler can turn into a line.
    The floor is this process's address space now, plus the size of torch's shared libraries
    (read from the files, not loaded), plus TORCH_START_ALLOWANCE_BYTES."""
    if "torch" in sys.modules:
        return  # loaded already: its libraries are in the address space this process has
    try:
        import resource  # lazy: POSIX only, and only this check needs it
    except ImportError:
        return
    limit = resource.getrlimit(resource.RLIMIT_AS)[0]
    spec = importlib.util.find_spec("torch")
    if limit == resource.RLIM_INFINITY or spec is None or spec.origin is None:
        return
    libraries = sum(os.path.getsize(p) for p in glob.glob(os.path.join(os.path.dirname(spec.origin), "lib", "*.so*")))
    try:
        with open("/proc/self/statm") as f:
            mapped = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return
    floor = mapped + libraries + TORCH_START_ALLOWANCE_BYTES
    if limit < floor:
        raise CliError(
            f"out of memory: the address-space limit is {limit / 2**20:.0f} MiB; torch needs at least "
            f"{math.ceil(floor / 2**20)} MiB to start (its libraries map {libraries / 2**20:.0f} MiB)",
            EXIT_NO_MEMORY,
        )


def engine_options(args: argparse.Namespace) -> EngineOptions:
    for name, flag in GEOMETRY_FLAGS.items():
        value = getattr(args, name)
        if value is not None and value < 1:
            raise CliError(f"{flag} must be at least 1", EXIT_USAGE)
    if args.planner not in PLANNER_NAMES:
        raise CliError(f"unknown --planner {args.planner!r}; choose from {', '.join(PLANNER_NAMES)}", EXIT_USAGE)
    if args.threads is not None and args.threads < 1:
        raise CliError("--threads must be at least 1", EXIT_USAGE)
    cadence = resolve_cadence(args.policy, args.cadence)
    if cadence == "adaptive" and not takes_adaptive_cadence(args.policy):
        raise CliError(
            f"--cadence adaptive is {'/'.join(adaptive_policies())}'s; the {args.policy} baseline keeps the cadence "
            f"its definition gives (docs/baselines.md)",
            EXIT_USAGE,
        )
    if args.soc_cutoff is not None and not 0 <= args.soc_cutoff <= 1:
        raise CliError("--soc-cutoff must be a fraction between 0 and 1", EXIT_USAGE)
    # A negative or non-finite pace would be taken silently (a unit "at least -1 ms long"), and
    # a non-finite temperature limit would make every cut look unlikely or certain.
    check_number(args.pace_ms, "--pace-ms", at_least=0, code=EXIT_USAGE)
    check_number(args.thermal_limit_c, "--thermal-limit-c", code=EXIT_USAGE)
    given = {name: getattr(args, name) for name in GEOMETRY_FLAGS if getattr(args, name) is not None}
    return EngineOptions(
        geometry=Geometry(**given),
        policy=args.policy,
        planner=args.planner,
        pace_ms=args.pace_ms,
        threads=args.threads,
        decode_kv_compression=args.decode_kv_compression,
        cadence=cadence,
    )


def check_directory_option(path: str, flag: str) -> None:
    """A directory option (`--data-dir`, `--ckpt-dir`) that is a directory or can become one: a
    one-line EXIT_USAGE error when it, or the nearest part of it that exists, is a regular file
    or anything else that is not a directory. Checked before anything is written, so that a
    payload started on a file reports that at once instead of failing at its first write."""
    probe = os.path.abspath(path)
    while not os.path.lexists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            return
        probe = parent
    if not os.path.isdir(probe):
        kind = "a regular file" if os.path.isfile(probe) else "not a directory"
        if probe == os.path.abspath(path):
            raise CliError(f"{flag} {path} is {kind}, not a directory", EXIT_USAGE)
        raise CliError(f"{flag} {path} cannot be created: {probe} is {kind}, not a directory", EXIT_USAGE)


@dataclass(frozen=True)
class Override:
    """A geometry option the policy runs with another value than the command line's."""

    option: str  # the flag, e.g. "--group"
    given: int  # the command line's value
    explicit: bool  # given on the command line (False: the default)
    used: int  # the policy's value: what runs, and what the MANIFEST records
    policy: str
    reason: str

    def message(self) -> str:
        given = f"{self.option} {self.given}" + ("" if self.explicit else " (the default)")
        return f"{given} is overridden by the {self.policy} policy, which runs with {self.used}: {self.reason}"


def policy_overrides(args: argparse.Namespace, options: EngineOptions, num_layers: int) -> list[Override]:
    """The geometry options the policy replaces, for a model of `num_layers` decoder layers."""
    policy: Policy = get_policy(options.policy)
    used = policy.geometry(options.geometry, num_layers)
    reason = f"its definition fixes it ({policy.description}; docs/baselines.md)"
    return [
        Override(
            flag,
            getattr(options.geometry, name),
            getattr(args, name) is not None,
            getattr(used, name),
            policy.name,
            reason,
        )
        for name, flag in GEOMETRY_FLAGS.items()
        if getattr(used, name) != getattr(options.geometry, name)
    ]


def report_overrides(overrides: list[Override], log: Callable[..., None]) -> None:
    """One `option_overridden` line per override (a warning when the value was given explicitly)."""
    for override in overrides:
        log(
            "warning" if override.explicit else "info",
            "option_overridden",
            option=override.option,
            given=override.given,
            explicit=override.explicit,
            policy_value=override.used,
            policy=override.policy,
            message=override.message(),
        )


def config_num_layers(model_dir: str) -> int | None:
    """The decoder's layer count from a model directory's config.json (None if unreadable):
    what a policy's geometry depends on, known without loading the model."""
    try:
        with open(os.path.join(model_dir, "config.json")) as f:
            config = json.load(f)
        text = config.get("text_config") or config
        return int(text["num_hidden_layers"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def cadence_for(args: argparse.Namespace, windows: list[float] | None = None, started: float | None = None) -> Cadence:
    """The cadence of a process run with these arguments (limits from the command line)."""
    from flight.checkpoint import cadence as cadence_module  # crc32c, on the boot path (module docstring)

    return cadence_module.Cadence(
        resolve_cadence(args.policy, args.cadence),
        windows,
        started=started,
        thermal_limit_c=cadence_module.DEFAULT_THERMAL_LIMIT_C
        if args.thermal_limit_c is None
        else args.thermal_limit_c,
        soc_cutoff=cadence_module.DEFAULT_SOC_CUTOFF if args.soc_cutoff is None else args.soc_cutoff,
    )


def storage_for(args: argparse.Namespace) -> tuple[DurableFS, Callable[[int], object] | None]:
    """(file layer, weight-read hook): plain, or throttled to emulate a target device's storage."""
    read, write = getattr(args, "emulate_read_mbps", None), getattr(args, "emulate_write_mbps", None)
    weights = getattr(args, "emulate_weight_read_mbps", None)
    for name, value in (
        ("--emulate-read-mbps", read),
        ("--emulate-write-mbps", write),
        ("--emulate-weight-read-mbps", weights),
    ):
        check_number(value, name, above=0, code=EXIT_USAGE)
    fs = (
        DurableFS()
        if read is None and write is None
        else ThrottledFS(read * 1e6 if read else None, write * 1e6 if write else None)
    )
    hook = TokenBucket(weights * 1e6).take if weights else None
    return fs, hook


def data_storage_for(args: argparse.Namespace, fs: DurableFS) -> DurableFS:
    """The file layer for the onboard process's own data beside the engine's checkpoint records:
    the same device, charged `--emulate-data-weight` device bytes per byte where throttled."""
    weight = getattr(args, "emulate_data_weight", None)
    if weight is None:
        return fs
    check_number(weight, "--emulate-data-weight", above=0, at_most=1, code=EXIT_USAGE)
    return fs.weighted(weight) if isinstance(fs, ThrottledFS) else fs
