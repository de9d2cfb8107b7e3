"""Real Ray nodes for the cluster tests (tests/hil/test_farm.py, tests/vla/test_vla_cluster.py):
waiting for a node to run, for a port to listen, and killing a node's whole process tree."""

import socket
import time

from bench.farm_bench import stop_node


def await_node(tmp, name, proc, relaunch):
    """Wait until a node runs. `ray start` gives a raylet 30 s (fixed) to register with the GCS; on
    a loaded machine that can pass, so a node that gave up is started again (3 tries in all)."""
    log = tmp / f"{name}.log"
    text = ""
    for _attempt in range(3):
        deadline = time.time() + 300
        while time.time() < deadline and proc.poll() is None:
            if "Ray runtime started" in log.read_text():
                return proc
            time.sleep(0.3)
        text = log.read_text()
        kill_tree(proc)
        if "timed out during startup" not in text:
            raise AssertionError(f"{name} node did not start (hang guard 300 s):\n{text[-3000:]}")
        proc = relaunch()
    raise AssertionError(f"{name} node timed out during startup three times:\n{text[-3000:]}")


def wait_listening(ip, port, proc, limit_s=240):
    deadline = time.time() + limit_s
    while time.time() < deadline and proc.poll() is None:
        with socket.socket() as s:
            if s.connect_ex((ip, port)) == 0:
                return
        time.sleep(0.3)


def kill_tree(proc):
    """SIGKILL a node: the `ray start` process and every process it started (a real crash)."""
    stop_node(proc)
