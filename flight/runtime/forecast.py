"""What the ground's completion forecast needs from the payload: the power windows lived
through (WINDOW_HISTORY, from the window log) and what this payload measures of its own work
(PAYLOAD_PROFILE); also the checkpoint cadence's learned write costs, kept across boots
(flight/checkpoint/cadence.py, flight/runtime/profile.py)."""

from __future__ import annotations

import os
import threading
import time
from typing import Any

from common.durable import DurableFS
from common.wire import messages as m
from common.wire.text import clip_utf8
from flight.checkpoint.cadence import Cadence, WindowLog, WriteCosts
from flight.options import EngineOptions

from .config import DataPaths
from .outbox import Outbox
from .profile import WorkProfile, append_start
from .state import Latest, PersistentState

#: How long the command thread holds the boot's WINDOW_HISTORY for the main thread's first
#: HEARTBEAT (queued microseconds after the command thread starts).
HEARTBEAT_FIRST_WAIT_S = 5.0


class Forecast:
    """The window log, the work profile and the messages made of them."""

    def __init__(
        self,
        *,
        paths: DataPaths,
        fs: DurableFS,
        options: EngineOptions,
        model_dir: str,
        cadence: Cadence,
        state: PersistentState,
        outbox: Outbox,
        stop: threading.Event,
        started: float,
        log: Any,
    ):
        self.paths = paths
        self.fs = fs
        self.options = options
        self.model_dir = model_dir
        self.cadence = cadence
        self.state = state
        self.outbox = outbox
        self.stop = stop
        self.started = started
        self.log = log
        try:
            self.windows: WindowLog | None = WindowLog(paths.state, started=started)
        except OSError as exc:  # advice only (the adaptive cadence): never a reason not to boot
            log.warning("window_log_unavailable", error=str(exc))
            self.windows = None
        # What this payload measures of its own work, downlinked for the ground's completion
        # forecast (PAYLOAD_PROFILE, WINDOW_HISTORY; flight/runtime/profile.py).
        self.profile = WorkProfile(os.path.join(paths.state, "profile.json"))
        self.heartbeat_queued = threading.Event()  # the boot's HEARTBEAT goes before anything else
        # this boot's, sent again with each STATUS: written by the command thread, read by the main one
        self.window_history: Latest[m.WindowHistory | None] = Latest(None)

    def start_window_log(self) -> None:
        """Log the window the last boot lived through and keep this one's length on disk
        (command thread, at boot)."""
        if self.windows is None:
            return
        windows = self.windows
        try:
            lengths = windows.open(self.state.counters_now().boot_count)
            self.cadence.set_windows(lengths)
        except OSError as exc:  # the history is advice: without it the cadence is the fixed one
            self.log.warning("window_log_unavailable", error=str(exc))
            return
        self._send_window_history(lengths)
        costs = WriteCosts(windows.dir)
        try:
            learned = costs.load()
            self.cadence.learn_writes(learned)
            if learned:
                self.log.info("write_costs_loaded", **{f"{phase}_s": round(s, 6) for phase, s in learned.items()})
        except OSError as exc:  # advice too: the cadence measures its writes again
            self.log.warning("write_costs_unavailable", error=str(exc))
        if costs.damaged:
            self.log.warning("write_costs_ignored", path=costs.path, reason="not a valid entry")

        def keep_costs() -> None:
            costs.save(self.cadence.learned_writes())

        threading.Thread(
            target=windows.keep_marking, args=(self.stop, keep_costs), name="window-log", daemon=True
        ).start()

    def _send_window_history(self, lengths: list[float]) -> None:
        """WINDOW_HISTORY and PAYLOAD_PROFILE, at power-on (command thread, before any STATUS is
        answered): the windows lived through, each with its start on this payload's clock."""
        path = os.path.join(self.paths.state, "window-starts.log")
        try:
            starts = append_start(self.fs, path, time.time() - (time.monotonic() - self.started))
        except OSError as exc:  # advice only: the ground says it cannot forecast
            self.log.warning("window_starts_unavailable", error=str(exc))
            return
        # lengths are of the ended windows, oldest first; the newest start is this window's
        paired = min(len(lengths), len(starts) - 1)
        self.heartbeat_queued.wait(HEARTBEAT_FIRST_WAIT_S)
        history = m.WindowHistory(
            boot_count=self.state.counters_now().boot_count,
            starts=starts[len(starts) - 1 - paired :],
            lengths=lengths[len(lengths) - paired :] if paired else [],
        )
        self.window_history.set(history)
        self.outbox.send(history)
        self.send_profile(save=False)

    def messages(self) -> list[m.Message]:
        """WINDOW_HISTORY (once this boot has logged its window) and PAYLOAD_PROFILE, from memory:
        sent before the HOUSEKEEPING that answers STATUS, so that a ground that was not listening
        at power-on still gets the forecast's inputs (main thread: no disk)."""
        history = self.window_history.get()
        return ([history] if history is not None else []) + [self.profile_message()]

    def save_profile(self) -> None:
        """Keep what was measured (command thread)."""
        try:
            self.profile.save(self.fs)
        except OSError as exc:  # advice only: measured again
            self.log.warning("profile_unsaved", error=str(exc))

    def send_profile(self, save: bool = True) -> None:
        """PAYLOAD_PROFILE (at power-on and after each task; command thread: it saves first)."""
        if save:
            self.save_profile()
        self.outbox.send(self.profile_message())

    def profile_message(self) -> m.PayloadProfile:
        geometry = self.options.geometry
        return m.PayloadProfile(
            model=clip_utf8(os.path.basename(os.path.normpath(self.model_dir)) if self.model_dir else "", 128),
            policy=self.options.policy,
            cadence=self.cadence.mode,
            durable_every={"vision": geometry.vision_every, "prefill": 1, "decode": geometry.decode_every},
            **self.profile.fields(),
        )


__all__ = ["Forecast", "HEARTBEAT_FIRST_WAIT_S"]
