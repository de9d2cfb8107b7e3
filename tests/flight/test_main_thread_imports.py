"""The path that answers the bus stays light: the modules `ow flight run`'s main thread imports
before its first heartbeat (the command line, the logging, the onboard process) bring neither the
engine's libraries nor OrbitWeaver's recovery planner, the default since it is the product's own
(docs/flight.md "Boot"); both load on the worker thread, after the link is up."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# what flight/runtime/cli.py imports at module level and in cmd_run before FlightApp starts
_MAIN_THREAD = """
import json, sys
import common.cli, flight.runtime.cli
from common import log
import flight.runtime.app
heavy = ("torch", "transformers", "flight.recovery", "flight.recovery.optimal", "flight.engine")
print(json.dumps([name for name in heavy if name in sys.modules]))
"""


def test_the_main_thread_imports_neither_torch_nor_the_planner():
    out = subprocess.run(
        [sys.executable, "-c", _MAIN_THREAD],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": ROOT},
        timeout=120,
    )
    assert json.loads(out.stdout) == [], "imported on the path that answers PING"
