"""`Bus`: the parts composed, and its life: `start()` locks the data directory, binds the three
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
from collections import Counter, OrderedDict
from collections.abc import Sequence
from pathlib import Path

import zmq

import traces
from common import log, machine
from common.wire import EventId, PowerCause, decode
from common.wire import messages as m
from common.wire.link import Endpoints, KeyLayout, recv_packet
from hil.bus import buslog as bl
from hil.bus.base import BusIO, FdirChannels, GroundExchanges, Pacer, PayloadLink, StopRequest
from hil.bus.busstore import CommandStore
from hil.bus.clock import TraceClock
from hil.bus.config import BusConfig, BusConfigError
from hil.bus.power import PowerSwitch, PowerSwitchError
from hil.bus.power_fdir import PowerFdir
from hil.bus.relay import Relay
from hil.bus.routing import Routing
from hil.bus.stations import Stations
from hil.bus.storage import StorageWatch, TolerantSequenceCounter
from hil.bus.telemetry import Telemetry
from hil.bus.timeline import Timeline

_log = log.get("hil.bus")


def machine_fingerprint() -> dict:
    """What decides the bits of a CPU inference: processor model, core count, library versions.
    A replay on another fingerprint cannot expect identical logits."""
    return {"cpu": machine.cpu_model(), "cpus": machine.cpu_count(), **machine.library_versions()}


class Bus:
    """The mock spacecraft bus. Not thread-safe: one thread calls start() and run(); any thread
    may call request_stop().

    A small object that owns what the parts share (configuration, trace, clock, the payload
    link, FDIR's channels, the stop, the bus's disk watch and its I/O: hil/bus/base.py) and the
    parts, each handed only what it uses: telemetry, power and FDIR, the timeline, routing, the
    stations, the relay (docs/bus.md "Where things are"). The main loop (`_step`) calls each part
    in turn through its public methods."""

    def __init__(self, config: BusConfig, switch: PowerSwitch | None = None, pacer: Pacer | None = None):
        config.validate()
        if config.hold_for_connect and pacer is not None:
            raise BusConfigError("hold_for_connect and a pacer would both hold the trace clock; use one")
        self.config = config
        self.pacer = pacer
        self.data_dir = Path(config.data_dir)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.layout = KeyLayout(Path(config.keys_dir))
        if not self.layout.server_secret.exists():
            raise BusConfigError(f"no bus key pair in {self.layout.server_dir} (run `ow ground keys init`)")
        try:
            self.trace = traces.load(config.trace)
        except (ValueError, OSError) as exc:  # TraceError is a ValueError
            raise BusConfigError(f"trace {config.trace}: {exc}") from None
        if config.start_at_s > self.trace.duration_s:
            raise BusConfigError(f"--start-at {config.start_at_s} is after the trace's end ({self.trace.duration_s} s)")
        self._switch_override = switch
        self.endpoints: Endpoints | None = None
        self.payload_connect_endpoint: str | None = None
        self._stop = StopRequest()
        #: trace time; its t0 is set when the run log opens, and again when the run starts
        self.clock = TraceClock(config.time_scale, config.start_at_s)
        self.link = PayloadLink()
        self.fdir = FdirChannels()
        #: the ground's exchanges with the payload, for skip-idle
        self.exchanges = GroundExchanges()
        self.io = BusIO(self.clock, self.link)
        #: the bus's own disk: which writers fail (docs/bus.md "The bus's own disk")
        self.storage = StorageWatch(self._storage_changed)
        # the parts, each with what it uses
        self.telemetry = Telemetry(config, self.trace, self.clock, self.io, self.fdir)
        self.power = PowerFdir(
            config, self.trace, self.clock, self.io, self.link, self.fdir, self.telemetry, self._stop
        )
        self.timeline = Timeline(
            config, self.trace, self.clock, self.io, self.link, self.power, self.telemetry, self._stop, self.exchanges
        )
        self.routing = Routing(self.io, self.exchanges)
        self.stations = Stations(config, self.io, self.routing)
        self.relay = Relay(
            config,
            self.clock,
            self.io,
            self.link,
            self.fdir,
            self.storage,
            self.power,
            self.timeline,
            self.routing,
            self.stations,
            self.exchanges,
            on_payload_message=self._pace_message if pacer is not None else None,
        )
        if switch is None:
            self.power.payload_argv(payload_endpoint="tcp://127.0.0.1:0")  # placeholders check out before binding
        self._started = False
        self._lock_fd: int | None = None
        self.ready = threading.Event()

    # ------------------------------------------------------------------ what callers read
    # (replays' pacers, the testbench, tests): the shared state and the parts' public state
    @property
    def stop_reason(self) -> str:
        return self._stop.reason

    @property
    def switch(self) -> PowerSwitch:
        return self.io.switch

    @property
    def store(self) -> CommandStore:
        return self.io.store

    @property
    def buslog(self) -> bl.BusLog:
        return self.io.buslog

    @property
    def payload_rid(self) -> bytes | None:
        return self.link.payload_rid

    @property
    def power_count(self) -> int:
        return self.power.power_count

    @property
    def connections(self) -> dict[str, OrderedDict]:
        return self.stations.connections

    @property
    def refusals(self) -> Counter:
        return self.stations.refusals

    def payload_argv(self, template: Sequence[str] | None = None, payload_endpoint: str | None = None) -> list[str]:
        """The flight process's command line (for the ssh driver: the remote one)."""
        return self.power.payload_argv(template, payload_endpoint)

    def retry_payload(self, origin: str, **fields) -> bool:
        """End the boot-loop guard's hold (docs/bus.md §6); False if nothing was held."""
        return self.power.retry_payload(origin, **fields)

    def request_stop(self, reason: str = "requested") -> None:
        self._stop.request(reason)

    def _storage_changed(self, failing: bool, detail: str) -> None:
        if failing:
            condition = self.storage.condition or "error"
            self.io.bus_event(
                EventId.BUS_STORAGE_FULL,
                f"bus storage {condition} ({detail}): what the bus cannot store is refused (BUS_STORAGE_FULL) "
                "or held in memory until the disk takes writes again; stored commands are still relayed",
                condition=condition,
            )
        else:
            self.io.bus_event(EventId.BUS_STORAGE_RESTORED, f"bus storage writable again {detail}")

    def _pace_message(self, message: m.Message, now: float) -> None:
        assert self.pacer is not None  # only handed to the relay with a pacer
        self.pacer.payload_message(self, message, now)

    # ------------------------------------------------------------------ set-up
    def start(self) -> Endpoints:
        """Bind the sockets and open the store and the run log. Returns the bound endpoints."""
        cfg = self.config
        self._lock_data_dir()
        try:
            store = CommandStore(self.data_dir / "bus-store")
            if store.open_error is not None:
                self.storage.failed("command store", store.open_error)
            self.io.open_store(
                store,
                TolerantSequenceCounter(self.data_dir / "state" / "bus-tm-sequence.bin", self.storage, reserve=1024),
            )
            endpoints = self.io.bind(self.layout, cfg.endpoints)
            self.endpoints = endpoints
            self.payload_connect_endpoint = cfg.payload_connect_endpoint or endpoints.payload
            self._open(cfg, endpoints)
        except BaseException:
            self._close()
            raise
        self._started = True
        self.ready.set()
        return endpoints

    def _open(self, cfg: BusConfig, endpoints: Endpoints) -> None:
        assert self.payload_connect_endpoint is not None  # set by start() from the bound endpoints
        switch = self._switch_override or self.power.build_switch(self.payload_connect_endpoint)
        self.io.attach_switch(switch)
        buslog = bl.BusLog(
            self.data_dir / bl.LOG_FILE,
            segment_bytes=cfg.log_segment_bytes,
            segments=cfg.log_segments,
            listener=self.storage,
        )
        self.io.open_log(buslog)
        self.clock.t0 = buslog.started_monotonic
        store = self.io.store
        # Commands stored by an earlier run: their answers go to the station's new connection.
        for entry in store.pending():
            self.routing.expect_replies(entry.request, decode(entry.packet)[1])
        buslog.write(
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
            switch=switch.describe(),
            heartbeat_timeout_s=cfg.heartbeat_timeout_s,
            boot_timeout_s=cfg.boot_timeout_s,
            fdir_off_s=cfg.fdir_off_s,
            boot_loop_limit=cfg.boot_loop_limit,
            boot_loop_backoff_s=cfg.boot_loop_backoff_s,
            boot_settle_s=cfg.boot_settle_s,
            stored_commands=len(store),
            bus_pid=os.getpid(),
            model=cfg.model,
            flight_args=list(cfg.flight_args),
            machine=machine_fingerprint(),
            boot_trace_s=cfg.boot_trace_s,
            skip_idle=cfg.skip_idle,
            hold_for_connect=cfg.hold_for_connect,
            limits=self._limits(),
        )
        self.io.publish_early_events()
        self.stations.check_keys(time.monotonic())  # what authorized/ holds now (and drops a revoked key's commands)
        _log.info(
            "bus_started",
            trace=self.trace.name,
            time_scale=cfg.time_scale,
            start_at_s=cfg.start_at_s,
            commands=endpoints.commands,
            payload=endpoints.payload,
            telemetry=endpoints.telemetry,
            stored_commands=len(store),
            driver=switch.driver,
        )
        try:
            switch.reset()
        except PowerSwitchError as exc:
            self.power.switch_failed("reset", exc)

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
            "log": str(self.io.buslog.path),
            "run": self.io.buslog.run,
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
            self.io.switch.prepare()  # a zygote imports the payload's libraries before time starts
        except PowerSwitchError as exc:
            self.power.switch_failed("prepare", exc)
            self._shutdown()
            raise
        # The ready file says "commands can come": only once the switch can power the payload, so
        # that a bus which cannot (a zygote that failed) is seen as one that never started.
        if self.config.ready_file:
            self._write_ready(Path(self.config.ready_file))
        # Trace time starts now, not when the sockets were bound.
        self.clock.t0 = self.io.buslog.restart_clock()
        try:
            while not self._stop.is_set():
                self._step()
        except BaseException as exc:
            self._stop.reason = f"error: {type(exc).__name__}: {exc}"
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
            self.timeline.skip_idle(now)
            now = time.monotonic()
        self.timeline.run_due(now)
        self.telemetry.tick(now)
        self.power.watch(now)
        self.power.reconcile(now)
        self.relay.forward()
        self.relay.flush_store(now)
        self.relay.retry_storage(now)
        self.stations.housekeep(now)
        timeout = self.timeline.next_due(time.monotonic())
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
        io = self.io
        commands_sock, payload_sock, telemetry_sock = io.commands_sock, io.payload_sock, io.telemetry_sock
        poller = zmq.Poller()
        poller.register(commands_sock, zmq.POLLIN)
        poller.register(payload_sock, zmq.POLLIN)
        poller.register(telemetry_sock, zmq.POLLIN)
        ready = dict(poller.poll(int(math.ceil(timeout_s * 1000))))
        # Telemetry subscriptions (XPUB): who listens, on which connection.
        for _ in range(64):
            if not (ready.get(telemetry_sock) or telemetry_sock.poll(0, zmq.POLLIN)):
                break
            ready.pop(telemetry_sock, None)
            subscription = recv_packet(telemetry_sock, timeout_s=0)
            if subscription is None:
                break
            self.stations.on_subscription(subscription)
        # Bounded batches keep cuts on time while a ground floods the link.
        for _ in range(64):
            got = False
            if ready.get(payload_sock) or payload_sock.poll(0, zmq.POLLIN):
                received = recv_packet(payload_sock, timeout_s=0)
                if received is not None:
                    got = True
                    self.relay.on_payload_packet(received)
            if ready.get(commands_sock) or commands_sock.poll(0, zmq.POLLIN):
                received = recv_packet(commands_sock, timeout_s=0)
                if received is not None:
                    got = True
                    self.relay.on_ground_packet(received)
            ready = {}
            if not got:
                break
            actions = self.timeline.actions
            if actions and time.monotonic() >= self.clock.at(actions[0].trace_s):
                break

    # ------------------------------------------------------------------ shutdown
    def _shutdown(self) -> None:
        if not self._started:
            self._close()
            return
        switch = self.io.switch
        try:
            if switch.is_on():
                origin = "end" if self.stop_reason == "trace_end" else "shutdown"
                cause = PowerCause.TRACE if origin == "end" else PowerCause.COMMANDED
                self.power.power_off(cause, origin)
                if switch.is_on():  # the switch refused: one more try, then give up
                    self.power.power_off(cause, origin)
        finally:
            try:
                switch.close()  # drivers with helpers (a zygote) release them
            except PowerSwitchError as exc:
                _log.error("bus_power_switch_close_failed", error=str(exc))
            try:
                self.relay.flush_store(time.monotonic(), force=True)
                self.stations.housekeep(time.monotonic(), final=True)
            finally:
                store = self.io.store
                self.io.buslog.write(
                    bl.RUN_STOP, **self.io.stamp(), reason=self.stop_reason, stored_commands=len(store)
                )
                _log.info("bus_stopped", reason=self.stop_reason, stored_commands=len(store))
                self._close()

    def _close(self) -> None:
        """The run log, the sockets (BusIO.close), then the data directory's lock."""
        self.io.close()
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the lock
            self._lock_fd = None
