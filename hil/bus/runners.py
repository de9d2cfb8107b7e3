"""Running a bus: `BusThread` in a background thread of this process (tests, the testbench, the
demo), `BusProcess` as a child process running `ow bus run` (what the testbench does to kill the
bus itself), and `config_to_argv`, the `ow bus run` arguments equivalent to a `BusConfig`."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

from common.wire.link import Endpoints
from hil.bus import buslog as bl
from hil.bus.base import Pacer
from hil.bus.config import BusConfig
from hil.bus.lifecycle import Bus
from hil.bus.power import PowerSwitch


class BusThread:
    """A bus in a background thread of this process (tests, the testbench, the demo).

    with BusThread(config) as bus:
        bus.endpoints.commands ...
    """

    def __init__(self, config: BusConfig, switch: PowerSwitch | None = None, pacer: Pacer | None = None):
        self.bus = Bus(config, switch, pacer)
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name="mock-bus", daemon=True)

    def _main(self) -> None:
        try:
            self.bus.run()
        except BaseException as exc:  # reported by stop()
            self.error = exc
            self.bus.ready.set()

    @property
    def endpoints(self) -> Endpoints:
        if self.bus.endpoints is None:
            raise RuntimeError("the bus is not started (BusThread.start())")
        return self.bus.endpoints

    @property
    def log_path(self) -> Path:
        return self.bus.data_dir / bl.LOG_FILE

    def start(self, timeout_s: float = 30.0) -> BusThread:
        # The switch spawns the payload from the bus thread: its parent-death signal is tied
        # to that thread, so the payload dies with the bus.
        self._thread.start()
        if not self.bus.ready.wait(timeout_s) or self.error is not None:
            raise RuntimeError(f"bus did not start: {self.error!r}")
        return self

    def stop(self, timeout_s: float = 30.0) -> None:
        self.bus.request_stop()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise RuntimeError("bus thread did not stop")
        if self.error is not None:
            raise self.error

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def __enter__(self) -> BusThread:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def config_to_argv(config: BusConfig) -> list[str]:
    """`ow bus run` arguments equivalent to `config` (BusProcess uses them)."""
    c = config
    e = c.endpoints
    argv = [
        "--trace",
        str(c.trace),
        "--data-dir",
        str(c.data_dir),
        "--keys",
        str(c.keys_dir),
        "--time-scale",
        repr(float(c.time_scale)),
        "--start-at",
        repr(float(c.start_at_s)),
        "--commands-endpoint",
        e.commands,
        "--payload-endpoint",
        e.payload,
        "--telemetry-endpoint",
        e.telemetry,
        "--power-driver",
        c.power_driver,
        "--heartbeat-timeout",
        repr(float(c.heartbeat_timeout_s)),
        "--boot-timeout",
        repr(float(c.boot_timeout_s)),
        "--heartbeat-gap-log",
        repr(float(c.heartbeat_gap_log_s)),
        "--fdir-off",
        repr(float(c.fdir_off_s)),
        "--confirm-after",
        repr(float(c.confirm_after_s)),
        "--max-in-flight",
        str(c.max_in_flight),
        "--station-quota",
        str(c.station_quota),
        "--station-rate",
        repr(float(c.station_rate)),
        "--station-burst",
        str(c.station_burst),
        "--store-max-commands",
        str(c.store_max_commands),
        "--store-max-mb",
        repr(c.store_max_bytes / 2**20),
        "--throttle-event-s",
        repr(float(c.throttle_event_s)),
        "--log-segment-mb",
        repr(c.log_segment_bytes / 2**20),
        "--log-segments",
        str(c.log_segments),
        "--boot-loop-limit",
        str(c.boot_loop_limit),
        "--boot-loop-backoff",
        repr(float(c.boot_loop_backoff_s)),
        "--boot-settle",
        repr(float(c.boot_settle_s)),
        "--telemetry-max-hz",
        repr(float(c.telemetry_max_hz)),
        "--bus-temp-c",
        repr(float(c.bus_temp_c)),
        "--payload-client",
        c.payload_client,
        "--switch-timeout",
        repr(float(c.switch_timeout_s)),
    ]
    if c.stop_at_end:
        argv.append("--stop-at-end")
    if c.skip_idle:
        argv.append("--skip-idle")
    if c.hold_for_connect:
        argv.append("--hold-for-connect")
    for hold in c.hold_at_s:
        argv += ["--hold-at", repr(float(hold))]
    if not c.log_packets:
        argv.append("--no-log-packets")
    optional = {
        "--payload-connect-endpoint": c.payload_connect_endpoint,
        "--model": c.model,
        "--payload-data-dir": c.payload_data_dir,
        "--payload-keys": c.payload_keys_dir,
        "--ssh-host": c.ssh_host,
        "--ssh-user": c.ssh_user,
        "--ssh-port": c.ssh_port,
        "--ssh-identity": c.ssh_identity,
        "--ssh-pidfile": c.ssh_pidfile,
        "--ssh-kill-command": c.ssh_kill_command,
        "--ssh-reboot-command": c.ssh_reboot_command,
        "--power-on-command": c.power_on_command,
        "--power-off-command": c.power_off_command,
        "--ready-file": c.ready_file,
    }
    for flag, value in optional.items():
        if value is not None:
            argv += [flag, str(value)]
    argv += ["--ssh-mode", c.ssh_mode]
    if c.payload_command is not None:
        argv += ["--payload-command", shlex.join(c.payload_command)]
    if c.ssh_transport is not None:
        argv += ["--ssh-transport", shlex.join(c.ssh_transport)]
    for option in c.ssh_options:
        argv += ["--ssh-option", option]
    for client in c.ground_clients or ():
        argv += ["--ground-client", client]
    for arg in c.flight_args:
        argv.append(f"--flight-arg={arg}")
    if c.boot_trace_s is not None:
        argv += ["--boot-trace-s", repr(float(c.boot_trace_s))]
    for entry in c.zygote_preload or ():
        argv += ["--zygote-preload", entry]
    return argv


class BusProcess:
    """`ow bus run` as a child process (what the testbench does to kill the bus itself).

        bus = BusProcess(config).start()      # waits until the sockets are bound
        bus.endpoints.commands ...
        bus.stop()                            # SIGTERM: cut the payload, flush, exit
        bus.kill()                            # SIGKILL: the bus dies with its state on disk

    The ready file defaults to <data_dir>/bus-ready.json."""

    def __init__(
        self,
        config: BusConfig,
        *,
        log_path: str | os.PathLike | None = None,
        python: str | None = None,
        env: dict | None = None,
    ):
        ready_file = config.ready_file or Path(config.data_dir) / "bus-ready.json"
        self.config = replace(config, ready_file=ready_file)
        self.ready_file = Path(ready_file)
        self.log_path = Path(log_path) if log_path else Path(config.data_dir) / "bus-stderr.log"
        self.argv = [python or sys.executable, "-m", "hil.bus.cli", "run", *config_to_argv(self.config)]
        self.env = env
        self.proc: subprocess.Popen | None = None
        self.info: dict = {}

    @property
    def endpoints(self) -> Endpoints:
        return Endpoints(commands=self.info["commands"], payload=self.info["payload"], telemetry=self.info["telemetry"])

    def start(self, timeout_s: float = 660.0) -> BusProcess:
        """Start `ow bus run` and wait for its ready file (written once its power switch is
        prepared: a zygote's imports can take minutes on a loaded machine, at most 600 s)."""
        Path(self.config.data_dir).mkdir(parents=True, exist_ok=True)
        self.ready_file.unlink(missing_ok=True)
        with open(self.log_path, "ab") as err:
            self.proc = subprocess.Popen(
                self.argv, stdin=subprocess.DEVNULL, stdout=err, stderr=subprocess.STDOUT, env=self.env
            )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.ready_file.exists():
                info = json.loads(self.ready_file.read_text())
                if info.get("pid") == self.proc.pid:
                    self.info = info
                    return self
            if self.proc.poll() is not None:
                raise RuntimeError(f"bus exited with {self.proc.returncode}; see {self.log_path}")
            time.sleep(0.05)
        self.kill()
        raise RuntimeError(f"bus not ready within {timeout_s:g} s; see {self.log_path}")

    def stop(self, timeout_s: float = 30.0) -> int:
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def kill(self) -> int:
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.kill()
        return self.proc.wait()

    def __enter__(self) -> BusProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
