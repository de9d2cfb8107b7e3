"""A payload stand-in for the zygote tests, run as `python -m zygote_probe RECORD`.

It appends one JSON line describing what it finds in its own memory (a marker an earlier
payload would have left in a preloaded module, a module an earlier payload imported), its
process group and session, and when it started; then it leaves its own traces and sleeps until
it is cut."""

import json
import os
import sys
import time

import hil.bus.power  # preloaded by the zygote in the tests

record = sys.argv[1]
seen = {
    "pid": os.getpid(),
    "pgid": os.getpgid(0),
    "sid": os.getsid(0),
    "ppid": os.getppid(),
    "started_monotonic": time.monotonic(),
    "marker": getattr(hil.bus.power, "_zygote_probe_marker", None),
    "extra_module_loaded": "zygote_probe_extra" in sys.modules,
    "preloaded": "hil.bus.power" in sys.modules,
    "argv": sys.argv[1:],
}
hil.bus.power._zygote_probe_marker = os.getpid()  # type: ignore[attr-defined]  # an earlier payload's state, if it survived
import zygote_probe_extra  # noqa: E402,F401

with open(record, "a") as f:
    f.write(json.dumps(seen) + "\n")
time.sleep(600)
