"""`ow flight run` under an import recorder, for the boot-path tests: run as
`python import_probe.py RECORD <ow arguments>`.

A meta-path finder notes, for every module the process imports, the thread that first asked
for it. On each SIGUSR1 the probe appends one JSON line to RECORD: the modules in `sys.modules`
at that instant and, for each module imported since start, that thread's name. The tests send
the signal at the instants they check (a PING answered, the first unit of work reported), so
what is recorded is the real process's state there, not a reconstruction."""

from __future__ import annotations

import json
import os
import runpy
import signal
import sys
import threading

record_path = sys.argv[1]
first_thread: dict[str, str] = {}


class _Recorder:
    """Finds nothing (the real finders behind it do); it only remembers who asked first."""

    @staticmethod
    def find_spec(name, path=None, target=None):
        first_thread.setdefault(name, threading.current_thread().name)
        return None


def _dump(signum, frame) -> None:
    line = {"modules": sorted(sys.modules), "thread_of": dict(first_thread), "pid": os.getpid()}
    with open(record_path, "a") as f:
        f.write(json.dumps(line) + "\n")


sys.meta_path.insert(0, _Recorder())
signal.signal(signal.SIGUSR1, _dump)
sys.argv = ["ow", *sys.argv[2:]]
runpy.run_module("common.cli", run_name="__main__", alter_sys=True)
