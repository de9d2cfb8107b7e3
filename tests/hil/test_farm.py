"""Acceptance: a campaign on a bench farm -- a real two-node Ray cluster on this machine, one bench
per node -- with the worker node killed mid-campaign.

The head node drives one local bench; the worker node drives one local bench declared in its bench
file (OW_BENCHES). `ow hil campaign --cluster` runs a matrix of four short runs (the tiny model, the paper's two
requests each, a trace with one early cut). Once a run has finished on the worker and the worker's next run has
its bus up, the worker node is killed (SIGKILL to its whole process tree, the runs' buses and
payloads with it). The campaign completes on the head's bench: every run counted once, the lost
one run again and the report saying why, every output bitwise; the report and campaign.json
equal a local campaign's of the same matrix apart from what the clock decides (times, and where a
cut lands in the work: units lost, bytes written). No timed asserts: every wait is a hang guard
that says what it waits for.
"""

import json
import os
import re
import subprocess
import sys
import tempfile
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


def _ray_node(tmp, short, name, ip, resources, *, head_port=None, gcs=None, env=None):
    """A `ray start --block` node in its own session; its process tree is the node. Its temp dir
    is under a short path: Ray's unix socket paths must stay under 108 bytes."""
    nm, om, agent_grpc, agent_http, metrics, rt_env = free_ports(6)
    args = [
        os.path.join(os.path.dirname(sys.executable), "ray"),
        "start",
        "--block",
        "--disable-usage-stats",
        f"--node-ip-address={ip}",
        "--num-cpus=1",
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
        (client_port,) = free_ports(1)
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


# One worker runs every test that starts a Ray cluster (make test runs --dist loadgroup): two
# clusters at once would share this machine's cores and loopback.
@pytest.mark.slow
@pytest.mark.xdist_group("ray-cluster")
def test_campaign_on_two_ray_nodes_survives_losing_one(model_dirs, tmp_path):
    from hil.campaign import RUN_RECORD, run_campaign
    from hil.testbench import BenchConfig, default_workload

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
    (gcs_port,) = free_ports(1)
    head = worker = campaign = None
    try:

        def start_head():
            return _ray_node(tmp_path, short, "head", HEAD_IP, {"bench": 1}, head_port=gcs_port)

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

        matrix = ["--traces", trace, "--policies", "orbitweaver,none", "--cadences", "fixed", "--seeds", "0,1"]
        matrix += ["--workloads", "paper", "--requests", "1", "--max-new-tokens", "12", "--time-scale", "1"]
        matrix += ["--pace-ms", "80", "--boot-trace-s", "1", "--model", model, "--log-level", "warning"]
        farm_out = tmp_path / "farm"
        log_path = tmp_path / "campaign.log"
        campaign = subprocess.Popen(
            [sys.executable, "-m", "common.cli", "hil", "campaign", *matrix, "--out", str(farm_out)]
            + ["--cluster", f"{HEAD_IP}:{gcs_port}", "--node-ip-address", HEAD_IP],
            cwd=REPO,
            env={**os.environ, **RAY_ENV},
            stdout=open(log_path, "w"),
            stderr=subprocess.STDOUT,
        )

        def said() -> list[str]:
            return log_path.read_text().splitlines()

        # Kill the worker once one of its runs has finished and the next one has its bus up there.
        deadline = time.time() + 400
        on_worker = f"on node {WORKER_IP}"
        while time.time() < deadline:
            assert campaign.poll() is None, f"the campaign ended before the worker was killed:\n{log_path.read_text()}"
            finished_there = [i for i, line in enumerate(said()) if " done: " in line and on_worker in line]
            started_there = [i for i, line in enumerate(said()) if " starting" in line and on_worker in line]
            if finished_there and started_there and started_there[-1] > finished_there[0]:
                if list(worker_scratch.glob("runs/*/bus/bus-log.jsonl")):
                    break
            time.sleep(0.2)
        else:
            raise AssertionError(f"no second run under way on the worker (hang guard 400 s):\n{log_path.read_text()}")
        kill_tree(worker)
        worker = None
        phase("worker node killed mid-run")
        assert campaign.wait(timeout=400) == 0, log_path.read_text()  # hang guard
        phase("campaign done on the bench farm")
        text = log_path.read_text()

        # every run counted once: four done, four records, one run lost and run again on the head
        assert sum(" done: " in line for line in said()) == 4, text
        assert len(list(farm_out.glob(f"runs/*/{RUN_RECORD}"))) == 4
        data = json.loads((farm_out / "campaign.json").read_text())
        rows = data["rows"]
        assert len(rows) == 4 and len({(r["seed"], r["policy"]) for r in rows}) == 4
        assert {r["bench"].rsplit(" ", 1)[-1] for r in rows} == {HEAD_IP, WORKER_IP}, "runs finished on both nodes"
        again = [r for r in rows if r["run_again_because"]]
        assert len(again) == 1, rows
        assert again[0]["bench"] == f"bench local-1 on node {HEAD_IP}"
        assert f"bench w1 on node {WORKER_IP} was lost" in again[0]["run_again_because"][0], again
        report = (farm_out / "report.md").read_text()
        assert "## Bench farm" in report and f"bench w1 on node {WORKER_IP} was lost" in report
        # every output bitwise, every run cut once and finished
        assert all(r["correct"] and r["completed"] == "2/2" and r["cuts"] == 1 for r in rows), rows

        # a driver started again with --resume keeps every finished run, where it ran and why it
        # ran again included, and runs none of them twice
        logs = {p: p.stat().st_mtime_ns for p in farm_out.glob("runs/*/bus/bus-log.jsonl")}
        again_cmd = [sys.executable, "-m", "common.cli", "hil", "campaign", *matrix, "--out", str(farm_out)]
        again_cmd += ["--cluster", f"{HEAD_IP}:{gcs_port}", "--node-ip-address", HEAD_IP, "--resume"]
        resumed = subprocess.run(again_cmd, cwd=REPO, env={**os.environ, **RAY_ENV}, capture_output=True, text=True,
                                 timeout=300)  # fmt: skip
        assert resumed.returncode == 0, resumed.stdout + resumed.stderr
        assert "4 kept from an earlier campaign, 0 to run" in resumed.stdout and " starting" not in resumed.stdout
        assert {p: p.stat().st_mtime_ns for p in logs} == logs
        assert json.loads((farm_out / "campaign.json").read_text())["rows"] == rows
        assert f"bench w1 on node {WORKER_IP} was lost" in (farm_out / "report.md").read_text()

        # the same matrix on this machine
        local_out = tmp_path / "local"
        base = BenchConfig(
            trace=trace,
            model=model,
            out_dir=str(local_out),
            requests=1,
            workload=default_workload(1, 12),
            time_scale=1.0,
            pace_ms=80,
            boot_trace_s=1.0,
        )
        run_campaign(base, [trace], ["orbitweaver", "none"], [0, 1], say=lambda line: None, workloads=["paper"],
                     cadences=["fixed"], jobs=2)  # fmt: skip
        phase("the same campaign on this machine")
        assert _comparable(farm_out) == _comparable(local_out)
    finally:
        if campaign is not None and campaign.poll() is None:
            campaign.kill()
            campaign.wait(timeout=60)
        for proc in (worker, head):
            if proc is not None:
                kill_tree(proc)
        import shutil

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
            with claim_bench(node):
                pass
    with claim_bench(node) as again:  # freed when its run ended
        assert again.name == "b1"


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
