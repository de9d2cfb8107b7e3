"""A pre-loaded fork server (zygote) for the local power switch: boot emulated, RAM still lost.

On a real payload a power-on costs the target's boot (firmware, kernel, services, then the
interpreter importing torch and transformers) in real seconds. On this machine the interpreter's
imports alone take seconds of wall time, and when the testbench compresses trace time that wall
time is magnified: at 0.111 wall s per trace s a 4 s import is 36 trace seconds, longer than
most of trace-a's windows. The zygote takes the import cost out of the window without taking
the power cut's consequences away:

    bus ── socketpair ── zygote (imports the payload's libraries once, stays single-threaded)
                           │ fork() at every power-on
                           ▼
                         payload (own session and process group, stdio to the payload log):
                           waits out the emulated boot, then runs `ow flight run` as `python -m` would

The zygote runs outside the payload's power domain (a cut SIGKILLs the payload's process group,
never the zygote). A payload forked from it holds the zygote's imported modules and nothing
else: it never saw a previous payload's memory (a fork copies the zygote, which never runs
payload code), so everything it resumes -- queue, checkpoints, weights -- it reads from disk.
The emulated boot is the wait: `boot_deadline` is the power-on instant plus the target's boot
time scaled like the compute (docs/hil.md).

Requests are JSON objects over a SOCK_SEQPACKET socketpair (one message per request):

    {"op": "spawn", "argv": [...], "env": {...}, "cwd": DIR, "output": LOG, "boot_deadline": MONOTONIC}
        -> {"pid": N}       the payload's pid, which is also its process group and session id
    {"op": "reap", "pid": N, "block": bool}
        -> {"status": S}    exit status as subprocess reports it (-signal when killed), or null
                            while it runs (block=false)

Only the zygote can reap its children, so the bus kills a payload's group itself (the cut must
not wait for anybody) and then asks for the status.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib
import json
import os
import random
import runpy
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

#: What the flight payload's boot image holds: the modules `ow flight run` imports before its
#: first unit of inference work (flight/runtime/preload.py lists them).
FLIGHT_PRELOAD = ("flight.runtime.preload:boot_image",)

#: How the bus starts a zygote. Not `python -m hil.bus.zygote`: the package `hil.bus` imports this
#: module (through its power switch), so runpy would execute a second copy of it as `__main__`.
SERVER_MAIN = "import sys; from hil.bus.zygote import main; sys.exit(main(sys.argv[1:]))"
_MAX_MESSAGE = 1 << 20
_PR_SET_PDEATHSIG = 1


_prctl: Any
try:
    _prctl = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):  # not Linux: no parent-death signal
    _prctl = None


class ZygoteError(RuntimeError):
    """The zygote could not start, or could not fork a payload."""


def die_with_parent() -> None:
    """Runs in a forked child before exec: SIGKILL it when the thread that spawned it exits, so a
    bus (or zygote) that is itself killed never leaves a powered payload behind (a restarted bus
    would otherwise start a second flight process on the same data directory)."""
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def thread_count() -> int:
    """Threads of this process as the kernel sees them (native ones included)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:  # not Linux: only what Python knows
        return threading.active_count()


def _exit_status(status: int) -> int:
    """waitpid status -> subprocess convention (negative signal number when killed)."""
    if os.WIFSIGNALED(status):
        return -os.WTERMSIG(status)
    return os.WEXITSTATUS(status)


# ---------------------------------------------------------------------------- the payload child


def _die_with(parent_pid: int) -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent_pid:  # the zygote died between fork and prctl
        os._exit(1)


def _redirect_stdio(output: str | None) -> None:
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    if output:
        out = os.open(output, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    else:
        out = devnull
    os.dup2(out, 1)
    os.dup2(out, 2)
    for fd in {devnull, out}:
        if fd > 2:
            os.close(fd)


def _fresh_process_state() -> None:
    """What a fresh interpreter would not share with its siblings: random seeds."""

    random.seed()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()


def _run_as_main(argv: Sequence[str]) -> int:
    """Run `python -m MODULE ARGS` in this (forked) interpreter; anything else is exec'd."""
    same_python = os.path.realpath(argv[0]) == os.path.realpath(sys.executable)
    if not (same_python and len(argv) >= 3 and argv[1] == "-m"):
        os.execv(argv[0], list(argv))  # a command the zygote cannot run in-process: a real exec

    sys.argv = [argv[2], *argv[3:]]
    try:
        runpy.run_module(argv[2], run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        code = exc.code
        if code is None:
            return 0
        if isinstance(code, int):
            return code
        print(code, file=sys.stderr)
        return 1
    return 0


def _payload_main(request: dict, zygote_pid: int, control: socket.socket, started_fd: int) -> None:
    """The forked payload: never returns."""
    code = 1
    try:
        os.setsid()  # own session and process group: the bus's killpg reaches all of it
        os.write(started_fd, b"1")  # only now does the zygote hand out the pid (a cut may follow at once)
        os.close(started_fd)
        _die_with(zygote_pid)
        control.close()
        _redirect_stdio(request.get("output"))
        os.environ.clear()
        os.environ.update(request.get("env") or {})
        if request.get("cwd"):
            os.chdir(request["cwd"])
        _fresh_process_state()
        # The emulated boot: firmware, kernel, services and the interpreter's imports on the
        # target take this long after power-on (docs/hil.md); the imports themselves are done.
        delay = float(request.get("boot_deadline") or 0.0) - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        code = _run_as_main(request["argv"])
    except BaseException:  # report, never fall back into the zygote's loop
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code)


# ---------------------------------------------------------------------------- the server


def _handle(request: dict, control: socket.socket) -> dict:
    op = request.get("op")
    if op == "spawn":
        threads = thread_count()
        if threads != 1:
            # A fork copies only the calling thread; locks another thread held stay locked forever
            # in the child (an intra-op pool started by torch, for instance).
            return {"error": f"zygote is not single-threaded ({threads} threads); refusing to fork"}
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        started_r, started_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(started_r)
            _payload_main(request, os.getppid(), control, started_w)
        os.close(started_w)
        try:
            os.read(started_r, 1)  # the child leads its own process group from here on
        finally:
            os.close(started_r)
        return {"pid": pid}
    if op == "reap":
        pid = int(request["pid"])
        try:
            done, status = os.waitpid(pid, 0 if request.get("block") else os.WNOHANG)
        except ChildProcessError:
            return {"error": f"no child {pid}"}
        return {"status": _exit_status(status) if done == pid else None}
    return {"error": f"unknown op {op!r}"}


def serve(fd: int, preload: Sequence[str]) -> int:
    control = socket.socket(fileno=fd)
    started = time.perf_counter()
    for entry in preload:  # "module" or "module:function" (called once imported)
        name, _, function = entry.partition(":")
        module = importlib.import_module(name)
        if function:
            getattr(module, function)()
    ready: dict[str, Any] = {
        "ready": True,
        "pid": os.getpid(),
        "import_s": round(time.perf_counter() - started, 3),
        "threads": thread_count(),
        "modules": len(sys.modules),
        "preload": list(preload),
    }
    if ready["threads"] != 1:
        ready = {
            "error": f"preloading {list(preload)} started {ready['threads'] - 1} thread(s); a zygote "
            "must stay single-threaded to fork safely"
        }
    control.send(json.dumps(ready).encode())
    if "error" in ready:
        return 1
    while True:
        try:
            data = control.recv(_MAX_MESSAGE)
        except OSError:
            return 0
        if not data:  # the bus is gone
            return 0
        request = {}
        try:
            request = json.loads(data)
            reply = _handle(request, control)
        except Exception as exc:  # a bad request must not end the zygote
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        reply["id"] = request.get("id")
        control.send(json.dumps(reply).encode())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="hil.bus.zygote", description="Fork server for the local power switch (started by the bus)."
    )
    parser.add_argument("--fd", type=int, required=True, help="the control socket's file descriptor")
    parser.add_argument("preload", nargs="*", help="modules to import before serving (MODULE or MODULE:FUNCTION)")
    args = parser.parse_args(argv)
    code = serve(args.fd, args.preload)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # no interpreter teardown of the preloaded libraries: the bus waits for this


# ---------------------------------------------------------------------------- the bus's side


class Zygote:
    """The bus's handle on a zygote process. Thread-safe; start() does not wait for the imports,
    wait_ready() does (the bus calls it before its trace clock starts)."""

    def __init__(
        self,
        preload: Sequence[str] = FLIGHT_PRELOAD,
        *,
        log_path: str | os.PathLike | None = None,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        python: str | None = None,
    ):
        self.preload = list(preload)
        self.log_path = Path(log_path) if log_path else None
        self.env = dict(os.environ if env is None else env)
        self.env["PYTHONUNBUFFERED"] = "1"  # payloads inherit its stdio objects: no lost log lines
        # Without a thread count, importing torch starts an OpenMP pool thread, and a zygote must
        # stay single-threaded to fork. Each payload still sets its own (`--threads`) after the fork.
        self.env.setdefault("OMP_NUM_THREADS", "1")
        self.cwd = cwd
        self.python = python or sys.executable
        self.proc: subprocess.Popen | None = None
        self.info: dict | None = None
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        self._next_id = 0

    def start(self) -> Zygote:
        if self.proc is not None:
            return self
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        out: Any = subprocess.DEVNULL  # or the log file, closed below
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            out = open(self.log_path, "ab")
        try:
            self.proc = subprocess.Popen(
                [self.python, "-c", SERVER_MAIN, "--fd", str(theirs.fileno()), *self.preload],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=self.env,
                cwd=self.cwd,
                pass_fds=(theirs.fileno(),),
                start_new_session=True,
                preexec_fn=die_with_parent,
            )
        except OSError as exc:
            ours.close()
            raise ZygoteError(f"cannot start the zygote: {exc}") from exc
        finally:
            theirs.close()
            if out is not subprocess.DEVNULL:
                out.close()
        self._sock = ours
        return self

    def wait_ready(self, timeout_s: float = 300.0) -> dict:
        """Block until the zygote has imported its preload (returns its report)."""
        with self._lock:
            if self.info is not None:
                return self.info
            if self.proc is None:
                self.start()
            sock, proc = self._sock, self.proc
            assert sock is not None and proc is not None  # start() set both
            sock.settimeout(timeout_s)
            try:
                data = sock.recv(_MAX_MESSAGE)
            except (TimeoutError, OSError) as exc:
                raise ZygoteError(f"zygote not ready within {timeout_s:g} s: {exc}") from None
            finally:
                sock.settimeout(None)
            if not data:
                raise ZygoteError(
                    f"zygote exited with {proc.wait()} before it was ready (see {self.log_path or 'its output'})"
                )
            info = json.loads(data)
            if "error" in info:
                raise ZygoteError(info["error"])
            self.info = info
            return info

    def _request(self, timeout_s: float = 30.0, **request) -> dict:
        self.wait_ready()
        with self._lock:
            self._next_id += 1
            request["id"] = self._next_id
            deadline = time.monotonic() + timeout_s
            sock = self._sock
            assert sock is not None  # wait_ready() started the zygote
            try:
                sock.sendall(json.dumps(request).encode())
                while True:  # replies to requests that timed out earlier are skipped
                    sock.settimeout(max(0.001, deadline - time.monotonic()))
                    data = sock.recv(_MAX_MESSAGE)
                    if not data:
                        raise ZygoteError("the zygote has exited")
                    reply = json.loads(data)
                    if reply.get("id") == request["id"]:
                        break
            except OSError as exc:
                raise ZygoteError(f"zygote link: {exc}") from None
            finally:
                if self._sock is not None:
                    self._sock.settimeout(None)
        if "error" in reply:
            raise ZygoteError(reply["error"])
        return reply

    def spawn(
        self,
        argv: Sequence[str],
        *,
        output: str | os.PathLike | None = None,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        boot_deadline: float = 0.0,
    ) -> int:
        """Fork a payload that runs `argv` once `boot_deadline` (time.monotonic) has passed."""
        env = dict(self.env if env is None else env)
        env.setdefault("PYTHONUNBUFFERED", "1")
        return int(
            self._request(
                op="spawn",
                argv=list(argv),
                env=env,
                cwd=cwd or self.cwd,
                output=str(output) if output else None,
                boot_deadline=boot_deadline,
            )["pid"]
        )

    def reap(self, pid: int, block: bool, timeout_s: float = 30.0) -> int | None:
        return self._request(timeout_s=timeout_s, op="reap", pid=pid, block=block)["status"]

    def close(self) -> None:
        with self._lock:
            if self._sock is not None:
                self._sock.close()  # the zygote sees EOF and exits
                self._sock = None
            if self.proc is not None:
                try:
                    self.proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
                self.proc = None

    def describe(self) -> dict:
        return {
            "preload": self.preload,
            "pid": self.proc.pid if self.proc else None,
            "import_s": (self.info or {}).get("import_s"),
        }


if __name__ == "__main__":
    sys.exit(main())
