"""A real OpenSSH server for the SSH power-switch tests: Debian's `openssh-server` installed on
demand, then one `sshd` per test module on a loopback port with a host key, client keys, an
`authorized_keys` file and a config written for it in a temporary folder. Nothing system-wide is
changed beyond the package itself and the empty privilege-separation folder /run/sshd that sshd
needs when it runs as root (made at boot on a real system). It is left in place: every sshd
forks its sessions into it, so removing it under another running sshd (another test worker,
another suite) makes that one reset every new connection.

`python tests/bus/sshd_testkit.py --install` installs the package (as `make test` does before
the suite); it always exits 0 and says what happened, and the tests skip with that reason when
sshd is still missing.

The sshd configuration is the one `docs/hil.md` ("An SSH bench on one machine") shows; a test
checks that the two agree."""

from __future__ import annotations

import fcntl
import getpass
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PACKAGE = "openssh-server"
SSHD_CANDIDATES = ("/usr/sbin/sshd", "/usr/local/sbin/sshd")
PRIVSEP_DIR = Path("/run/sshd")
INSTALL_LOCK = Path(tempfile.gettempdir()) / "orbitweaver-openssh-install.lock"
POLICY_RC_D = Path("/usr/sbin/policy-rc.d")

#: sshd_config of the test bench ({...} filled in by `SshServer`); docs/hil.md shows the same text.
SSHD_CONFIG = """\
ListenAddress 127.0.0.1
Port {port}
HostKey {dir}/ssh_host_ed25519_key
PidFile {dir}/sshd.pid
AuthorizedKeysFile {dir}/authorized_keys
AllowUsers {user}
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
PermitRootLogin prohibit-password
UsePAM no
StrictModes no
PrintMotd no
LogLevel VERBOSE
"""


def find_sshd() -> str | None:
    for path in (shutil.which("sshd"), *SSHD_CANDIDATES):
        if path and os.access(path, os.X_OK):
            return path
    return None


def _apt_get(args: list[str], env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["apt-get", "-q", "-y", "-o", "DPkg::Lock::Timeout=300", *args],
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=900,
    )


def install_openssh_server() -> str | None:
    """Make sure `sshd` exists, installing Debian's package when it is missing and this runs as
    root with apt-get. Returns None when sshd is there, else why it is not."""
    if find_sshd():
        return None
    if os.geteuid() != 0:
        return f"{PACKAGE} is not installed and installing it needs root (apt-get install {PACKAGE})"
    if not shutil.which("apt-get"):
        return f"{PACKAGE} is not installed and this system has no apt-get"
    INSTALL_LOCK.touch(exist_ok=True)
    with open(INSTALL_LOCK) as lock:  # concurrent test workers install once
        fcntl.flock(lock, fcntl.LOCK_EX)
        if find_sshd():
            return None
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        # The package would start a system sshd on port 22; forbid service starts for the
        # install (the Debian mechanism, absent on a bare system), then remove the rule again.
        own_policy = not POLICY_RC_D.exists()
        if own_policy:
            POLICY_RC_D.write_text("#!/bin/sh\n# installing openssh-server for tests: start no service\nexit 101\n")
            POLICY_RC_D.chmod(0o755)
        try:
            result = _apt_get(["install", "--no-install-recommends", PACKAGE], env)
            if result.returncode != 0:  # package lists missing or stale on a fresh machine
                update = _apt_get(["update"], env)
                if update.returncode == 0:
                    result = _apt_get(["install", "--no-install-recommends", PACKAGE], env)
                else:
                    result = update
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"apt-get install {PACKAGE} failed: {exc}"
        finally:
            if own_policy:
                POLICY_RC_D.unlink(missing_ok=True)
        if result.returncode != 0 or not find_sshd():
            tail = (result.stderr or result.stdout).strip().splitlines()[-3:]
            return f"apt-get install {PACKAGE} failed (exit {result.returncode}): {' | '.join(tail)}"
    return None


def keygen(path: Path, comment: str) -> Path:
    """A fresh ed25519 key pair without a passphrase; returns the private key's path."""
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)],
        check=True,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        timeout=60,
    )
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PortTaken(RuntimeError):
    """sshd could not bind its port: another process took it first."""


class SshServer:
    """One sshd on 127.0.0.1:port for the current user, with its own keys and config in `root`.

    server = SshServer(tmp_dir).start()
    server.client_key      # authorized private key
    server.stranger_key    # a key sshd does not know
    server.known_hosts     # the host key, as the client must know it
    server.stop_listener() / server.start()   # the board goes away and comes back
    server.stop()          # listener and every session it started
    """

    def __init__(self, root: Path, sshd: str):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.root.chmod(0o700)
        self.sshd = sshd
        self.user = getpass.getuser()
        self.host_key = keygen(self.root / "ssh_host_ed25519_key", "orbitweaver-test-host")
        self.client_key = keygen(self.root / "client_ed25519", "orbitweaver-test-bus")
        self.stranger_key = keygen(self.root / "stranger_ed25519", "orbitweaver-test-stranger")
        (self.root / "authorized_keys").write_text((self.root / "client_ed25519.pub").read_text())
        self.known_hosts = self.root / "known_hosts"
        self.config = self.root / "sshd_config"
        self.log = self.root / "sshd.log"
        self.proc: subprocess.Popen | None = None
        self.sessions: set = set()  # psutil.Process of per-connection sshd processes, for stop()
        self.answered = False  # sshd has answered on self.port: clients know the port from then on
        self._use_port(free_port())

    def _use_port(self, port: int) -> None:
        """Listen on `port`: the config sshd reads and the host key the clients check carry it."""
        self.port = port
        host_public = (self.root / "ssh_host_ed25519_key.pub").read_text().split()
        self.known_hosts.write_text(f"[127.0.0.1]:{port} {host_public[0]} {host_public[1]}\n")
        self.config.write_text(SSHD_CONFIG.format(port=port, dir=self.root, user=self.user))

    def client_options(self) -> list[str]:
        """`ssh -o` options of the bus: this server's host key, checked strictly."""
        return [f"UserKnownHostsFile={self.known_hosts}", "GlobalKnownHostsFile=/dev/null", "StrictHostKeyChecking=yes"]

    def start(self, timeout_s: float = 60.0, attempts: int = 5) -> SshServer:
        """Start sshd and wait until it answers. The port was found free, not held: on a busy
        machine another process may bind it before sshd does, and sshd then exits ("Address
        already in use"). Before the first answer nobody knows the port yet, so it moves to a
        fresh one; after it (the board coming back) it must stay, so the start is retried there."""
        for _ in range(attempts - 1):
            try:
                return self._start_once(timeout_s)
            except PortTaken:
                if self.answered:
                    time.sleep(0.5)
                else:
                    self._use_port(free_port())
        return self._start_once(timeout_s)

    def _start_once(self, timeout_s: float) -> SshServer:
        if os.geteuid() == 0 and not PRIVSEP_DIR.is_dir():
            PRIVSEP_DIR.mkdir(mode=0o755, exist_ok=True)  # another worker may make it at the same time
        self.log.write_text("")  # this start's log alone: a bind failure is read from it
        # -D: stay in the foreground (a child of this process); -e -E: log to our file.
        self.proc = subprocess.Popen(
            [self.sshd, "-D", "-f", str(self.config), "-E", str(self.log)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                returncode, self.proc = self.proc.returncode, None
                if "Address already in use" in self.log_tail(lines=50):
                    raise PortTaken(f"port {self.port} taken before sshd bound it: {self.log_tail()}")
                raise RuntimeError(f"sshd exited with {returncode}: {self.log_tail()}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=2) as s:
                    if s.recv(64).startswith(b"SSH-"):
                        self.answered = True
                        return self
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"sshd did not answer on port {self.port} within {timeout_s:g} s: {self.log_tail()}")

    def stop_listener(self) -> None:
        """Stop accepting connections; sessions already open go on (as when sshd restarts)."""
        if self.proc is not None:
            self._remember_sessions()
            self.proc.kill()
            self.proc.wait(30)
            self.proc = None

    def _remember_sessions(self) -> None:
        import psutil

        assert self.proc is not None  # called while sshd runs
        try:
            self.sessions.update(psutil.Process(self.proc.pid).children(recursive=True))
        except psutil.Error:
            pass

    def stop(self) -> None:
        """Stop the listener and every session process it started."""
        import psutil

        self.stop_listener()
        for proc in self.sessions:
            try:
                proc.kill()
            except psutil.Error:
                pass
        self.sessions.clear()

    def log_tail(self, lines: int = 5) -> str:
        try:
            return " | ".join(self.log.read_text(errors="replace").strip().splitlines()[-lines:])
        except OSError:
            return "(no log)"


if __name__ == "__main__":
    if "--install" not in sys.argv[1:]:
        print(__doc__)
        sys.exit(2)
    reason = install_openssh_server()
    print(f"sshd for the SSH power-switch tests: {find_sshd() if reason is None else 'not available: ' + reason}")
    sys.exit(0)
