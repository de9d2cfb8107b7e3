"""Power-switch drivers: real processes, real SIGKILL of whole process groups, real respawns;
the SSH driver's argv, and the driver run end to end through a local shell standing in for ssh."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import textwrap

import psutil
import pytest
from bus_testkit import HANG_S, wait_for

from hil.bus.power import CommandSwitch, LocalProcessSwitch, PowerSwitchError, SshSwitch

# A payload stand-in that starts a grandchild in its own process group (as a flight process
# with worker processes would) and writes both pids, then sleeps. A polite signal (SIGTERM, SIGINT,
# SIGHUP) is noted in <pids>.polite: a power cut must never send one first and wait.
FAMILY = textwrap.dedent("""
    import os, signal, subprocess, sys, time
    def polite(signum, frame):
        with open(sys.argv[1] + ".polite", "a") as f:
            f.write(f"{signum}\\n")
    for polite_signal in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(polite_signal, polite)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    with open(sys.argv[1] + ".tmp", "w") as f:
        f.write(f"{os.getpid()} {child.pid}")
    os.replace(sys.argv[1] + ".tmp", sys.argv[1])
    time.sleep(600)
""")


def dead(pid: int) -> bool:
    """Gone, or a zombie nobody has reaped yet (the container's init may not reap orphans)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def family_pids(pidfile) -> tuple[int, int]:
    text = wait_for(lambda: pidfile.exists() and pidfile.read_text(), HANG_S, what="payload pids")
    leader, child = (int(x) for x in text.split())
    return leader, child


def test_local_switch_sigkills_the_whole_group_at_once_and_respawns(tmp_path):
    pids = tmp_path / "pids"
    switch = LocalProcessSwitch([sys.executable, "-c", FAMILY, str(pids)], output_path=tmp_path / "out.log")
    switch.on()
    assert switch.is_on()
    leader, child = family_pids(pids)
    assert leader == switch.pid
    assert os.getpgid(child) == os.getpgid(leader) == leader, "payload runs in its own process group"
    proc = switch.session.proc

    switch.off("thermal")
    assert not switch.is_on() and switch.pid is None
    assert proc.returncode == -signal.SIGKILL, "a cut is a SIGKILL, not a polite stop"
    # Immediate, shown without a clock: no polite signal was sent first to be waited out.
    assert not (tmp_path / "pids.polite").exists(), (tmp_path / "pids.polite").read_text()
    assert dead(leader)
    wait_for(lambda: dead(child), HANG_S, what="grandchild killed with its group")

    pids.unlink()
    switch.on()
    new_leader, new_child = family_pids(pids)
    assert new_leader != leader and not dead(new_leader) and not dead(new_child)
    switch.off("fdir")
    assert dead(new_leader)


def test_local_switch_reports_a_payload_that_exits_by_itself(tmp_path):
    switch = LocalProcessSwitch([sys.executable, "-c", "import sys; sys.exit(3)"])
    switch.on()
    status = wait_for(switch.poll, HANG_S, what="exit status")
    assert status == 3
    assert not switch.is_on()


def test_restarted_bus_kills_the_payload_a_killed_bus_left_behind(tmp_path):
    pids = tmp_path / "pids"
    argv = [sys.executable, "-c", FAMILY, str(pids)]
    # `first` stands for the switch of a bus that died without taking its payload along (the
    # payload's parent, this test process, lives on); `second` is the restarted bus's switch.
    first = LocalProcessSwitch(argv, pidfile=tmp_path / "payload.pid")
    first.on()
    leader, child = family_pids(pids)
    second = LocalProcessSwitch(argv, pidfile=tmp_path / "payload.pid")
    second.reset()
    wait_for(lambda: dead(leader) and dead(child), HANG_S, what="stale payload group killed")
    assert not (tmp_path / "payload.pid").exists()
    first.session.proc.wait(HANG_S)


def test_payload_dies_with_a_killed_bus(tmp_path):
    pids = tmp_path / "pids"
    stand_in_bus = textwrap.dedent(f"""
        import sys, time
        from hil.bus.power import LocalProcessSwitch
        switch = LocalProcessSwitch([sys.executable, "-c", {FAMILY!r}, {str(pids)!r}])
        switch.on()
        print(switch.pid, flush=True)
        time.sleep(600)
    """)
    bus = subprocess.Popen([sys.executable, "-c", stand_in_bus], stdout=subprocess.PIPE, text=True)
    try:
        leader, child = family_pids(pids)
        assert not dead(leader)
        bus.kill()
        bus.wait(HANG_S)
        wait_for(lambda: dead(leader), HANG_S, what="payload killed by the parent-death signal")
    finally:
        bus.kill()
        bus.wait()
        for pid in (leader, child):
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, UnboundLocalError):
                pass


def test_ssh_argv_reaches_the_board_and_records_the_process_group():
    switch = SshSwitch(
        "ow flight run --data-dir /var/lib/ow --model /opt/m",
        host="jetson.local",
        user="ow",
        port=2222,
        identity="/home/op/.ssh/bench",
        ssh_options=["StrictHostKeyChecking=accept-new"],
        pidfile="/run/ow/payload.pid",
    )
    prefix = [
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
        "-p",
        "2222",
        "-i",
        "/home/op/.ssh/bench",
        "-o",
        "IdentitiesOnly=yes",
        "-o",
        "StrictHostKeyChecking=accept-new",
        "ow@jetson.local",
        "--",
    ]
    start = switch.start_argv("n0nce")
    assert start[:-1] == prefix
    # One shell line for the login shell: exec a POSIX shell on the quoted script.
    assert start[-1].startswith("exec /bin/sh -c '")
    script = shlex.split(start[-1])[-1]
    assert script.startswith(switch.kill_command + " || exit 1; ")
    assert "/proc/$$/stat" in script and "> /run/ow/payload.pid" in script
    assert script.endswith(
        "echo orbitweaver-payload-started n0nce $$; exec ow flight run --data-dir /var/lib/ow --model /opt/m"
    )
    kill = switch.kill_argv()
    assert kill[:-1] == prefix
    assert shlex.split(kill[-1])[-1] == switch.kill_command
    assert 'kill -9 -"$p"' in switch.kill_command and "/run/ow/payload.pid" in switch.kill_command
    reboot = SshSwitch("ow flight run", host="jetson.local", mode="reboot").reboot_argv()
    assert shlex.split(reboot[-1])[-1].startswith(SshSwitch("x", host="h").kill_command + " && ")
    assert "/sbin/reboot -f" in reboot[-1]
    with pytest.raises(ValueError):
        SshSwitch("ow flight run", host="h", mode="unplug")


def test_ssh_switch_over_a_local_shell_kills_the_remote_group(tmp_path):
    """`bash -c SCRIPT` stands in for `ssh HOST SCRIPT` (there is no ssh server here): the same
    start and kill scripts run, only the transport differs."""
    pids = tmp_path / "pids"
    remote = shlex.join([sys.executable, "-c", FAMILY, str(pids)])
    switch = SshSwitch(
        remote, transport=["bash", "-c"], pidfile=str(tmp_path / "remote.pid"), output_path=tmp_path / "out.log"
    )
    switch.reset()  # nothing running: succeeds without killing anything
    switch.on()
    leader, child = family_pids(pids)
    assert int((tmp_path / "remote.pid").read_text().split()[0]) == leader, "exec keeps the recorded pid"
    assert switch.remote_pid == leader
    switch.off("thermal")
    wait_for(lambda: dead(leader) and dead(child), HANG_S, what="remote group killed")
    assert not switch.is_on() and not (tmp_path / "remote.pid").exists()


def test_ssh_switch_does_not_pretend_when_the_board_is_unreachable(tmp_path):
    # `ssh` exits 255 when it cannot reach the host; so does this transport.
    switch = SshSwitch("sleep 60", transport=["bash", "-c", "exit 255", "ssh"], pidfile=str(tmp_path / "p"))
    with pytest.raises(PowerSwitchError, match="could not reach the board, exited 255"):
        switch.off("thermal")
    with pytest.raises(PowerSwitchError, match="exited 255 before the payload started"):
        switch.on()
    assert not switch.is_on(), "a power-on that never reached the board is not an on"
    reboot = SshSwitch("sleep 60", transport=["bash", "-c", "exit 255", "ssh"], mode="reboot")
    with pytest.raises(PowerSwitchError):
        reboot.off("fdir")


def test_command_switch_runs_the_operator_commands_and_reports_failures(tmp_path):
    relay = tmp_path / "relay.log"
    switch = CommandSwitch(f"echo on >> {relay}", f"echo off >> {relay}")
    switch.reset()
    switch.on()
    assert switch.is_on()
    switch.off("thermal")
    assert not switch.is_on()
    assert relay.read_text().split() == ["off", "on", "off"]

    broken = CommandSwitch("echo relay timeout >&2; exit 4", f"echo off >> {relay}")
    with pytest.raises(PowerSwitchError, match="relay timeout"):
        broken.on()
    assert not broken.is_on(), "a failed command leaves the state unchanged"
    slow = CommandSwitch("sleep 5", "true", timeout_s=0.3)
    with pytest.raises(PowerSwitchError, match="no answer"):
        slow.on()
