"""`Bus`: the parts put together, and its life: `start()` locks the data directory, binds the three
sockets and opens the command store and the run log; `run()` is the main loop; shutdown cuts the
payload and closes everything (docs/bus.md §7, §8)."""

from __future__ import annotations

import fcntl
import hashlib
import json
import math
import os
import threading
import time
from pathlib import Path

import zmq

import traces
from common import log, machine
from common.wire import PowerCause, decode
from common.wire.link import (
    CurveAuthenticator,
    Endpoints,
    bound_endpoint,
    recv_packet,
    server_socket,
    start_authenticator,
)
from hil.bus import buslog as bl
from hil.bus.base import Pacer
from hil.bus.busstore import CommandStore
from hil.bus.config import BusConfig, BusConfigError
from hil.bus.power import PowerSwitch, PowerSwitchError
from hil.bus.relay import RelayPart
from hil.bus.storage import TolerantSequenceCounter

_log = log.get("hil.bus")


def machine_fingerprint() -> dict:
    """What decides the bits of a CPU inference: processor model, core count, library versions.
    A replay on another fingerprint cannot expect identical logits."""
    return {"cpu": machine.cpu_model(), "cpus": machine.cpu_count(), **machine.library_versions()}


class Bus(RelayPart):
    """The mock spacecraft bus. Not thread-safe: one thread calls start() and run(); any thread
    may call request_stop()."""

    def __init__(self, config: BusConfig, switch: PowerSwitch | None = None, pacer: Pacer | None = None):
        super().__init__(config, switch, pacer)
        if switch is None:
            self.payload_argv(payload_endpoint="tcp://127.0.0.1:0")  # placeholders check out before binding
        self._started = False
        self._ctx: zmq.Context | None = None
        self._auth: CurveAuthenticator | None = None
        self._lock_fd: int | None = None
        self.ready = threading.Event()

    # ------------------------------------------------------------------ set-up
    def start(self) -> Endpoints:
        """Bind the sockets and open the store and the run log. Returns the bound endpoints."""
        cfg = self.config
        self._lock_data_dir()
        try:
            self.store = CommandStore(self.data_dir / "bus-store")
            if self.store.open_error is not None:
                self.storage.failed("command store", self.store.open_error)
            self.tm_counter = TolerantSequenceCounter(
                self.data_dir / "state" / "bus-tm-sequence.bin", self.storage, reserve=1024
            )
            self._ctx = zmq.Context()
            self._auth = start_authenticator(self._ctx, self.layout)
            self.commands_sock = server_socket(self._ctx, zmq.ROUTER, self.layout, cfg.endpoints.commands)
            self.payload_sock = server_socket(self._ctx, zmq.ROUTER, self.layout, cfg.endpoints.payload)
            # XPUB, not PUB: its subscription messages name each subscriber's key and connection,
            # so that a revoked key's telemetry subscription can be closed too.
            self.telemetry_sock = server_socket(self._ctx, zmq.XPUB, self.layout, cfg.endpoints.telemetry)
            self.telemetry_sock.setsockopt(zmq.XPUB_VERBOSE, 1)
            endpoints = Endpoints(
                commands=bound_endpoint(self.commands_sock),
                payload=bound_endpoint(self.payload_sock),
                telemetry=bound_endpoint(self.telemetry_sock),
            )
            self.endpoints = endpoints
            self.payload_connect_endpoint = cfg.payload_connect_endpoint or endpoints.payload
            self._open(cfg, endpoints)
        except BaseException:
            if getattr(self, "buslog", None) is not None:
                self.buslog.close()
            self._close_sockets()
            raise
        self._started = True
        self.ready.set()
        return endpoints

    def _open(self, cfg: BusConfig, endpoints: Endpoints) -> None:
        self.switch = self._switch_override or self._build_switch()
        self.buslog = bl.BusLog(
            self.data_dir / bl.LOG_FILE,
            segment_bytes=cfg.log_segment_bytes,
            segments=cfg.log_segments,
            listener=self.storage,
        )
        self.clock.t0 = self.buslog.started_monotonic
        # Commands stored by an earlier run: their answers go to the station's new connection.
        for entry in self.store.pending():
            self._expect_replies(entry.request, decode(entry.packet)[1])
        self.buslog.write(
            bl.RUN_START,
            trace_s=self.clock.start_at_s,
            clock_s=self.clock.clock_s(self.clock.t0),
            wall_s=0.0,
            format=bl.LOG_FORMAT,
            version=bl.LOG_VERSION,
            trace=self.trace.name,
            trace_path=str(traces.resolve(cfg.trace)),
            trace_sha256=self._trace_digest(),
            trace_duration_s=self.trace.duration_s,
            time_scale=cfg.time_scale,
            start_at_s=cfg.start_at_s,
            stop_at_end=cfg.stop_at_end,
            endpoints={
                "commands": endpoints.commands,
                "payload": endpoints.payload,
                "telemetry": endpoints.telemetry,
                "payload_connect": self.payload_connect_endpoint,
            },
            switch=self.switch.describe(),
            heartbeat_timeout_s=cfg.heartbeat_timeout_s,
            boot_timeout_s=cfg.boot_timeout_s,
            fdir_off_s=cfg.fdir_off_s,
            boot_loop_limit=cfg.boot_loop_limit,
            boot_loop_backoff_s=cfg.boot_loop_backoff_s,
            boot_settle_s=cfg.boot_settle_s,
            stored_commands=len(self.store),
            bus_pid=os.getpid(),
            model=cfg.model,
            flight_args=list(cfg.flight_args),
            machine=machine_fingerprint(),
            boot_trace_s=cfg.boot_trace_s,
            skip_idle=cfg.skip_idle,
            hold_for_connect=cfg.hold_for_connect,
            limits=self._limits(),
        )
        self._publish_early_events()
        self._check_keys(time.monotonic())  # what authorized/ holds now (and drops a revoked key's commands)
        _log.info(
            "bus_started",
            trace=self.trace.name,
            time_scale=cfg.time_scale,
            start_at_s=cfg.start_at_s,
            commands=endpoints.commands,
            payload=endpoints.payload,
            telemetry=endpoints.telemetry,
            stored_commands=len(self.store),
            driver=self.switch.driver,
        )
        try:
            self.switch.reset()
        except PowerSwitchError as exc:
            self._switch_failed("reset", exc)

    def _lock_data_dir(self) -> None:
        """One bus per data directory: two would share a queue and power two payloads."""
        path = self.data_dir / "bus.lock"
        try:
            self._lock_fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError:
            # A read-only (or full) disk: an existing lock file still locks when opened for
            # reading; without one, the bus runs unlocked rather than not at all.
            try:
                self._lock_fd = os.open(path, os.O_RDONLY)
            except OSError as exc:
                _log.error("bus_lock_unavailable", path=str(path), error=str(exc))
                return
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            self._lock_fd = None
            raise BusConfigError(f"another bus is running on {self.data_dir}") from None

    def _trace_digest(self) -> str:
        try:
            return hashlib.sha256(traces.resolve(self.config.trace).read_bytes()).hexdigest()
        except (OSError, ValueError, traces.TraceError):
            return ""

    def _write_ready(self, path: Path) -> None:
        endpoints = self.endpoints
        assert endpoints is not None  # run() starts the bus first
        info = {
            "commands": endpoints.commands,
            "payload": endpoints.payload,
            "telemetry": endpoints.telemetry,
            "payload_connect": self.payload_connect_endpoint,
            "pid": os.getpid(),
            "log": str(self.buslog.path),
            "run": self.buslog.run,
        }
        tmp = path.with_name(path.name + ".tmp")
        try:
            tmp.write_text(json.dumps(info))
            os.replace(tmp, path)
        except OSError as exc:  # the bus runs on; whoever waits for the file will say so
            _log.error("bus_ready_file_failed", path=str(path), error=str(exc))

    # ------------------------------------------------------------------ main loop

    def run(self) -> int:
        """Run until request_stop() (or the trace end with stop_at_end). Returns 0."""
        if not self._started:
            self.start()
        try:
            self.switch.prepare()  # a zygote imports the payload's libraries before time starts
        except PowerSwitchError as exc:
            self._switch_failed("prepare", exc)
            self._shutdown()
            raise
        # The ready file says "commands can come": only once the switch can power the payload, so
        # that a bus which cannot (a zygote that failed) is seen as one that never started.
        if self.config.ready_file:
            self._write_ready(Path(self.config.ready_file))
        # Trace time starts now, not when the sockets were bound.
        self.clock.t0 = self.buslog.restart_clock()
        try:
            while not self._stop.is_set():
                self._step()
        except BaseException as exc:
            self.stop_reason = f"error: {type(exc).__name__}: {exc}"
            _log.exception("bus_failed")
            raise
        finally:
            self._shutdown()
        return 0

    def _step(self) -> None:
        """One round of the main loop, each part in turn: the replay pacer, skip-idle, the trace's
        due actions, telemetry, the payload's health, power, forwarding; then packets until the
        next action is due (at most POLL_MAX_S)."""
        now = time.monotonic()
        if self.pacer is not None:
            self.pacer.step(self, now)
        if self.config.skip_idle:
            self._skip_idle(now)
            now = time.monotonic()
        self._run_due_actions(now)
        self._telemetry_tick(now)
        self._watch_payload(now)
        self._reconcile_power(now)
        self._forward()
        self._flush_store(now)
        self._retry_storage(now)
        self._housekeep_stations(now)
        timeout = self._next_due(time.monotonic())
        self._receive(timeout)

    def _limits(self) -> dict:
        """The stations' limits and the bounds of the store and the log, as the run log keeps them."""
        cfg = self.config
        return {
            "max_in_flight": cfg.max_in_flight,
            "station_quota": cfg.station_quota,
            "station_rate": cfg.station_rate,
            "station_burst": cfg.station_burst,
            "store_max_commands": cfg.store_max_commands,
            "store_max_bytes": cfg.store_max_bytes,
            "throttle_event_s": cfg.throttle_event_s,
            "log_segment_bytes": cfg.log_segment_bytes,
            "log_segments": cfg.log_segments,
        }

    def _receive(self, timeout_s: float) -> None:
        poller = zmq.Poller()
        poller.register(self.commands_sock, zmq.POLLIN)
        poller.register(self.payload_sock, zmq.POLLIN)
        poller.register(self.telemetry_sock, zmq.POLLIN)
        ready = dict(poller.poll(int(math.ceil(timeout_s * 1000))))
        # Telemetry subscriptions (XPUB): who listens, on which connection.
        for _ in range(64):
            if not (ready.get(self.telemetry_sock) or self.telemetry_sock.poll(0, zmq.POLLIN)):
                break
            ready.pop(self.telemetry_sock, None)
            subscription = recv_packet(self.telemetry_sock, timeout_s=0)
            if subscription is None:
                break
            self._on_subscription(subscription)
        # Bounded batches keep cuts on time while a ground floods the link.
        for _ in range(64):
            got = False
            if ready.get(self.payload_sock) or self.payload_sock.poll(0, zmq.POLLIN):
                received = recv_packet(self.payload_sock, timeout_s=0)
                if received is not None:
                    got = True
                    self._on_payload_packet(received)
            if ready.get(self.commands_sock) or self.commands_sock.poll(0, zmq.POLLIN):
                received = recv_packet(self.commands_sock, timeout_s=0)
                if received is not None:
                    got = True
                    self._on_ground_packet(received)
            ready = {}
            if not got:
                break
            if self.actions and time.monotonic() >= self.clock.at(self.actions[0].trace_s):
                break

    # ------------------------------------------------------------------ shutdown
    def _shutdown(self) -> None:
        if not self._started:
            self._close_sockets()
            return
        try:
            if self.switch.is_on():
                origin = "end" if self.stop_reason == "trace_end" else "shutdown"
                cause = PowerCause.TRACE if origin == "end" else PowerCause.COMMANDED
                self._power_off(cause, origin)
                if self.switch.is_on():  # the switch refused: one more try, then give up
                    self._power_off(cause, origin)
        finally:
            try:
                self.switch.close()  # drivers with helpers (a zygote) release them
            except PowerSwitchError as exc:
                _log.error("bus_power_switch_close_failed", error=str(exc))
            try:
                self._flush_store(time.monotonic(), force=True)
                self._housekeep_stations(time.monotonic(), final=True)
            finally:
                self.buslog.write(
                    bl.RUN_STOP, **self._stamp(), reason=self.stop_reason, stored_commands=len(self.store)
                )
                self.buslog.close()
                _log.info("bus_stopped", reason=self.stop_reason, stored_commands=len(self.store))
                self._close_sockets()

    def _close_sockets(self) -> None:
        for name in ("commands_sock", "payload_sock", "telemetry_sock"):
            sock = getattr(self, name, None)
            if sock is not None:
                sock.close(linger=200)
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the lock
            self._lock_fd = None
