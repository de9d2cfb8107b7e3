"""`ow flight run`: the onboard process.

The boot path: the bus execs this and expects the payload's link up within 0.5 s, so this module
imports only what parsing needs (flight/cli_options.py, no torch). `cmd_run` asks the kernel to
page in the weights first and then imports the logging and the onboard process (structlog,
ZeroMQ, the wire codecs: most of the boot's import time), so that the reads overlap those imports;
the engine's libraries (torch, transformers) load later on the worker thread
(Worker.load_engine in worker.py, where a fault or a kill is counted against `engine:load`).
"""

from __future__ import annotations

import argparse
import glob
import os
import signal
import sys
from pathlib import Path

from common import bootrecord
from common.errors import CliError, check_number
from flight.cli_options import (
    EXIT_USAGE,
    add_engine_arguments,
    cadence_for,
    check_directory_option,
    config_num_layers,
    data_storage_for,
    engine_options,
    policy_overrides,
    report_overrides,
    storage_for,
)
from flight.model.config import page_in, weight_files
from flight.options import DEFAULT_RESERVE_BYTES

#: `ow flight run` exit statuses beyond flight/cli_options.py's (docs/flight.md "Boot"): a key
#: that is present but cannot be read as a key, and anything unforeseen before the process ends.
EXIT_KEYS = 5
EXIT_UNEXPECTED = 1


def register(sub) -> None:
    flight = sub.add_parser(
        "flight", help="the onboard payload process", description="Commands of the onboard (payload) side."
    )
    fsub = flight.add_subparsers(dest="flight_command", metavar="SUBCOMMAND")
    fsub.required = True
    run = fsub.add_parser(
        "run",
        help="run the payload process (normally spawned by the bus)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Connect to the bus's payload link, take telecommands, run queued VLM tasks with\n"
        "crash-consistent checkpoints, report progress and telemetry. Everything that matters\n"
        "is on disk under --data-dir before it is acknowledged, so the process can be SIGKILLed\n"
        "at any instant (that is what a power cut does) and started again: it resumes the\n"
        "interrupted task first.",
        epilog="The engine options must stay the same across boots for a task to resume; a change makes\n"
        "the task restart from scratch (logged).\n\n"
        "A missing or unreadable --model does not stop it: it connects, reports BOOT_FAULT and\n"
        "waits for the model. What does stop it at boot prints one line saying why, and a JSON\n"
        'line {"boot_failed": ..., "exit_status": N} on stderr that the bus reads. Exit status:\n'
        "2 bad options or missing keys; 5 a key that cannot be read (damaged, truncated);\n"
        "1 anything unforeseen (with its traceback).",
    )
    run.add_argument("--data-dir", required=True, help="persistent state: queue, images, checkpoints")
    run.add_argument("--model", required=True, help="local model directory")
    run.add_argument(
        "--keys",
        default=os.environ.get("OW_KEYS_DIR", "keys"),
        help="keys directory (clients/payload.key_secret, server/bus.key); default $OW_KEYS_DIR or ./keys",
    )
    run.add_argument(
        "--payload-endpoint",
        default=os.environ.get("OW_PAYLOAD_ENDPOINT", "tcp://127.0.0.1:5551"),
        help="the bus's payload link (default $OW_PAYLOAD_ENDPOINT or tcp://127.0.0.1:5551)",
    )
    run.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    run.add_argument(
        "--results-budget-mb",
        type=float,
        default=256.0,
        metavar="MB",
        help="disk kept for finished tasks' results (default 256); beyond it the oldest results "
        "already reported are evicted (RESULT_EVICTED event), their tasks still recognised",
    )
    run.add_argument(
        "--compact-after",
        type=int,
        default=512,
        metavar="N",
        help="queue journal entries between compactions (default 512)",
    )
    run.add_argument(
        "--storage-reserve-mb",
        type=float,
        default=DEFAULT_RESERVE_BYTES / 2**20,
        metavar="MB",
        help=f"space set aside on the data disk for the payload's own state, queue and health records "
        f"(default {DEFAULT_RESERVE_BYTES >> 20}); released when the disk fills up, so that they can still be "
        'written (docs/flight.md "Storage")',
    )
    add_engine_arguments(run)
    run.set_defaults(func=cmd_run)


def cmd_run(args) -> int:
    """Run the payload. Whatever ends it at boot ends it with one line saying why, the boot-failure
    record the bus reads (common/bootrecord.py): an option error or a damaged key (CliError,
    with its exit status), or anything unforeseen (exit 1, after its traceback and crash record
    as before). A missing model is not among them: the payload comes up without it."""
    try:
        return _run(args)
    except CliError as exc:
        bootrecord.write(str(exc), exc.code)
        raise
    except Exception as exc:  # noqa: BLE001 - recorded, then raised unchanged (traceback, crash record)
        bootrecord.write(f"{type(exc).__name__}: {exc}", EXIT_UNEXPECTED)
        raise


def check_payload_keys(keys_dir: str) -> None:
    """The payload's key pair and the bus's public key must load as keys (40 Z85 characters for
    32 bytes each). A damaged one can never authenticate, so the boot stops here with a line
    naming the file (EXIT_KEYS), not with a traceback from the link later."""
    import zmq.auth  # the link imports it anyway
    from zmq.utils import z85

    from common.wire.link import KeyLayout

    layout = KeyLayout(Path(keys_dir))
    for path, what in ((layout.client_secret("payload"), "payload key"), (layout.server_public, "bus public key")):
        if not path.exists():
            raise CliError(f"no {what} {path} (run `ow ground keys init` and copy the keys)", EXIT_USAGE)
        try:
            public, secret = zmq.auth.load_certificate(path)
            keys = [public, secret] if what == "payload key" else [public]
            if any(key is None or len(z85.decode(key)) != 32 for key in keys):
                raise ValueError("not a 32-byte Z85 key")
        except Exception as exc:  # noqa: BLE001 - whatever the file holds, it is not a usable key
            detail = str(exc).replace(str(path), "the file")  # zmq names the file again
            raise CliError(
                f"{what} {path} cannot be read as a key ({type(exc).__name__}: {detail}); copy it again", EXIT_KEYS
            ) from None


def _run(args) -> int:
    # First, before the libraries below load: have the kernel page in what the first unit of work
    # reads (weights, the stored inputs of tasks), so that a cold boot's reads overlap the imports.
    try:
        page_in(weight_files(args.model) + glob.glob(os.path.join(args.data_dir, "tasks", "*", "inputs.rec")))
    except OSError:
        pass  # a missing model is reported once the payload is up (BOOT_FAULT)
    # Boot path (module docstring): imported after the page-in is asked for, not at the top.
    # Nothing here imports torch: the link is up and answering before the engine's libraries
    # load on the worker thread (which sets the thread count before any tensor op).
    from common import log as owlog
    from flight.runtime.app import FlightApp, FlightConfig

    owlog.setup(args.log_level, component="flight")
    logger = owlog.get()
    options = engine_options(args)
    # A missing or unreadable model directory does not stop the boot (no environment may): the
    # payload comes up, reports BOOT_FAULT and waits for it (Worker.load_engine, flight/runtime/worker.py).
    num_layers = config_num_layers(args.model)
    if num_layers is not None:
        report_overrides(
            policy_overrides(args, options, num_layers), lambda level, *a, **kw: getattr(logger, level)(*a, **kw)
        )
    if not os.path.exists(os.path.join(args.keys, "clients", "payload.key_secret")):
        raise CliError(f"no payload key in {args.keys} (run `ow ground keys init` and copy the keys)", EXIT_USAGE)
    check_payload_keys(args.keys)

    check_number(args.results_budget_mb, "--results-budget-mb", at_least=0, code=EXIT_USAGE)
    if args.compact_after < 1:
        raise CliError("--compact-after must be at least 1", EXIT_USAGE)
    check_directory_option(args.data_dir, "--data-dir")  # a file there: one line, not a traceback at boot
    check_number(args.storage_reserve_mb, "--storage-reserve-mb", at_least=0, code=EXIT_USAGE)
    fs, weight_hook = storage_for(args)
    data_fs = data_storage_for(args, fs)
    config = FlightConfig(
        args.data_dir,
        args.model,
        args.keys,
        args.payload_endpoint,
        options,
        device=args.device,
        dtype=args.dtype,
        fs=data_fs,
        checkpoint_fs=fs,
        weight_read_hook=weight_hook,
        results_budget_bytes=int(args.results_budget_mb * 2**20),
        compact_after=args.compact_after,
        storage_reserve_bytes=int(args.storage_reserve_mb * 2**20),
    )
    app = FlightApp(config, cadence=cadence_for(args))
    signal.signal(signal.SIGTERM, lambda *_: app.stop.set())
    code = app.run()
    if app.worker_busy():  # e.g. stopped inside a weight load: see FlightApp.worker_busy
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code
