"""Power-switch drivers of the mock spacecraft bus: what "payload on" and "payload off" mean.

One interface, three drivers (docs/bus.md §3):

    LocalProcessSwitch   the payload is a child process of the bus, in its own process group;
                         off = SIGKILL of the whole group (RAM gone, no chance to clean up).
    SshSwitch            the payload runs on a board reached over SSH (a Jetson on a bench);
                         on = an SSH session that execs the flight process; off = a remote
                         SIGKILL of its process group, or a forced reboot of the board.
    CommandSwitch        operator-given shell commands that drive a relay or a networked PDU;
                         the board boots the flight process by itself when powered.

A switch reports failures (PowerSwitchError) and never pretends an action worked: the bus
retries a failed action and raises an FDIR fault.
"""

from __future__ import annotations

import os
import secrets
import shlex
import signal
import subprocess
import tempfile
import time
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from common import log
from hil.bus.zygote import ZygoteError, die_with_parent

_log = log.get("hil.bus.power")

#: How long a driver's shell command (ssh kill, relay command) may take before it counts as failed.
COMMAND_TIMEOUT_S = 30.0
#: ssh exits with 255 when the connection itself failed (host down, rebooting, refused key).
SSH_TRANSPORT_FAILURE = 255


class PowerSwitchError(RuntimeError):
    """A switch action failed: the payload's power state is not what was asked."""


class PowerSwitch(ABC):
    """The payload's power switch. `off` is a cut: no warning, no clean shutdown."""

    #: driver name as given to `--power-driver`
    driver = "abstract"

    @abstractmethod
    def on(self) -> None:
        """Power the payload: a fresh flight process starts (RAM empty)."""

    @abstractmethod
    def off(self, cause: str) -> None:
        """Cut the payload's power now. Raises PowerSwitchError if it could not."""

    @abstractmethod
    def is_on(self) -> bool:
        """Whether the switch is closed (the payload is powered)."""

    @property
    def pid(self) -> int | None:
        """Local process id of the payload (or of its SSH session), when there is one."""
        return None

    def poll(self) -> int | None:
        """Called by the bus about every 100 ms while powered. Returns the exit status when the
        payload process ended by itself (crash, exit) while the switch was on, else None."""
        return None

    def reset(self) -> None:  # noqa: B027 - an optional hook: doing nothing is the right default
        """Make sure nothing is left powered from a previous bus run (called once at start)."""

    def prepare(self, timeout_s: float = 600.0) -> None:  # noqa: B027 - optional hook, no-op by default
        """Get ready to power the payload without delay (called once before the trace clock
        starts; the local driver's zygote imports the payload's libraries here)."""

    @abstractmethod
    def describe(self) -> dict:
        """What this switch is, for logs (no secrets)."""

    def close(self) -> None:
        """Bus shutdown: cut the payload (cause `commanded`)."""
        if self.is_on():
            self.off("commanded")


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class _ChildSession:
    """A local child process started in its own process group (session), whose output goes to
    a log file. Shared by the local driver (the flight process itself) and the SSH driver (the
    ssh client that runs it remotely)."""

    def __init__(self, argv: Sequence[str], output_path: Path | None, env: Mapping[str, str] | None, cwd: str | None):
        self.argv = list(argv)
        self.output_path = output_path
        self.env = dict(env) if env is not None else None
        self.cwd = cwd
        self.proc: subprocess.Popen | None = None
        self.exit_status: int | None = None

    def start(self, banner: str) -> int:
        out: Any = subprocess.DEVNULL  # or the output file
        handle = None
        if self.output_path is not None:
            try:
                self.output_path.parent.mkdir(parents=True, exist_ok=True)
                handle = open(self.output_path, "ab")
                handle.write(f"\n==== {banner} {time.strftime('%Y-%m-%dT%H:%M:%S')} ====\n".encode())
                handle.flush()
                out = handle
            except OSError as exc:
                # The bus's disk is full or read-only: power the payload all the same, its
                # output unkept (docs/bus.md "The bus's own disk").
                _log.error("power_switch_output_unavailable", path=str(self.output_path), error=str(exc))
                if handle is not None:
                    try:
                        handle.close()
                    except OSError:
                        pass
                handle, out = None, subprocess.DEVNULL
        env = dict(os.environ if self.env is None else self.env)
        env.setdefault("PYTHONUNBUFFERED", "1")
        try:
            self.proc = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=self.cwd,
                start_new_session=True,  # own session and process group: killpg reaches all of it
                preexec_fn=die_with_parent,
                close_fds=True,
            )
        except OSError as exc:
            raise PowerSwitchError(f"cannot start {self.argv[0]!r}: {exc}") from exc
        finally:
            if handle is not None:
                handle.close()
        self.exit_status = None
        return self.proc.pid

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def kill(self) -> int | None:
        """SIGKILL the whole process group and reap the leader. Returns its exit status."""
        proc = self.proc
        if proc is None:
            return None
        _kill_group(proc.pid)
        try:
            status = proc.wait(timeout=10)
        except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL cannot be ignored
            raise PowerSwitchError(f"process {proc.pid} survived SIGKILL for 10 s") from None
        # A member that left the group leader behind (double fork) is still in the group.
        _kill_group(proc.pid)
        self.proc = None
        return status

    def exited(self) -> int | None:
        if self.proc is None:
            return None
        status = self.proc.poll()
        if status is not None:
            # Members of the group outlive their leader only as orphans of a dead payload.
            _kill_group(self.proc.pid)
            self.exit_status = status
            self.proc = None
        return status


class _ForkedSession:
    """A payload forked by a zygote (hil/bus/zygote.py) in its own session and process group, with
    the same interface as _ChildSession. The zygote is its parent, so the zygote reaps it; a cut
    is still this process's immediate killpg(SIGKILL)."""

    def __init__(
        self,
        zygote,
        argv: Sequence[str],
        output_path: Path | None,
        env: Mapping[str, str] | None,
        cwd: str | None,
        boot_s: float,
    ):
        self.zygote = zygote
        self.argv = list(argv)
        self.output_path = output_path
        self.env = dict(env) if env is not None else None
        self.cwd = cwd
        self.boot_s = boot_s
        self._pid: int | None = None
        self.exit_status: int | None = None

    def start(self, banner: str) -> int:
        deadline = time.monotonic() + self.boot_s  # power is applied now; the boot ends then
        output = self.output_path
        if output is not None:
            try:
                output.parent.mkdir(parents=True, exist_ok=True)
                with open(output, "ab") as handle:
                    handle.write(
                        f"\n==== {banner} (forked, emulated boot {self.boot_s:.3f} s) "
                        f"{time.strftime('%Y-%m-%dT%H:%M:%S')} ====\n".encode()
                    )
            except OSError as exc:  # the bus's disk is full or read-only: output unkept
                _log.error("power_switch_output_unavailable", path=str(output), error=str(exc))
                output = None
        try:
            self._pid = self.zygote.spawn(self.argv, output=output, env=self.env, cwd=self.cwd, boot_deadline=deadline)
        except ZygoteError as exc:
            raise PowerSwitchError(f"zygote could not fork the payload: {exc}") from exc
        self.exit_status = None
        return self._pid

    @property
    def pid(self) -> int | None:
        return self._pid

    @property
    def proc(self):  # running or not, as _ChildSession.proc says
        return self._pid

    def _reap(self, block: bool) -> int | None:
        try:
            return self.zygote.reap(self._pid, block, timeout_s=10.0 if block else 5.0)
        except ZygoteError as exc:
            raise PowerSwitchError(f"zygote could not reap payload {self._pid}: {exc}") from exc

    def kill(self) -> int | None:
        if self._pid is None:
            return None
        _kill_group(self._pid)
        status = self._reap(block=True)  # SIGKILL cannot be ignored: a process stuck in I/O ends soon
        _kill_group(self._pid)
        self._pid = None
        return status

    def exited(self) -> int | None:
        if self._pid is None:
            return None
        try:
            status = self._reap(block=False)
        except PowerSwitchError as exc:  # asked again at the next poll; a cut still works without the zygote
            _log.warning("power_switch_poll_failed", pid=self._pid, error=str(exc))
            return None
        if status is not None:
            _kill_group(self._pid)
            self.exit_status = status
            self._pid = None
        return status


class LocalProcessSwitch(PowerSwitch):
    """The payload is a local child process. `on` spawns `argv` in a new session (its own
    process group); `off` SIGKILLs that group at once and reaps it. The child also gets
    PR_SET_PDEATHSIG=SIGKILL, so it cannot outlive the bus.

    `pidfile` (optional) remembers the running group so that a bus restarted after being killed
    can make sure the previous payload is gone (`reset`).

    `zygote` (optional, hil/bus/zygote.py): instead of exec'ing `argv` at each power-on, fork it from
    a process that has already imported the payload's libraries, and let the fork wait `boot_s`
    wall seconds (the target's boot, scaled like the compute) before it runs. A cut is the same
    killpg(SIGKILL); the fork keeps nothing from an earlier payload."""

    driver = "local"

    def __init__(
        self,
        argv: Sequence[str],
        *,
        output_path: str | os.PathLike | None = None,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        pidfile: str | os.PathLike | None = None,
        zygote=None,
        boot_s: float = 0.0,
    ):
        if not argv:
            raise ValueError("empty payload command")
        if boot_s < 0:
            raise ValueError(f"boot_s must be >= 0, got {boot_s}")
        if boot_s and zygote is None:
            raise ValueError("an emulated boot (boot_s) needs a zygote to fork from")
        output = Path(output_path) if output_path else None
        self.zygote = zygote
        self.boot_s = boot_s
        self.session: _ForkedSession | _ChildSession
        if zygote is not None:
            self.session = _ForkedSession(zygote, argv, output, env, cwd, boot_s)
        else:
            self.session = _ChildSession(argv, output, env, cwd)
        self.pidfile = Path(pidfile) if pidfile else None
        self.boots = 0

    def prepare(self, timeout_s: float = 600.0) -> None:
        if self.zygote is not None:
            try:
                self.zygote.wait_ready(timeout_s)
            except ZygoteError as exc:
                raise PowerSwitchError(str(exc)) from exc

    def on(self) -> None:
        if self.is_on():
            return
        self.boots += 1
        pid = self.session.start(f"payload boot {self.boots}: {shlex.join(self.session.argv)}")
        if self.pidfile is not None:
            try:
                self.pidfile.write_text(f"{pid}\n")
            except OSError as exc:  # only a restarted bus's clean-up needs it; the child dies with us
                _log.error("power_switch_pidfile_failed", path=str(self.pidfile), error=str(exc))
        _log.info("power_switch_on", driver=self.driver, pid=pid, boot=self.boots)

    def off(self, cause: str) -> None:
        pid = self.session.pid
        status = self.session.kill()
        self._forget_pidfile()
        if pid is not None:
            _log.info("power_switch_off", driver=self.driver, pid=pid, cause=cause, status=status)

    def is_on(self) -> bool:
        return self.session.proc is not None

    @property
    def pid(self) -> int | None:
        return self.session.pid

    def poll(self) -> int | None:
        status = self.session.exited()
        if status is not None:
            self._forget_pidfile()
        return status

    def _forget_pidfile(self) -> None:
        if self.pidfile is None:
            return
        try:
            self.pidfile.unlink(missing_ok=True)
        except OSError as exc:  # a read-only disk: the next reset finds the group gone
            _log.error("power_switch_pidfile_failed", path=str(self.pidfile), error=str(exc))

    def reset(self) -> None:
        if self.pidfile is None or not self.pidfile.exists():
            return
        try:
            pgid = int(self.pidfile.read_text().split()[0])
        except (ValueError, IndexError, OSError):
            pgid = 0
        if pgid > 1 and _group_alive(pgid):
            _log.warning("power_switch_stale_payload_killed", pgid=pgid)
            _kill_group(pgid)
        self._forget_pidfile()

    def describe(self) -> dict:
        info: dict[str, Any] = {"driver": self.driver, "argv": list(self.session.argv), "pid": self.pid}
        if self.zygote is not None:
            info.update(zygote=self.zygote.describe(), emulated_boot_s=self.boot_s)
        return info

    def close(self) -> None:
        super().close()
        if self.zygote is not None:
            self.zygote.close()


def _run(
    argv: Sequence[str], what: str, timeout_s: float, env: Mapping[str, str] | None = None
) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(
            list(argv),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=timeout_s,
            env=dict(env) if env is not None else None,
        )
    except subprocess.TimeoutExpired:
        raise PowerSwitchError(f"{what}: no answer within {timeout_s:g} s") from None
    except OSError as exc:
        raise PowerSwitchError(f"{what}: cannot run {argv[0]!r}: {exc}") from None


def _tail(data: bytes, limit: int = 300) -> str:
    text = data.decode("utf-8", "replace").strip()
    return text[-limit:]


#: Remote kill used unless the operator gives one. The pid file holds the payload's process group
#: id and the start time of its leader (field 22 of /proc/PID/stat, read with shell builtins),
#: written by the start script.
#: A leader that is alive with another start time is a new process that reused the pid (a board
#: that rebooted keeps /tmp on disk): nothing of ours is left and nothing is killed. Otherwise the
#: group gets SIGKILL and the script waits (up to 2 s) until no member of it is left but zombies,
#: else exits 1. (While any member of the group lives, Linux does not hand its id to a new
#: process, so a dead leader means the members found are ours.) `kill -9 -PGID`, not
#: `kill -KILL -- -PGID`: dash's kill, Debian's /bin/sh, takes no `--`.
DEFAULT_SSH_KILL = (
    'f={pidfile}; if [ -f "$f" ]; then read p s < "$f"; if [ -n "$p" ]; then t=; '
    'if [ -n "$s" ] && read -r t 2>/dev/null < "/proc/$p/stat"; then t=${{t##*") "}}; set -- $t; t=${{20}}; fi; '
    'if [ -n "$t" ] && [ "$t" != "$s" ]; then '
    'echo "pid $p now belongs to another process: the recorded payload is gone" >&2; '
    'else kill -9 -"$p" 2>/dev/null; i=0; '
    "while ! cat /proc/[0-9]*/stat 2>/dev/null | "
    'awk -v p="$p" \'{{sub(/.*\\) /, ""); if ($3 == p && $1 != "Z") n++}} END {{exit n > 0}}\'; do '
    'i=$((i+1)); if [ $i -ge 40 ]; then echo "payload group $p survived SIGKILL" >&2; exit 1; fi; sleep 0.05; '
    'done; fi; fi; rm -f "$f"; fi'
)
#: Forced reboot unless the operator gives one. It is scheduled a moment later so that ssh can
#: report whether it was accepted (a reboot that drops the connection would look like a board
#: that never answered); the SIGKILL of the flight process runs first, so the cut is immediate.
DEFAULT_SSH_REBOOT = "sudo -n true && { (sleep 0.5; sudo -n /sbin/reboot -f) >/dev/null 2>&1 & }"
#: The start script prints this line, with the boot's nonce and its pid, after it has recorded the
#: payload's process group and just before it execs the flight process: `on` returns only once it
#: has seen it, so a refused key, an unknown host key or an unreachable board is a failed power-on.
START_MARKER = "orbitweaver-payload-started"


class SshSwitch(PowerSwitch):
    """The payload runs on another machine reached over SSH.

    on:  runs `transport + [remote script]`: the script first kills whatever payload a previous
         run left (the kill script below), records its own pid and start time (sshd made it a
         session leader, so the pid is the process group) in `pidfile`, prints START_MARKER and
         execs `remote_command`. The local ssh client stays attached while the payload runs.
         `on` waits (up to `timeout_s`) for the marker; an ssh that ends first (refused key,
         unknown host key, board unreachable) or no marker in time raises PowerSwitchError.
    off: mode "kill"   — runs the kill script over a second SSH connection (SIGKILL of the
                         payload's process group on the board, then a check that it is gone);
         mode "reboot" — the same, then `reboot_command` (a forced reboot: the board loses all
                         RAM state); power-on attempts fail, and are reported, until it is back.
    poll: the ssh session ending is reported as the payload's exit (255: the connection was lost
         or the payload was killed by a signal). The bus then power-cycles it, and the kill
         makes sure no orphan of a lost connection survives (sshd does not signal a command
         without a terminal when its connection drops).

    `transport` is the argv prefix that reaches the board, by default
    `ssh -o BatchMode=yes -o ConnectTimeout=5 ... [-p PORT] [-i KEY] [-o ...] [USER@]HOST --`.
    Every script goes through `exec /bin/sh -c '...'`, so the login shell of the board's user
    only has to understand that one line. Anything that runs its last argument as a shell
    command on the board works (tests also use `bash -c` on this machine)."""

    driver = "ssh"

    def __init__(
        self,
        remote_command: str,
        *,
        host: str | None = None,
        user: str | None = None,
        port: int | None = None,
        identity: str | None = None,
        ssh_options: Sequence[str] = (),
        transport: Sequence[str] | None = None,
        mode: str = "kill",
        pidfile: str = "/tmp/orbitweaver-payload.pid",
        kill_command: str | None = None,
        reboot_command: str = DEFAULT_SSH_REBOOT,
        output_path: str | os.PathLike | None = None,
        timeout_s: float = COMMAND_TIMEOUT_S,
    ):
        if mode not in ("kill", "reboot"):
            raise ValueError(f"ssh power-off mode must be 'kill' or 'reboot', not {mode!r}")
        if transport is None:
            if not host:
                raise ValueError("SshSwitch needs a host (or an explicit transport)")
            transport = self.ssh_argv(host, user=user, port=port, identity=identity, options=ssh_options)
        self.transport = list(transport)
        self.host = host
        self.remote_command = remote_command
        self.mode = mode
        self.pidfile = pidfile
        self.kill_command = kill_command or DEFAULT_SSH_KILL.format(pidfile=shlex.quote(pidfile))
        self.reboot_command = reboot_command
        self.output_path = Path(output_path) if output_path else None
        self.timeout_s = timeout_s
        self.session: _ChildSession | None = None
        self.remote_pid: int | None = None
        self._on = False
        self.boots = 0

    @staticmethod
    def ssh_argv(
        host: str,
        *,
        user: str | None = None,
        port: int | None = None,
        identity: str | None = None,
        options: Sequence[str] = (),
    ) -> list[str]:
        # BatchMode: never prompt. ConnectTimeout/ServerAlive*: a board that stops answering is
        # noticed within seconds. ControlPath=none: every action is its own connection, even if
        # the operator's ssh config multiplexes (a shared master would outlive our kill of the
        # client). IdentitiesOnly: with a key given, offer only it (an agent's other keys would
        # count against the server's MaxAuthTries).
        argv = [
            "ssh",
            "-o",
            "BatchMode=yes",
            "-o",
            "ConnectTimeout=5",
            "-o",
            "ServerAliveInterval=2",
            "-o",
            "ServerAliveCountMax=3",
            "-o",
            "ControlMaster=no",
            "-o",
            "ControlPath=none",
        ]
        if port is not None:
            argv += ["-p", str(int(port))]
        if identity:
            argv += ["-i", identity, "-o", "IdentitiesOnly=yes"]
        for option in options:
            argv += ["-o", option]
        argv.append(f"{user}@{host}" if user else host)
        argv.append("--")
        return argv

    def start_script(self, nonce: str = "") -> str:
        pidfile = shlex.quote(self.pidfile)
        # The start time is field 22 of /proc/$$/stat, read with shell builtins only (no fork
        # between power-on and the payload): fields after the command name's closing ") ".
        return (
            f"{self.kill_command} || exit 1; "
            f'read -r s < /proc/$$/stat; s=${{s##*") "}}; set -- $s; '
            f'echo "$$ ${{20}}" > {pidfile} || exit 1; '
            f"echo {START_MARKER} {nonce or '-'} $$; "
            f"exec {self.remote_command}"
        )

    def _remote(self, script: str) -> list[str]:
        return self.transport + [f"exec /bin/sh -c {shlex.quote(script)}"]

    def start_argv(self, nonce: str = "") -> list[str]:
        return self._remote(self.start_script(nonce))

    def kill_argv(self) -> list[str]:
        return self._remote(self.kill_command)

    def reboot_argv(self) -> list[str]:
        return self._remote(f"{self.kill_command} && {self.reboot_command}")

    def _session_log(self) -> Path:
        if self.output_path is None:  # the marker has to land somewhere we can read
            fd, name = tempfile.mkstemp(prefix="orbitweaver-ssh-", suffix=".log")
            os.close(fd)
            self.output_path = Path(name)
        return self.output_path

    def on(self) -> None:
        if self._on:
            return
        self.boots += 1
        nonce = secrets.token_hex(8)
        log_path = self._session_log()
        try:
            offset = log_path.stat().st_size
        except OSError:
            offset = 0
        session = _ChildSession(self.start_argv(nonce), log_path, None, None)
        session.start(f"payload boot {self.boots} via {self.transport[0]}")
        deadline = time.monotonic() + self.timeout_s
        assert session.proc is not None  # start() returned: the process exists
        while True:
            ended = session.proc.poll()  # read before the log: a marker then an exit is a start
            text = _read_from(log_path, offset)
            pid = _marker_pid(text, nonce)
            if pid is not None:
                break
            if ended is not None:
                session.kill()
                raise PowerSwitchError(
                    f"ssh power-on{self._where()} exited {ended} before the payload started: "
                    f"{_ssh_output(text) or 'no output'}"
                )
            if time.monotonic() >= deadline:
                session.kill()
                raise PowerSwitchError(
                    f"ssh power-on{self._where()}: the payload did not start within "
                    f"{self.timeout_s:g} s: {_ssh_output(text) or 'no output'}"
                )
            time.sleep(0.02)
        self.session = session
        self.remote_pid = pid
        self._on = True
        _log.info(
            "power_switch_on", driver=self.driver, host=self.host, ssh_pid=session.pid, remote_pid=pid, boot=self.boots
        )

    def _where(self) -> str:
        return f" to {self.host}" if self.host else ""

    def off(self, cause: str) -> None:
        argv = self.reboot_argv() if self.mode == "reboot" else self.kill_argv()
        result = _run(argv, f"ssh power-off ({self.mode})", self.timeout_s)
        if result.returncode != 0:
            what = "could not reach the board, " if result.returncode == SSH_TRANSPORT_FAILURE else ""
            raise PowerSwitchError(
                f"ssh power-off ({self.mode}){self._where()} {what}exited {result.returncode}: "
                f"{_tail(result.stderr) or 'no output'}"
            )
        if self.session is not None:
            self.session.kill()  # the local ssh client of the killed payload
            self.session = None
        killed, self.remote_pid = self.remote_pid, None
        self._on = False
        _log.info(
            "power_switch_off", driver=self.driver, host=self.host, cause=cause, mode=self.mode, remote_pid=killed
        )

    def is_on(self) -> bool:
        return self._on

    @property
    def pid(self) -> int | None:
        return self.session.pid if self.session is not None else None

    def poll(self) -> int | None:
        if self.session is None:
            return None
        status = self.session.exited()
        if status is None:
            return None
        self.session = None
        # The switch stays on: the bus cuts (and so kills whatever is left on the board) next.
        _log.warning(
            "power_switch_ssh_session_ended",
            host=self.host,
            status=status,
            remote_pid=self.remote_pid,
            meaning="connection lost or payload killed by a signal"
            if status == SSH_TRANSPORT_FAILURE
            else "payload exited",
        )
        return status

    def reset(self) -> None:
        # Whatever a previous bus left running on the board goes first (a fresh start is a
        # fresh process). A board that does not answer may be off; `on` kills a leftover
        # payload before starting anyway.
        result = _run(self.kill_argv(), "ssh reset", self.timeout_s)
        if result.returncode == SSH_TRANSPORT_FAILURE:
            _log.warning("power_switch_ssh_reset_unreachable", host=self.host, error=_tail(result.stderr))
        elif result.returncode != 0:
            raise PowerSwitchError(f"ssh reset exited {result.returncode}: {_tail(result.stderr) or 'no output'}")

    def describe(self) -> dict:
        return {
            "driver": self.driver,
            "host": self.host,
            "mode": self.mode,
            "transport": self.transport[:1],
            "pidfile": self.pidfile,
            "remote_command": self.remote_command,
            "pid": self.pid,
            "remote_pid": self.remote_pid,
        }


def _read_from(path: Path, offset: int) -> str:
    try:
        with open(path, "rb") as handle:
            handle.seek(offset)
            return handle.read().decode("utf-8", "replace")
    except OSError:
        return ""


def _ssh_output(text: str) -> str:
    """What ssh and the start script said, without the log's boot banner."""
    lines = [line for line in text.splitlines() if not line.startswith("==== payload boot ")]
    return _tail("\n".join(lines).encode())


def _marker_pid(text: str, nonce: str) -> int | None:
    """The pid on the start script's marker line for this boot's nonce, once the whole line has
    arrived (ssh may pass it on in pieces)."""
    for line in text.split("\n")[:-1]:
        words = line.split()
        if len(words) == 3 and words[0] == START_MARKER and words[1] == nonce and words[2].isdigit():
            return int(words[2])
    return None


class CommandSwitch(PowerSwitch):
    """Operator-given shell commands switch a relay or a networked PDU outlet (e.g. `snmpset`,
    `curl` to a PDU, `usbrelay`). The board starts the flight process by itself at boot; the bus
    only knows the switch state, not a process. A command that exits non-zero or hangs raises
    PowerSwitchError and the state does not change."""

    driver = "command"

    def __init__(
        self,
        on_command: str,
        off_command: str,
        *,
        timeout_s: float = COMMAND_TIMEOUT_S,
        env: Mapping[str, str] | None = None,
    ):
        if not on_command or not off_command:
            raise ValueError("CommandSwitch needs both an on and an off command")
        self.on_command = on_command
        self.off_command = off_command
        self.timeout_s = timeout_s
        self.env = env
        self._on = False

    def _shell(self, command: str, what: str) -> None:
        result = _run(["/bin/sh", "-c", command], what, self.timeout_s, self.env)
        if result.returncode != 0:
            raise PowerSwitchError(f"{what} exited {result.returncode}: {_tail(result.stderr) or 'no output'}")

    def on(self) -> None:
        if self._on:
            return
        self._shell(self.on_command, "power-on command")
        self._on = True
        _log.info("power_switch_on", driver=self.driver)

    def off(self, cause: str) -> None:
        self._shell(self.off_command, "power-off command")
        self._on = False
        _log.info("power_switch_off", driver=self.driver, cause=cause)

    def is_on(self) -> bool:
        return self._on

    def reset(self) -> None:
        # The relay's state after a bus restart is unknown: open it.
        self._shell(self.off_command, "power-off command (reset)")
        self._on = False

    def describe(self) -> dict:
        return {"driver": self.driver, "on_command": self.on_command, "off_command": self.off_command}


def process_write_bytes(pid: int | None) -> int | None:
    """Bytes this process has caused to be written to storage so far (Linux /proc/<pid>/io
    `write_bytes`: what reaches the block layer, fsync flushes included), or None if unknown.
    Read just before a cut, it is the payload's device-level write volume for that power cycle."""
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/io") as f:
            for line in f:
                if line.startswith("write_bytes:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return None
