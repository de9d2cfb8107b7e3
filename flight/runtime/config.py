"""The payload process's settings (`FlightConfig`, what `ow flight run` decides) and where its
data lives on disk (`DataPaths`).

Both are frozen: every part of the process reads them, none changes them, so they are shared
between threads without a lock.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from common.durable import DurableFS
from flight.options import EngineOptions

from .storage import DEFAULT_RESERVE_BYTES


@dataclass(frozen=True)
class FlightConfig:
    """What one payload process is told at its start (flight/runtime/cli.py builds it from the
    command line; tests and the red team build it directly)."""

    data_dir: str
    model_dir: str
    keys_dir: str
    endpoint: str  # the bus's payload endpoint (ZeroMQ DEALER connects to it)
    engine_options: EngineOptions | None = None  # None: the engine's defaults
    device: str | None = None
    dtype: str | None = None
    #: the data disk's file layer (None: a plain DurableFS) ...
    fs: DurableFS | None = None
    #: ... and the one the checkpoint records go through (None: the same as `fs`); a testbench
    #: that emulates the target's storage charges them apart (flight/cli_options.data_storage_for)
    checkpoint_fs: DurableFS | None = None
    weight_read_hook: Callable[[int], Any] | None = None  # told of each weight read (a throttle)
    results_budget_bytes: int | None = None  # the result store's retention budget (None: keep all)
    compact_after: int | None = None  # queue journal records between compactions (None: the default)
    storage_reserve_bytes: int = DEFAULT_RESERVE_BYTES

    def options(self) -> EngineOptions:
        """The engine options in force (the defaults when none were given)."""
        return self.engine_options if self.engine_options is not None else EngineOptions()


@dataclass(frozen=True)
class DataPaths:
    """Where the payload keeps what must survive a power cut, under one data directory (docs/flight.md)."""

    root: str  # absolute

    @classmethod
    def under(cls, data_dir: str) -> DataPaths:
        return cls(os.path.abspath(data_dir))

    def join(self, *parts: str) -> str:
        return os.path.join(self.root, *parts)

    @property
    def state(self) -> str:
        return self.join("state")

    @property
    def tasks(self) -> str:
        return self.join("tasks")

    def task_dir(self, task_id: str) -> str:
        """A task's checkpoints and stored inputs (removed once it has finished durably)."""
        return os.path.join(self.tasks, task_id)

    def inputs_path(self, task_id: str) -> str:
        return os.path.join(self.task_dir(task_id), "inputs.rec")


__all__ = ["DataPaths", "FlightConfig"]
