"""Acceptance: a campaign on a bench farm -- a real two-node Ray cluster on this machine, one bench
per node -- that loses its worker node, then its driver, mid-campaign.

The head node drives one local bench (no bench file: `local-1`); the worker node drives one local
bench declared in its bench file (OW_BENCHES). `ow hil campaign --cluster` runs a matrix of four
short runs (the tiny model, the paper's two requests each, a trace with one early cut).

1. Once a run has finished on the worker and the worker's next run has its bus up, the worker
   node is killed (SIGKILL to its whole process tree, the runs' buses and payloads with it): its
   run goes out again to the head's bench.
2. Once that run has its bus up on the head, the driver is killed (SIGKILL).
3. The same command with --resume keeps every run the first driver finished (untouched) and runs
   the rest, each once; the run the worker lost is still reported as run again, and why.

Every run counted once, every output bitwise; the report and campaign.json equal those of a
local campaign of the same matrix (run beside the farm once the worker is gone) apart from what the
clock decides (times, and where a cut lands in the work: units lost, bytes written). No timed
asserts: every wait is a hang guard that says what it waits for.
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
from raykit import await_node, kill_tree, wait_listening
from testkit import free_ports, short_trace

pytest.importorskip("ray", reason="Ray is in the test extra; `make venv` installs it")


REPO = Path(__file__).resolve().parents[2]
# Each node its own loopback address (Ray turns 127.0.0.1 into the machine's routable address);
# not the VLA cluster test's.
HEAD_IP, WORKER_IP = "127.0.0.4", "127.0.0.5"
RAY_ENV = {
    "RAY_USAGE_STATS_ENABLED": "0",
    # a killed node is declared dead within seconds, not the default half a minute
    "RAY_health_check_period_ms": "1000",
    "RAY_health_check_failure_threshold": "5",
    "OMP_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "HF_HUB_OFFLINE": "1",
    # the nodes' workers import the code under test, as the driver does
    "PYTHONPATH": str(REPO),
}
#: what the clock decides in a run on a loaded machine (where the cut lands in the work too)
TIMED = {"e2e_trace_s", "recovery_s", "lost_units", "mib_written", "energy_j", "wall_s", "start_residual_s"}
#: a hang guard for each wait below (none of them is a timing under test)
GUARD_S = 400


def _ray_node(tmp, short, name, ip, resources, *, head_port=None, gcs=None, env=None):
    """A `ray start --block` node in its own session; its process tree is the node. Its temp dir
    is under a short path: Ray's unix socket paths must stay under 108 bytes. Lean: one CPU, a
    small object store, no dashboard, no log monitor (the drivers do not print the workers' logs)."""
    # Every port in one pick (free_ports holds them all at once, so they differ), the head's own
    # port left out: two picks could hand one port to two of Ray's components, and Ray refuses to start.
    ports = [port for port in free_ports(8) if port != head_port][:7]
    nm, om, agent_grpc, agent_http, metrics, rt_env, client_port = ports
    args = [
        os.path.join(os.path.dirname(sys.executable), "ray"),
        "start",
        "--block",
        "--disable-usage-stats",
        f"--node-ip-address={ip}",
        "--num-cpus=1",
        f"--object-store-memory={100 * 2**20}",
        "--include-log-monitor=false",
        f"--resources={json.dumps(resources)}",
        f"--temp-dir={short}/{name}",
        f"--node-manager-port={nm}",
        f"--object-manager-port={om}",
        f"--dashboard-agent-grpc-port={agent_grpc}",
        f"--dashboard-agent-listen-port={agent_http}",
        f"--metrics-export-port={metrics}",
        f"--runtime-env-agent-port={rt_env}",
    ]
    if head_port:
        args += [
            "--head",
            f"--port={head_port}",
            "--include-dashboard=false",
            f"--ray-client-server-port={client_port}",
        ]
    else:
        args += [f"--address={gcs}"]
    log = open(tmp / f"{name}.log", "w")
    return subprocess.Popen(
        args,
        cwd=REPO,
        env={**os.environ, **RAY_ENV, **(env or {})},
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def _comparable(out: Path) -> tuple[list[dict], list[str]]:
    """A campaign's rows and report lines without what the clock decides and where runs ran."""
    rows = [
        {k: v for k, v in row.items() if k not in TIMED | {"bench", "run_again_because"}}
        for row in json.loads((out / "campaign.json").read_text())["rows"]
    ]
    report = (out / "report.md").read_text()
    if "## Bench farm" in report:  # the farm's own section, up to the next one
        before, _, after = report.partition("## Bench farm")
        report = before + after[after.index("\n## ") + 1 :]
    lines = []
    header: list[str] = []
    for line in report.splitlines():
        if not line.startswith("|"):
            header = []
        elif not header:
            header = line.strip("|").split(" | ")
        elif not line.startswith("|---"):
            cells = [c.strip() for c in line.strip("|").split(" | ")]
            # timed columns, and the summary's mean end-to-end times ("4/4 (100%), 8 s")
            cells = [
                "~" if _timed_column(name) else re.sub(r", \d+ s$", ", ~ s", c)
                for name, c in zip(header, cells, strict=True)
            ]
            line = "| " + " | ".join(cells) + " |"
        lines.append(line)
    return sorted(rows, key=json.dumps), lines


def _timed_column(name: str) -> bool:
    return any(word in name for word in ("e2e", "recovery", "units lost", "MiB", "start-up", "wall", "ratio"))


def _finished_here(log: Path) -> set[str]:
    """The runs a driver ran to their end (not those it kept from an earlier one)."""
    return set(re.findall(r" done: (.*) \(finished", log.read_text()))


def _await(what: str, ready, *, alive=(), log: Path | None = None) -> None:
    """Wait until ready() (a hang guard of GUARD_S, saying what it waited for); each process of
    `alive` must still run meanwhile."""
    deadline = time.time() + GUARD_S
    while not ready():
        for proc in alive:
            assert proc.poll() is None, f"ended while waiting for {what}:\n{log.read_text() if log else ''}"
        if time.time() > deadline:
            raise AssertionError(f"no {what} (hang guard {GUARD_S} s):\n{log.read_text() if log else ''}")
        time.sleep(0.2)


# One worker runs every test that starts a Ray cluster (make test runs --dist loadgroup): two
# clusters at once would share this machine's cores and loopback.
@pytest.mark.slow
@pytest.mark.xdist_group("ray-cluster")
def test_farm_campaign_survives_losing_a_node_then_its_driver(model_dirs, tmp_path):
    from hil.campaign import RUN_RECORD
    from hil.farm import LOST_NOTE

    t0 = time.time()

    def phase(name):
        print(f"[{time.time() - t0:6.1f} s] {name}", flush=True)

    trace = short_trace(tmp_path / "short.jsonl")
    model = model_dirs["qwen3-vl"]
    short = tempfile.mkdtemp(prefix="owfarm-", dir="/tmp")
    worker_scratch = Path(short) / "worker-benches"
    (tmp_path / "benches.json").write_text(
        json.dumps(
            {
                "format": "orbitweaver.benches/1",
                "scratch": str(worker_scratch),
                "benches": [{"name": "w1", "switch": {"power_driver": "local"}}],
            }
        )
    )
    matrix = ["--traces", trace, "--policies", "orbitweaver,none", "--cadences", "fixed", "--seeds", "0,1"]
    matrix += ["--workloads", "paper", "--requests", "1", "--max-new-tokens", "12", "--time-scale", "1"]
    matrix += ["--pace-ms", "80", "--boot-trace-s", "1", "--model", model, "--log-level", "warning"]
    cli = [sys.executable, "-m", "common.cli", "hil", "campaign", *matrix]
    farm_out, local_out = tmp_path / "farm", tmp_path / "local"
    (gcs_port,) = free_ports(1)
    farm_cmd = [*cli, "--out", str(farm_out), "--cluster", f"{HEAD_IP}:{gcs_port}", "--node-ip-address", HEAD_IP]
    env = {**os.environ, **RAY_ENV}
    head = worker = driver = local = None
    try:

        def start_head():
            # the head's default scratch (tempfile's) under the test's own temp dir
            return _ray_node(tmp_path, short, "head", HEAD_IP, {"bench": 1}, head_port=gcs_port, env={"TMPDIR": short})

        def start_worker():
            return _ray_node(
                tmp_path,
                short,
                "worker",
                WORKER_IP,
                {"bench": 1},
                gcs=f"{HEAD_IP}:{gcs_port}",
                env={"OW_BENCHES": str(tmp_path / "benches.json")},
            )

        head = start_head()
        wait_listening(HEAD_IP, gcs_port, head)  # the worker starts as soon as the head's GCS listens
        worker = start_worker()
        head = await_node(tmp_path, "head", head, start_head)
        worker = await_node(tmp_path, "worker", worker, start_worker)
        phase("two nodes up")

        log1 = tmp_path / "driver-1.log"
        driver = subprocess.Popen(farm_cmd, cwd=REPO, env=env, stdout=open(log1, "w"), stderr=subprocess.STDOUT)

        def said() -> list[str]:
            return log1.read_text().splitlines()

        # 1. Kill the worker once one of its runs has finished and the next one has its bus up there.
        on_worker = f"on node {WORKER_IP}"

        def second_run_under_way_on_worker() -> bool:
            finished_there = [i for i, line in enumerate(said()) if " done: " in line and on_worker in line]
            started_there = [i for i, line in enumerate(said()) if " starting" in line and on_worker in line]
            return bool(
                finished_there
                and started_there
                and started_there[-1] > finished_there[0]
                and list(worker_scratch.glob("runs/*/*/bus/bus-log.jsonl"))
            )

        _await("second run under way on the worker", second_run_under_way_on_worker, alive=[driver], log=log1)
        kill_tree(worker)
        worker = None
        phase("worker node killed mid-run")
        # The same matrix on this machine, all four runs at once (they are paced: they mostly
        # sleep), beside the rest of the farm campaign, which has only the head's bench left: its
        # starts would slow the farm's first runs on two cores.
        local_log = tmp_path / "local.log"
        local = subprocess.Popen([*cli, "--out", str(local_out), "--jobs", "4"], cwd=REPO, env=env,
                                 stdout=open(local_log, "w"), stderr=subprocess.STDOUT)  # fmt: skip

        # 2. Kill the driver once the worker's lost run runs again, its bus up, on the head.
        def lost_run_under_way_on_head() -> bool:
            return any("run starting again" in line for line in said()) and bool(
                list(Path(short).glob("orbitweaver-farm-*/runs/*/*/bus/bus-log.jsonl"))
            )

        _await("lost run under way again on the head", lost_run_under_way_on_head, alive=[driver], log=log1)
        driver.send_signal(signal.SIGKILL)
        driver.wait(timeout=60)
        driver = None
        phase("driver killed mid-run")
        first = _finished_here(log1)
        assert len(first) >= 2 and any(on_worker in line and " done: " in line for line in said()), log1.read_text()
        kept_logs = {p: p.stat().st_mtime_ns for p in farm_out.glob("runs/*/bus/bus-log.jsonl")}
        assert len(list(farm_out.glob(f"runs/*/{RUN_RECORD}"))) == len(first) == len(kept_logs)

        # 3. The same command with --resume: the finished runs kept as they are, the rest run once.
        resumed = subprocess.run([*farm_cmd, "--resume"], cwd=REPO, env=env, capture_output=True, text=True,
                                 timeout=GUARD_S)  # fmt: skip
        (tmp_path / "driver-2.log").write_text(resumed.stdout + resumed.stderr)
        phase("campaign resumed and done on the bench farm")
        text = resumed.stdout
        assert resumed.returncode == 0, text + resumed.stderr
        assert f"{len(first)} kept from an earlier campaign, {4 - len(first)} to run" in text, text
        second = _finished_here(tmp_path / "driver-2.log")
        assert len(second) == 4 - len(first) and not first & second, (first, second)  # each run once
        assert len(re.findall(r"run \d+/\d+ starting: ", text)) == len(second) and "starting again" not in text
        assert {p: p.stat().st_mtime_ns for p in kept_logs} == kept_logs, "a kept run was touched"

        assert len(list(farm_out.glob(f"runs/*/{RUN_RECORD}"))) == 4 and not list(farm_out.glob(f"runs/*/{LOST_NOTE}"))
        rows = json.loads((farm_out / "campaign.json").read_text())["rows"]
        assert len(rows) == 4 and len({(r["seed"], r["policy"]) for r in rows}) == 4
        assert {r["bench"].rsplit(" ", 1)[-1] for r in rows} == {HEAD_IP, WORKER_IP}, "runs finished on both nodes"
        # the run the worker lost: run again on the head, and why -- though a second driver finished it
        again = [r for r in rows if r["run_again_because"]]
        assert len(again) == 1, rows
        assert again[0]["bench"] == f"bench local-1 on node {HEAD_IP}"
        assert f"bench w1 on node {WORKER_IP} was lost" in again[0]["run_again_because"][0], again
        report = (farm_out / "report.md").read_text()
        assert "## Bench farm" in report and f"bench w1 on node {WORKER_IP} was lost" in report
        # every output bitwise, every run cut once and finished
        assert all(r["correct"] and r["completed"] == "2/2" and r["cuts"] == 1 for r in rows), rows

        assert local.wait(timeout=GUARD_S) == 0, local_log.read_text()  # hang guard
        local = None
        phase("the same campaign on this machine done")
        (farm_rows, farm_report), (local_rows, local_report) = _comparable(farm_out), _comparable(local_out)
        assert farm_rows == local_rows, f"campaign.json rows differ:\nfarm  {farm_rows}\nlocal {local_rows}"
        assert farm_report == local_report
    finally:
        for proc in (driver, local):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(timeout=60)
        for proc in (worker, head):
            if proc is not None:
                kill_tree(proc)
        shutil.rmtree(short, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.xdist_group("ray-cluster")
def test_a_farm_bench_behind_an_ssh_switch_runs_a_campaign_run(model_dirs, tmp_path):
    """A bench node whose bench is a board behind an SSH switch (a real sshd on this machine, as
    tests/bus/test_bus_ssh_sshd.py builds it): a one-node farm runs one campaign run there, the
    payload started and cut over SSH, with the real boot (`--boot-trace-s real`)."""
    from tests.bus.sshd_testkit import SshServer, find_sshd, install_openssh_server

    reason = install_openssh_server()
    if reason is not None:
        pytest.skip(f"no OpenSSH server for the SSH bench: {reason}")
    short = tempfile.mkdtemp(prefix="owfssh-", dir="/tmp")
    sshd = SshServer(Path(short) / "sshd", find_sshd()).start()
    # the board's environment is its login's: the payload's command says what it needs
    payload = ["env", f"PYTHONPATH={REPO}", "OMP_NUM_THREADS=1", "HF_HUB_OFFLINE=1", "TOKENIZERS_PARALLELISM=false"]
    if os.environ.get("OW_CACHE_DIR"):
        payload.append(f"OW_CACHE_DIR={os.environ['OW_CACHE_DIR']}")
    payload += ["{python}", "-m", "common.cli", "flight", "run", "--data-dir", "{payload_data_dir}", "--model",
                "{model}", "--keys", "{keys}", "--payload-endpoint", "{payload_endpoint}"]  # fmt: skip
    switch = {
        "power_driver": "ssh",
        "ssh_host": "127.0.0.1",
        "ssh_port": sshd.port,
        "ssh_user": sshd.user,
        "ssh_identity": str(sshd.client_key),
        "ssh_options": sshd.client_options(),
        "ssh_pidfile": f"{short}/board/payload.pid",
        "payload_command": payload,
        "switch_timeout_s": GUARD_S,
    }
    Path(short, "board").mkdir()
    benches = _bench_file(tmp_path, [{"name": "jetson-ssh", "switch": switch}], scratch=f"{short}/benches")
    # The campaign tests' trace: one early cut, before the request can end -- with the real boot,
    # most likely while the payload boots for the first time -- which may take the answer to a
    # command of the ground's uplink with it. The bus holds skip-idle until the ground has asked again and heard
    # (docs/bus.md §1 "Skipping idle spans"); it used to find the new boot idle and skip to the
    # trace's end before the ground's re-sent uplink arrived.
    trace = short_trace(tmp_path / "short.jsonl")
    (gcs_port,) = free_ports(1)
    head = None
    try:

        def start_head():
            return _ray_node(tmp_path, short, "head", HEAD_IP, {"bench": 1}, head_port=gcs_port,
                             env={"OW_BENCHES": str(benches)})  # fmt: skip

        head = await_node(tmp_path, "head", start_head(), start_head)
        out = tmp_path / "farm"
        cmd = [sys.executable, "-m", "common.cli", "hil", "campaign", "--traces", trace, "--policies", "orbitweaver"]
        cmd += ["--cadences", "fixed", "--seeds", "0", "--workloads", "paper", "--requests", "1"]
        cmd += ["--max-new-tokens", "12"]
        cmd += ["--time-scale", "1", "--pace-ms", "80", "--boot-trace-s", "real", "--model", model_dirs["qwen3-vl"]]
        cmd += ["--log-level", "warning", "--out", str(out), "--cluster", f"{HEAD_IP}:{gcs_port}"]
        cmd += ["--node-ip-address", HEAD_IP]
        done = subprocess.run(cmd, cwd=REPO, env={**os.environ, **RAY_ENV}, capture_output=True, text=True,
                              timeout=GUARD_S)  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr
        (row,) = json.loads((out / "campaign.json").read_text())["rows"]
        assert row["bench"] == f"bench jetson-ssh on node {HEAD_IP}", row
        assert row["correct"] and row["completed"] == "2/2" and row["cuts"] == 1, row
        run_dir = next(out.glob("runs/*/bus"))
        start = json.loads((run_dir / "bus-log.jsonl").read_text().splitlines()[0])
        assert start["switch"]["driver"] == "ssh" and start["switch"]["host"] == "127.0.0.1", start["switch"]
        # the payload ran in an SSH session of the board: it printed the switch's start marker there
        assert "==== payload boot 1 via ssh" in (run_dir / "payload.log").read_text()
        assert "Accepted publickey" in sshd.log.read_text(), sshd.log_tail()
    finally:
        if head is not None:
            kill_tree(head)
        sshd.stop()
        shutil.rmtree(short, ignore_errors=True)


def _bench_file(tmp_path, benches, **extra):
    path = tmp_path / "benches.json"
    path.write_text(json.dumps({"format": "orbitweaver.benches/1", "scratch": str(tmp_path / "s"), **extra,
                                "benches": benches}))  # fmt: skip
    return path


def test_a_bench_file_is_checked_before_any_run(tmp_path):
    from hil.farm import FarmError, read_bench_file

    ssh = {"name": "j1", "switch": {"power_driver": "ssh", "ssh_host": "10.0.0.11"}, "payload_bind": "tcp://10.0.0.1:*"}
    node = read_bench_file(_bench_file(tmp_path, [ssh, {"name": "l1"}]))
    assert [(b.name, b.local_switch) for b in node.benches] == [("j1", False), ("l1", True)]
    assert node.benches[0].switch["ssh_host"] == "10.0.0.11" and node.scratch == tmp_path / "s"
    for benches, fragment in (
        ([], "at least one bench"),
        ([{"switch": {}}], "bench 0 needs a `name`"),
        ([{"name": "a", "switch": {"power_drive": "local"}}], "unknown switch option(s) ['power_drive']"),
        ([{"name": "a", "switch": {"power_driver": "ssh"}}], "--power-driver ssh needs --ssh-host"),
        ([{"name": "a", "switch": {"power_driver": "relay"}}], "unknown power driver 'relay'"),
        ([{"name": "a"}, {"name": "a"}], "bench names must differ"),
    ):
        with pytest.raises(FarmError, match=re.escape(fragment)):
            read_bench_file(_bench_file(tmp_path, benches))
    (tmp_path / "benches.json").write_text('{"format": "something/else", "benches": []}')
    with pytest.raises(FarmError, match="not an orbitweaver.benches/1 file"):
        read_bench_file(tmp_path / "benches.json")


def test_each_bench_runs_one_run_at_a_time(tmp_path):
    from hil.farm import Bench, FarmError, NodeBenches, claim_bench

    node = NodeBenches([Bench("b1"), Bench("b2")], tmp_path)
    with claim_bench(node) as first, claim_bench(node) as second:
        assert {first.name, second.name} == {"b1", "b2"}
        with pytest.raises(FarmError, match=r"every bench of this node is busy \(b1, b2\)"):
            with claim_bench(node, wait_s=0.5):
                pass
    with claim_bench(node) as again:  # freed when its run ended
        assert again.name == "b1"


def test_a_bench_a_dead_run_still_holds_is_waited_for(tmp_path):
    """A worker killed with its run (its driver died) holds its bench's lock until it is gone: the
    next run Ray sends that bench waits for it rather than failing."""
    from hil.farm import Bench, NodeBenches, claim_bench

    node = NodeBenches([Bench("b1")], tmp_path)
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, sys, time; f = open(sys.argv[1], 'w'); "
         "fcntl.flock(f, fcntl.LOCK_EX); print('held', flush=True); time.sleep(600)", str(tmp_path / "bench-b1.lock")],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline() == "held\n"
        threading.Timer(0.5, holder.kill).start()  # the dead run's worker, killed a moment later
        with claim_bench(node, wait_s=GUARD_S) as bench:  # hang guard
            assert bench.name == "b1"
    finally:
        holder.kill()
        holder.wait()


def test_campaign_cluster_options_are_checked(tmp_path, capsys):
    import structlog

    from common.cli import main

    base = ["hil", "campaign", "--traces", "demo", "--out", str(tmp_path / "out")]
    try:
        assert main([*base, "--cluster", "127.0.0.1:1", "--jobs", "2"]) == 2
        assert "with --cluster each bench runs one run at a time" in capsys.readouterr().err
        assert main([*base, "--node-ip-address", "127.0.0.1"]) == 2
        assert "--node-ip-address goes with --cluster" in capsys.readouterr().err
    finally:
        structlog.reset_defaults()  # the command points structlog at the captured stderr
    assert not (tmp_path / "out").exists()
