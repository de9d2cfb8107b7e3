"""The SSH power switch against a real OpenSSH server (Debian's openssh-server) on a loopback port,
with a host key, client keys and a config written for the test (tests/bus/sshd_testkit.py; the
same bench set-up docs/hil.md shows).

- the switch itself: power on, a cut that kills the remote process group (by pid), a lost
  connection whose orphans survive until the cut, a board unreachable at the cut, a stale payload
  of a dead bus, a pid reused by another process, a board that accepts TCP but never speaks;
- the bus driving it: a trace's cut and a connection killed mid-session; a refused key, an
  unknown host key and an unreachable port, each a power-switch error and an FDIR fault;
- the bus driving the real payload (`ow flight run`, tiny model) over ssh: its connection killed
  mid-prefill, the FDIR cut over ssh, the power-on again, the resumed task's answer the
  uninterrupted one bit for bit.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest
from bus_testkit import drain, telemetry_subscriber, wait_for, window, write_trace
from sshd_testkit import SSHD_CONFIG, SshServer, find_sshd, install_openssh_server

from common.wire import messages as m
from common.wire.link import Endpoints, init_keys
from hil.bus import BusConfig, BusThread
from hil.bus import buslog as bl
from hil.bus.power import START_MARKER, PowerSwitchError, SshSwitch

pytestmark = pytest.mark.xdist_group("sshd")  # one sshd per module, so one worker runs them all

REPO = Path(__file__).resolve().parents[2]
HANG_S = 120  # hang guard of every wait: generous, the machine may be busy

# A payload stand-in: starts a grandchild in the same process group (as a payload with workers
# would), appends "leader child" to a file, then sleeps without writing anything (so nothing but
# a kill ends it: no broken pipe after a lost connection).
FAMILY = textwrap.dedent("""
    import os, subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    with open(sys.argv[1], "a") as f:
        f.write(f"{os.getpid()} {child.pid}\\n")
    time.sleep(600)
""")


@pytest.fixture(scope="module")
def sshd(tmp_path_factory):
    reason = install_openssh_server()
    if reason is not None:
        pytest.skip(f"no OpenSSH server for the SSH power-switch tests: {reason}")
    server = SshServer(tmp_path_factory.mktemp("sshd"), find_sshd()).start()
    yield server
    server.stop()


def dead(pid: int) -> bool:
    """Gone, or a zombie nobody has reaped yet (orphans of this container's init stay zombies)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes in process group `pgid`."""
    out = []
    for proc in psutil.process_iter():
        try:
            if os.getpgid(proc.pid) == pgid and proc.status() != psutil.STATUS_ZOMBIE:
                out.append(proc.pid)
        except (ProcessLookupError, psutil.Error):
            pass
    return out


def families(path: Path, count: int) -> list[tuple[int, ...]]:
    """The (leader, child) pids of the first `count` boots of the FAMILY payload."""

    def read():
        lines = path.read_text().splitlines() if path.exists() else []
        return lines if len(lines) >= count else None

    return [tuple(int(x) for x in line.split()) for line in wait_for(read, HANG_S, what=f"{count} payload boots")]


def marker_pids(log: Path) -> list[int]:
    """Remote pids of every boot, from the start script's markers in the payload log."""
    text = log.read_text(errors="replace") if log.exists() else ""
    return [
        int(line.split()[2])
        for line in text.splitlines()
        if line.startswith(START_MARKER + " ") and len(line.split()) == 3
    ]


def kill_session_of(pid: int) -> None:
    """Drop the SSH connection that runs `pid`: SIGKILL its sshd session process."""
    session = psutil.Process(pid).parent()
    assert session.name().startswith("sshd"), session.cmdline()
    session.kill()


def ssh_switch(sshd: SshServer, remote: str, tmp_path: Path, **kw) -> SshSwitch:
    kw.setdefault("identity", str(sshd.client_key))
    kw.setdefault("ssh_options", sshd.client_options())
    return SshSwitch(
        remote,
        host="127.0.0.1",
        port=sshd.port,
        user=sshd.user,
        pidfile=str(tmp_path / "board" / "payload.pid"),
        output_path=tmp_path / "payload.log",
        **kw,
    )


def entries(data_dir: Path) -> list[bl.BusLogEntry]:
    return bl.read_log(data_dir / bl.LOG_FILE)


def wait_log(data_dir: Path, predicate, what: str) -> list[bl.BusLogEntry]:
    """The bus's run log, once `predicate(log)` holds."""

    def ready():
        log = entries(data_dir)
        return log if predicate(log) else None

    return wait_for(ready, HANG_S, 0.1, what)


def kinds(log: list[bl.BusLogEntry], kind: str, **match) -> list[bl.BusLogEntry]:
    return [e for e in log if e.kind == kind and all(e.data.get(k) == v for k, v in match.items())]


# ------------------------------------------------------------------------------ the bench doc


def test_docs_show_the_bench_set_up_the_tests_use():
    """docs/hil.md shows this module's sshd configuration, filled in for its example bench."""
    doc = (REPO / "docs" / "hil.md").read_text(encoding="utf-8")
    assert SSHD_CONFIG.format(port=2222, dir="/srv/ow-bench/sshd", user="ow") in doc
    for option in ("UserKnownHostsFile=", "StrictHostKeyChecking=yes", "--ssh-identity", "--ssh-port 2222"):
        assert option in doc


# ------------------------------------------------------------------------------ the switch


def test_the_test_sshd_moves_off_a_port_taken_before_it_bound(sshd, tmp_path):
    # The test sshd's port is found free, not held (sshd binds it itself): on a busy machine a
    # neighbour may take it first. Before sshd has answered nobody knows the port, so it moves on.
    server = SshServer(tmp_path / "sshd", find_sshd())
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        server._use_port(taken.getsockname()[1])
        try:
            server.start()
            assert server.port != taken.getsockname()[1]
            assert f"[127.0.0.1]:{server.port} " in server.known_hosts.read_text()
            result = subprocess.run(
                ["ssh", "-i", str(server.client_key), "-p", str(server.port), "-o", "BatchMode=yes"]
                + [opt for o in server.client_options() for opt in ("-o", o)]
                + [f"{server.user}@127.0.0.1", "echo", "up"],
                capture_output=True,
                text=True,
                timeout=HANG_S,
            )
            assert result.stdout.strip() == "up", result.stderr
        finally:
            server.stop()


def test_power_on_and_cut_over_real_ssh_kill_the_remote_group(sshd, tmp_path):
    (tmp_path / "board").mkdir()
    pids = tmp_path / "board" / "pids 'quoted' $HOME"  # real quoting through ssh and two shells
    switch = ssh_switch(sshd, shlex.join([sys.executable, "-c", FAMILY, str(pids)]), tmp_path, timeout_s=HANG_S)
    switch.reset()  # nothing recorded yet: succeeds and kills nothing
    switch.on()
    assert switch.is_on()
    ((leader, child),) = families(pids, 1)
    assert switch.remote_pid == leader, "the start script execs the payload: its pid is the recorded one"
    assert os.getpgid(leader) == os.getpgid(child) == leader, "sshd made the payload a process-group leader"
    assert psutil.Process(leader).parent().name().startswith("sshd"), "the payload really runs under sshd"
    start_time = Path(f"/proc/{leader}/stat").read_text().rsplit(") ", 1)[1].split()[19]
    assert (tmp_path / "board" / "payload.pid").read_text().split() == [str(leader), start_time]

    switch.off("thermal")
    assert dead(leader) and dead(child), "the cut returned before the payload group was gone"
    assert not switch.is_on() and not (tmp_path / "board" / "payload.pid").exists()

    # A lost connection: sshd does not signal a command without a terminal, so the payload lives
    # on as an orphan. The switch reports the session's end (255) and the cut kills the orphans.
    switch.on()
    ((leader, child),) = families(pids, 2)[1:]
    kill_session_of(leader)
    status = wait_for(switch.poll, HANG_S, what="the end of the ssh session")
    assert status == 255
    assert switch.is_on(), "a lost connection is not a cut: the payload may still run"
    assert not dead(leader) and not dead(child), "orphans of a lost connection survive until the cut"
    switch.off("fdir")
    assert dead(leader) and dead(child)

    # The board stops answering while the payload runs: the cut fails and says so.
    switch.on()
    ((leader, child),) = families(pids, 3)[2:]
    sshd.stop_listener()
    try:
        with pytest.raises(PowerSwitchError, match="could not reach the board, exited 255: .*Connection refused"):
            switch.off("thermal")
        assert switch.is_on() and not dead(leader), "a failed cut changes nothing"
    finally:
        sshd.start()
    switch.off("thermal")
    assert dead(leader) and dead(child) and not switch.is_on()


def test_power_on_kills_what_a_dead_bus_left_and_spares_a_reused_pid(sshd, tmp_path):
    (tmp_path / "board").mkdir()
    pids = tmp_path / "board" / "pids"
    remote = shlex.join([sys.executable, "-c", FAMILY, str(pids)])
    first = ssh_switch(sshd, remote, tmp_path, timeout_s=HANG_S)
    first.on()
    ((leader, child),) = families(pids, 1)
    # The bus that powered `first` is gone without a cut; the next bus's switch powers on.
    second = ssh_switch(sshd, remote, tmp_path, timeout_s=HANG_S)
    second.on()
    assert dead(leader) and dead(child), "the stale payload was killed before a second one started"
    ((new_leader, new_child),) = families(pids, 2)[1:]
    assert not dead(new_leader)
    first.session.kill()  # its local ssh client
    second.off("commanded")
    assert dead(new_leader) and dead(new_child)

    # A pid file whose pid now belongs to another process (a board rebooted with /tmp on disk).
    bystander = subprocess.Popen(["sleep", "600"], start_new_session=True)
    try:
        (tmp_path / "board" / "payload.pid").write_text(f"{bystander.pid} 1\n")
        second.reset()  # the kill script, as a bus runs it at its start
        assert bystander.poll() is None, "a process that reused the recorded pid was killed"
        assert not (tmp_path / "board" / "payload.pid").exists()
    finally:
        bystander.kill()
        bystander.wait()


def test_a_board_that_never_speaks_ssh_is_a_failed_power_on(sshd, tmp_path):
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(4)  # accepts connections (the kernel does) and never sends a banner
    try:
        switch = SshSwitch(
            "sleep 600",
            host="127.0.0.1",
            port=silent.getsockname()[1],
            user=sshd.user,
            identity=str(sshd.client_key),
            ssh_options=sshd.client_options(),
            timeout_s=2,
            output_path=tmp_path / "payload.log",
            pidfile=str(tmp_path / "payload.pid"),
        )
        with pytest.raises(PowerSwitchError, match="did not start within 2 s|exited 255"):
            switch.on()
        assert not switch.is_on() and switch.session is None
    finally:
        silent.close()


# ------------------------------------------------------------------------------ the bus


def ssh_bus_config(sshd: SshServer, tmp_path: Path, trace: Path, payload_command, **overrides) -> BusConfig:
    keys = tmp_path / "keys"
    if not keys.exists():
        init_keys(keys)
    settings = dict(
        trace=str(trace),
        data_dir=tmp_path / "bus",
        keys_dir=keys,
        time_scale=1.0,
        endpoints=Endpoints("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", "tcp://127.0.0.1:*"),
        power_driver="ssh",
        ssh_host="127.0.0.1",
        ssh_port=sshd.port,
        ssh_user=sshd.user,
        ssh_identity=str(sshd.client_key),
        ssh_options=sshd.client_options(),
        ssh_pidfile=str(tmp_path / "board" / "payload.pid"),
        payload_command=payload_command,
        switch_timeout_s=HANG_S,
        boot_timeout_s=0,
        heartbeat_timeout_s=0,
        fdir_off_s=1.0,
    )
    settings.update(overrides)
    (tmp_path / "board").mkdir(exist_ok=True)
    return BusConfig(**settings)


def test_bus_cuts_over_ssh_on_the_trace_and_power_cycles_a_lost_connection(sshd, tmp_path):
    pids = tmp_path / "board" / "pids"
    trace = write_trace(tmp_path / "cuts.jsonl", 300.0, [window(0.0, 2.0), window(3.0, 300.0, None)])
    family = tmp_path / "family.py"
    family.write_text(FAMILY)  # a file: the bus's command template takes {placeholders}
    cfg = ssh_bus_config(sshd, tmp_path, trace, [sys.executable, str(family), str(pids)])
    data = Path(cfg.data_dir)
    bus = BusThread(cfg).start()
    try:
        # the trace's thermal cut at 2 s kills the first boot's group on the board
        wait_log(data, lambda log: kinds(log, bl.POWER_OFF, origin="trace"), "the trace's cut")
        ((leader, child),) = families(pids, 1)
        assert dead(leader) and dead(child)
        # the second window: the connection is killed mid-session
        wait_log(data, lambda log: len(kinds(log, bl.POWER_ON)) >= 2, "the second power-on")
        ((leader, child),) = families(pids, 2)[1:]
        kill_session_of(leader)
        log = wait_log(data, lambda log: kinds(log, bl.POWER_OFF, origin="fdir"), "the FDIR power cycle")
        assert kinds(log, bl.PAYLOAD_EXITED, status=255)
        assert kinds(log, bl.FDIR_ACTION)[0].data["reason"] == "payload process exited by itself with status 255"
        assert dead(leader) and dead(child), "the FDIR cut killed the orphans of the lost connection"
        wait_log(data, lambda log: len(kinds(log, bl.POWER_ON)) >= 3, "power on again after the FDIR off time")
        ((leader, child),) = families(pids, 3)[2:]
    finally:
        bus.stop()
    assert dead(leader) and dead(child), "the bus's shutdown cut the payload"
    log = entries(data)
    assert not kinds(log, bl.SWITCH_ERROR)
    ons, offs = kinds(log, bl.POWER_ON), kinds(log, bl.POWER_OFF)
    assert len(ons) == len(offs) == 3 and all(a.n < b.n for a, b in zip(ons, offs, strict=True)), (
        "never two payloads at once"
    )


def _refused_key(sshd, tmp_path, held):
    return {"ssh_identity": str(sshd.stranger_key)}, "Permission denied (publickey)"


def _unknown_host_key(sshd, tmp_path, held):
    known = tmp_path / "known_hosts"
    other = (sshd.root / "stranger_ed25519.pub").read_text().split()
    known.write_text(f"[127.0.0.1]:{sshd.port} {other[0]} {other[1]}\n")
    options = [f"UserKnownHostsFile={known}", "GlobalKnownHostsFile=/dev/null", "StrictHostKeyChecking=yes"]
    return {"ssh_options": options}, "Host key verification failed"


def _unreachable_port(sshd, tmp_path, held):
    # A port bound and never listened on, held for the whole test: connecting is refused, and no
    # other process can take it meanwhile (a port merely found free was taken by a neighbour's
    # ephemeral socket on a busy machine, and the power-on then met something that answered).
    port = held.enter_context(socket.socket())
    port.bind(("127.0.0.1", 0))
    return {"ssh_port": port.getsockname()[1]}, "Connection refused"


@pytest.mark.parametrize(
    "failure",
    [_refused_key, _unknown_host_key, _unreachable_port],
    ids=["refused-key", "unknown-host-key", "unreachable-port"],
)
def test_a_power_on_that_cannot_reach_the_payload_is_a_switch_error_and_an_fdir_fault(sshd, tmp_path, failure):
    import zmq

    held = contextlib.ExitStack()
    overrides, message = failure(sshd, tmp_path, held)
    trace = write_trace(tmp_path / "on.jsonl", 300.0, [window(0.0, 300.0, None)], telemetry=False)
    cfg = ssh_bus_config(sshd, tmp_path, trace, ["sleep", "600"], **overrides)
    data = Path(cfg.data_dir)
    context = zmq.Context()
    bus = BusThread(cfg).start()
    try:
        from common.wire.link import KeyLayout

        sub = telemetry_subscriber(context, KeyLayout(Path(cfg.keys_dir)), bus.endpoints.telemetry)
        log = wait_log(data, lambda log: len(kinds(log, bl.SWITCH_ERROR, action="on")) >= 2, "two failed power-ons")
        faults = wait_for(
            lambda: [msg for _, msg in drain(sub, 0.5) if isinstance(msg, m.FdirReport) and msg.fault_count >= 2],
            HANG_S,
            what="FDIR telemetry counting the faults",
        )
    finally:
        bus.stop()
        context.destroy(linger=0)
        held.close()
    errors = kinds(log, bl.SWITCH_ERROR, action="on")
    assert all(message in e.data["error"] for e in errors), errors[0].data["error"]
    assert errors[0].data["error"].startswith("ssh power-on to 127.0.0.1 exited 255 before the payload started")
    assert faults[-1].last_fault.startswith("power switch on failed: ssh power-on")
    assert not kinds(entries(data), bl.POWER_ON), "no power-on was reported"


# ------------------------------------------------------------------------------ the real payload


@pytest.mark.slow
def test_real_payload_over_ssh_resumes_bitwise_after_a_lost_connection_and_a_cut(sshd, model_dirs, tmp_path):
    from ground.client import GroundClient, GroundOptions
    from hil.testbench import BenchConfig, RequestSpec, reference_run

    model = model_dirs["qwen3-vl"]
    samples = sorted(str(p) for p in (REPO / "hil" / "samples").glob("*.png"))
    spec = RequestSpec((samples[0], samples[1]), "count the ships near the coast", 12)
    engine = dict(chunk=4, group=2, decode_every=4, vision_every=1)
    reference = reference_run(
        model,
        spec,
        BenchConfig(trace="demo", model=model, out_dir=str(tmp_path), **engine),
        str(tmp_path / "reference"),
    )
    flight_args = [
        "--chunk",
        "4",
        "--group",
        "2",
        "--decode-every",
        "4",
        "--vision-every",
        "1",
        "--threads",
        "1",
        "--pace-ms",
        "200",
        "--device",
        "cpu",
    ]
    # The board's environment comes from its login, not from the bus: say what the payload needs.
    command = [
        "env",
        "OMP_NUM_THREADS=1",
        "HF_HUB_OFFLINE=1",
        "TOKENIZERS_PARALLELISM=false",
        f"OW_CACHE_DIR={os.environ.get('OW_CACHE_DIR', tmp_path / 'cache')}",
        "{python}",
        "-m",
        "common.cli",
        "flight",
        "run",
        "--data-dir",
        "{payload_data_dir}",
        "--model",
        "{model}",
        "--keys",
        "{keys}",
        "--payload-endpoint",
        "{payload_endpoint}",
    ]
    trace = write_trace(tmp_path / "on.jsonl", 600.0, [window(0.0, 600.0, None)])
    cfg = ssh_bus_config(
        sshd,
        tmp_path,
        trace,
        command,
        model=model,
        flight_args=flight_args,
        payload_data_dir=str(tmp_path / "board" / "payload data's"),
        heartbeat_timeout_s=60.0,
        boot_timeout_s=HANG_S,
    )
    data = Path(cfg.data_dir)
    payload_log = data / "payload.log"

    def progress_after(log, power_ons: int, phase: str | None = None) -> bool:
        start = kinds(log, bl.POWER_ON)[power_ons - 1].n if len(kinds(log, bl.POWER_ON)) >= power_ons else None
        return start is not None and any(
            e.n > start
            and e.data.get("type") == "PROGRESS"
            and (phase is None or e.data.get("phase") == phase)
            and e.data.get("done", 0) >= 2
            for e in kinds(log, bl.PAYLOAD_REPORT)
        )

    bus = BusThread(cfg).start()
    try:
        with GroundClient(
            str(cfg.keys_dir),
            GroundOptions(endpoints=bus.endpoints, timeout_s=15.0, retries=100, progress=False, notify=lambda s: None),
        ) as ground:
            ground.uplink(list(spec.images), spec.prompt, max_new_tokens=spec.max_new_tokens, task_id="s1")
            # Mid-prefill, the connection to the board is killed: the bus sees the session end,
            # cuts over a new connection (the remote group killed) and powers the payload again.
            wait_log(data, lambda log: progress_after(log, 1, "prefill"), "prefill progress in boot 1")
            first = marker_pids(payload_log)[0]
            kill_session_of(first)
            wait_log(data, lambda log: kinds(log, bl.POWER_OFF, origin="fdir"), "the FDIR cut")
            assert not group_members(first), "the payload of the lost connection survived the cut"
            result = ground.result("s1", wait=True, max_wait_s=600, poll_s=5)
    finally:
        bus.stop()
        for pid in marker_pids(payload_log):  # nothing of a failed run lives on
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    assert list(result.token_ids) == reference["token_ids"]
    assert bytes(result.logits_sha256).hex() == reference["logits_sha256"]
    assert result.interruptions == 1, "the task ran in two boots"
    # the one restart, kept by the engine in the task's records: it resumed in prefill
    assert result.recoveries is not None and [phase for _, phase, _ in result.recoveries] == ["prefill"]
    assert result.written_bytes is not None and result.written_bytes > 0
    log = entries(data)
    assert kinds(log, bl.PAYLOAD_EXITED, status=255) and not kinds(log, bl.SWITCH_ERROR)
    events = [e.data.get("text", "") for e in kinds(log, bl.PAYLOAD_REPORT) if e.data.get("type") == "EVENT"]
    assert any(text.startswith("task s1 resumes in prefill at ") for text in events), events
    assert len(marker_pids(payload_log)) == 2 and not any(group_members(p) for p in marker_pids(payload_log))
