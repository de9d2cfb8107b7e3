"""A bench farm: a campaign's runs spread over the test benches of a Ray cluster (docs/hil.md
"Bench farm").

A bench is a payload board behind its own power switch, with the host that runs its bus. Each
host that drives benches is a Ray node offering one unit of the custom resource `bench` per bench
(`ray start --resources '{"bench": 4}'`), and says how to reach their switches in its bench file
(`OW_BENCHES`, format below); without one, its benches are this host's own processes (the local
switch). One driver -- `ow hil campaign --cluster ADDRESS` or `python -m bench.run_all --cluster
ADDRESS` -- runs the campaign as on one machine (hil/campaign.py: the same plan, kept runs,
records, report and validation); only where a run runs differs (`BenchFarm`, a
`campaign.RunExecutor`):

- each run is a Ray task that needs one `bench` and streams back two things: where it started
  (bench and node), then its report and its whole run directory, unpacked into OUT/runs/<run>;
- the driver hands out runs longest expected first (LPT, the lengths from the lifecycle
  simulator: hil/sim/plan.py), never more at once than the cluster has benches; the campaigns
  of one driver (make bench's two end-to-end parts) share one queue (`SharedQueue`), and each
  result goes back into its own campaign;
- the model directory, the traces and the request images travel (once per node, through Ray's
  object store, kept by content digest); the code does not: every node runs the same build, and a
  node whose Python sources differ from the driver's refuses to run (`code_fingerprint`);
- a run whose node dies under it (or whose worker crashes) runs again on another bench; the first
  run that finishes is the one recorded, so every run counts once, and the report says which runs
  ran again and why;
- a driver that dies (or is stopped) resumes with --resume as on one machine: Ray kills the
  dead driver's tasks, the runs whose records came back are kept, and why a run's tries were lost
  is kept in its directory (LOST_NOTE) until it finishes, for the driver that finishes it.

The bench file (JSON), named by the node's OW_BENCHES when it starts:

    {"format": "orbitweaver.benches/1",
     "scratch": "/var/lib/orbitweaver/farm",          (optional: where runs and shipped files go)
     "benches": [
       {"name": "jetson-01", "switch": {"power_driver": "ssh", "ssh_host": "10.0.0.11", ...},
        "payload_bind": "tcp://10.0.0.1:*"},
       {"name": "jetson-02", "switch": {"power_driver": "command", "power_on_command": "...",
                                        "power_off_command": "..."}}]}

`switch` takes the bus's power-switch options (`SWITCH_FIELDS`, docs/bus.md §3 and §8);
`payload_bind` is where the bus binds the payload link, an address the board reaches.
"""

from __future__ import annotations

import fcntl
import hashlib
import heapq
import io
import itertools
import json
import logging
import os
import shutil
import tarfile
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import traces
from hil.campaign import SEED_TRACE_DIR, Finished, PlannedRun, RunExecutor, RunOutcome, Started, _config_key
from hil.testbench import BenchConfig, BenchReport, BenchSetup, Testbench

#: the custom Ray resource a node offers once per bench it drives
BENCH_RESOURCE = "bench"
#: the node's environment variable naming its bench file
BENCHES_ENV = "OW_BENCHES"
BENCH_FILE_FORMAT = "orbitweaver.benches/1"
#: the bus's power-switch options a bench file may set (hil/bus/config.py BusConfig)
SWITCH_FIELDS = (
    "power_driver",
    "payload_command",
    "payload_data_dir",
    "payload_keys_dir",
    "payload_connect_endpoint",
    "ssh_host",
    "ssh_user",
    "ssh_port",
    "ssh_identity",
    "ssh_options",
    "ssh_transport",
    "ssh_mode",
    "ssh_pidfile",
    "ssh_kill_command",
    "ssh_reboot_command",
    "power_on_command",
    "power_off_command",
    "switch_timeout_s",
)
#: a run lost this many times under way (its node died, its worker crashed) stops the campaign:
#: something other than one bad board is wrong
MAX_LOST = 3
#: how long a run waits for a bench of its node that a dead run still holds (`claim_bench`)
CLAIM_WAIT_S = 60.0
#: in a run's directory on the driver (OUT/runs/<run>/), while the run has not finished: why its
#: tries so far were lost, so that a driver started again with --resume still reports them
LOST_NOTE = "farm-lost.json"
#: the packages whose sources make a build (`code_fingerprint`)
CODE_PACKAGES = ("common", "flight", "ground", "hil", "traces")


class FarmError(RuntimeError):
    """The bench farm cannot run the campaign (no benches, a node with other code, a bad bench
    file, a run lost again and again)."""


# ---- a node's benches ----------------------------------------------------------------------------


@dataclass
class Bench:
    name: str
    switch: dict[str, Any] = field(default_factory=dict)
    payload_bind: str | None = None

    @property
    def local_switch(self) -> bool:
        return self.switch.get("power_driver", "local") == "local"


@dataclass
class NodeBenches:
    benches: list[Bench]
    scratch: Path


def read_bench_file(path: str | os.PathLike) -> NodeBenches:
    """A node's bench file, checked (FarmError saying what is wrong)."""
    from hil.bus.config import BusConfig, BusConfigError

    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise FarmError(f"bench file {path}: {exc}") from None
    if not isinstance(doc, dict) or doc.get("format") != BENCH_FILE_FORMAT:
        raise FarmError(f"bench file {path}: not an {BENCH_FILE_FORMAT} file (its `format`)")
    entries = doc.get("benches")
    if not isinstance(entries, list) or not entries:
        raise FarmError(f"bench file {path}: `benches` must list at least one bench")
    benches = []
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str) or not entry["name"]:
            raise FarmError(f"bench file {path}: bench {i} needs a `name`")
        switch = entry.get("switch") or {}
        if not isinstance(switch, dict) or (unknown := set(switch) - set(SWITCH_FIELDS)):
            raise FarmError(
                f"bench file {path}: bench {entry['name']}: unknown switch option(s) {sorted(unknown or [])} "
                f"(known: {', '.join(SWITCH_FIELDS)})"
            )
        try:  # the bus would refuse it at every run
            BusConfig(trace="-", data_dir="-", keys_dir="-", **switch).validate()
        except (BusConfigError, TypeError) as exc:
            raise FarmError(f"bench file {path}: bench {entry['name']}: {exc}") from None
        benches.append(Bench(entry["name"], dict(switch), entry.get("payload_bind")))
    names = [b.name for b in benches]
    if len(set(names)) != len(names):
        raise FarmError(f"bench file {path}: bench names must differ ({', '.join(names)})")
    scratch = Path(doc["scratch"]) if doc.get("scratch") else None
    return NodeBenches(benches, scratch or _default_scratch())


def _default_scratch() -> Path:
    import ray

    return Path(tempfile.gettempdir()) / f"orbitweaver-farm-{ray.get_runtime_context().get_node_id()[:12]}"


def node_benches() -> NodeBenches:
    """This node's benches: its bench file's, or as many local ones as its `bench` resource."""
    path = os.environ.get(BENCHES_ENV)
    if path:
        return read_bench_file(path)
    import ray

    me = ray.get_runtime_context().get_node_id()
    count = next((n["Resources"].get(BENCH_RESOURCE, 0) for n in ray.nodes() if n["NodeID"] == me), 0)
    return NodeBenches([Bench(f"local-{k + 1}") for k in range(int(count))], _default_scratch())


@contextmanager
def claim_bench(node: NodeBenches, wait_s: float | None = None) -> Iterator[Bench]:
    """Hold one free bench of this node for a run (a lock file per bench: Ray never runs more
    tasks needing a bench at once than the node offers, but it does not say which bench).

    A bench whose lock is still held is waited for, up to `wait_s` (CLAIM_WAIT_S): a worker
    whose driver died, or whose run was cancelled, holds its bench until Ray has killed it, a
    moment after Ray counts the bench free again and hands it to the next run."""
    node.scratch.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + (CLAIM_WAIT_S if wait_s is None else wait_s)
    while True:
        for bench in node.benches:
            handle = open(node.scratch / f"bench-{bench.name}.lock", "w")
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                handle.close()
                continue
            try:
                yield bench
            finally:
                handle.close()  # closing the file ends its lock
            return
        if time.monotonic() >= deadline:
            break
        time.sleep(0.2)
    raise FarmError(
        f"every bench of this node is busy ({', '.join(b.name for b in node.benches)}): its `{BENCH_RESOURCE}` "
        "resource offers more benches than its bench file declares"
    )


# ---- what travels ----------------------------------------------------------------------------------


def code_fingerprint(root: Path | None = None) -> str:
    """SHA-256 over the Python sources of this build (CODE_PACKAGES): the driver and every node
    must run the same code, or a campaign would mix results of two builds."""
    root = root or Path(__file__).resolve().parent.parent
    digest = hashlib.sha256()
    for package in CODE_PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


@dataclass
class Shipped:
    """A file or directory the runs name, in Ray's object store: `files` maps each path under
    `name` (the file itself, or the directory's files) to its object."""

    digest: str
    name: str
    files: dict[str, Any]


def ship(path: Path) -> Shipped:
    """Put a file or a directory's files into the object store (the driver keeps the result, and
    with it the objects, alive for the campaign)."""
    import ray

    members = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    digest = hashlib.sha256()
    contents = {}
    for member in members:
        rel = str(Path(path.name) / member.relative_to(path)) if path.is_dir() else path.name
        data = member.read_bytes()
        digest.update(rel.encode() + b"\0" + hashlib.sha256(data).digest())
        contents[rel] = data
    return Shipped(digest.hexdigest(), path.name, {rel: ray.put(data) for rel, data in contents.items()})


def materialize(shipped: dict[str, Shipped], cache: Path) -> dict[str, str]:
    """Each shipped file or directory on this node (fetched once per content): the configuration's
    path or name -> where this node holds it."""
    import ray

    local = {}
    for key, item in shipped.items():
        root = cache / item.digest
        if not (root / ".complete").exists():
            tmp = cache / f".tmp-{uuid.uuid4().hex}"
            for rel, ref in item.files.items():
                (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
                (tmp / rel).write_bytes(ray.get(ref))
            (tmp / ".complete").touch()
            try:
                tmp.rename(root)
            except OSError:  # another run on this node fetched the same content meanwhile
                shutil.rmtree(tmp, ignore_errors=True)
        local[key] = str(root / item.name)
    return local


def pack(run_dir: Path) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        tar.add(run_dir, arcname=".")
    return buffer.getvalue()


def unpack(data: bytes, run_dir: Path) -> None:
    """A run's directory from its bench, in place of whatever a run cut short left there."""
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    with tarfile.open(fileobj=io.BytesIO(data), mode="r") as tar:
        tar.extractall(run_dir, filter="data")


# ---- on the bench's node ---------------------------------------------------------------------------


def bench_run(cfg: BenchConfig, shipped: dict[str, Shipped], fingerprint: str) -> Iterator[dict]:
    """One campaign run on a bench of this node (a Ray streaming task): yields where it started,
    then its report and its packed run directory."""
    import ray

    mine = code_fingerprint()
    node_ip = ray.util.get_node_ip_address()
    if mine != fingerprint:
        raise FarmError(
            f"node {node_ip} runs other code than the campaign's driver (sources {mine[:12]}, driver's "
            f"{fingerprint[:12]}): install the same build on every bench node"
        )
    node = node_benches()
    with claim_bench(node) as bench:
        where = f"bench {bench.name} on node {node_ip}"
        if cfg.boot_trace_s is not None and not bench.local_switch:
            raise FarmError(
                f"{where} switches a real board ({bench.switch['power_driver']}), which boots in real time: "
                "run the campaign with --boot-trace-s real"
            )
        yield {"started": where}
        files = materialize(shipped, node.scratch / "files")
        # What lies in the bench's own folder is a run whose worker was killed (its node's driver
        # died, or it was cancelled): the bench is this run's now.
        bench_dir = node.scratch / "runs" / bench.name
        shutil.rmtree(bench_dir, ignore_errors=True)
        run_dir = bench_dir / f"{Path(cfg.out_dir).name}-{uuid.uuid4().hex[:8]}"
        try:
            # the run's bus (and with it its payload) dies with this worker, should Ray kill it
            setup = BenchSetup(files, bench.switch, bench.payload_bind, bus_dies_with_run=True)
            with _one_start_at_a_time(node.scratch) as release:
                report = Testbench(
                    replace(cfg, out_dir=str(run_dir)), say=lambda line: None, on_clock_started=release, setup=setup
                ).run()
            packed = pack(run_dir)
        finally:
            shutil.rmtree(run_dir, ignore_errors=True)
        yield {"where": where, "report": report.to_json(), "run_dir": packed}


@contextmanager
def _one_start_at_a_time(scratch: Path) -> Iterator[Callable[[], None]]:
    """This node's runs start one at a time, as a local campaign's do (campaign.RunSlots.starting):
    the lock (a file, shared by the node's workers) is held until the run's trace clock starts."""
    handle = open(scratch / "starting.lock", "w")
    fcntl.flock(handle, fcntl.LOCK_EX)
    lock = threading.Lock()

    def release() -> None:
        with lock:
            if not handle.closed:
                handle.close()

    try:
        yield release
    finally:
        release()


# ---- the shared queue ----------------------------------------------------------------------------


@dataclass
class FarmCampaign:
    """A campaign that hands its runs to the farm (`BenchFarm.execute`): where its runs' starts
    and results go, its stop, and what the farm knows of its runs' lost tries."""

    name: str
    started: Started
    finished: Finished
    stop: threading.Event
    #: the runs not finished yet, by index (the campaign is done once none is left, or once it
    #: stopped or failed and none of its runs is under way)
    left: set[int] = field(default_factory=set)
    #: why tries of a run were lost (a driver's before this one's included), by index
    lost: dict[int, list[str]] = field(default_factory=dict)
    #: losses of a run after it had started on a bench, by this driver, by index
    under_way: dict[int, int] = field(default_factory=dict)
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)

    @property
    def ended(self) -> bool:
        """Stopped or failed: none of its runs goes out any more."""
        return self.stop.is_set() or self.error is not None


@dataclass
class QueuedRun:
    """A run waiting for a bench (or under way on one), with its campaign and how long the plan
    expects it to take (hil/sim/plan.py)."""

    campaign: FarmCampaign
    run: PlannedRun
    expected_s: float
    again: bool = False  # a try of it was lost: it goes out before the runs not yet tried
    where: str = ""  # "bench B on node N" once it has started


class SharedQueue:
    """The runs of every campaign one farm serves, waiting for a bench, in one queue: longest
    expected first (LPT: the bench that frees takes the longest run left, so the long runs do
    not end up last, each on a bench of its own while the others idle), a run whose try was lost
    first of all, ties in the campaign's own rank order. Both of make bench's end-to-end parts
    share it: no bench idles while the other part's runs wait."""

    def __init__(self) -> None:
        self._heap: list[tuple[tuple, int, QueuedRun]] = []
        self._tickets = itertools.count()

    @staticmethod
    def order(item: QueuedRun) -> tuple:
        return (not item.again, -item.expected_s, item.run.rank)

    def put(self, item: QueuedRun) -> None:
        heapq.heappush(self._heap, (self.order(item), next(self._tickets), item))

    def take(self) -> QueuedRun | None:
        """The next run to hand out (None: none waits); runs of a campaign that ended are dropped."""
        while self._heap:
            item = heapq.heappop(self._heap)[2]
            if not item.campaign.ended:
                return item
        return None

    def drop(self, campaign: FarmCampaign) -> None:
        self._heap = [entry for entry in self._heap if entry[2].campaign is not campaign]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)


def deliver(item: QueuedRun, outcome: RunOutcome) -> None:
    """A finished run's outcome into its own campaign (its records, its report)."""
    campaign = item.campaign
    campaign.finished(item.run, outcome)
    campaign.left.discard(item.run.index)
    if not campaign.left:
        campaign.done.set()


# ---- the driver ------------------------------------------------------------------------------------

#: how long the farm waits, after the first campaign of a process handed in its runs, for the
#: others it was told of (`BenchFarm(campaigns=N)`) before it hands out runs: long enough for a
#: campaign's planning and shipping, short enough that one that failed before handing in its
#: runs does not hold the others up
GATHER_S = 120.0


def _system_errors() -> tuple[type[BaseException], ...]:
    """A run's task failed because of where it ran, not of what it ran: it runs again elsewhere."""
    from ray import exceptions as rx

    return (rx.NodeDiedError, rx.WorkerCrashedError, rx.LocalRayletDiedError, rx.ObjectLostError, rx.RaySystemError)


class BenchFarm(RunExecutor):
    """A campaign's runs on the benches of the Ray cluster at `address` (a `campaign.RunExecutor`):
    one task per run, needing one `bench`. One farm may serve several campaigns of one process
    at once (`campaigns`: how many will hand in their runs; make bench's two end-to-end parts):
    their runs wait in one `SharedQueue`, longest expected first, and go out, never more at once
    than the cluster has benches, from one dispatcher thread; each result goes back into its own
    campaign."""

    def __init__(self, address: str, node_ip_address: str | None = None, campaigns: int = 1):
        if campaigns < 1:
            raise ValueError(f"a bench farm serves at least one campaign, not {campaigns}")
        self.address = address
        self.node_ip_address = node_ip_address
        self.campaigns = campaigns
        self.say: Callable[[str], None] = print
        self.fingerprint = ""
        self.shipped: dict[str, Shipped] = {}
        #: each run's expected wall seconds (hil/sim/plan.py), by its directory (unique over campaigns)
        self.expected_s: dict[str, float] = {}
        self.queue = SharedQueue()
        self._lock = threading.Lock()
        self._serving: list[FarmCampaign] = []
        self._checked_in = 0
        self._first_check_in: float | None = None
        self._dispatcher: threading.Thread | None = None

    def connect(self) -> None:
        try:
            import ray
        except ImportError:
            raise FarmError("a bench farm runs on Ray: pip install 'orbitweaver[cluster]'") from None
        if not ray.is_initialized():
            try:
                ray.init(
                    address=self.address,
                    log_to_driver=False,
                    logging_level=logging.WARNING,
                    _node_ip_address=self.node_ip_address,
                )
            except (ConnectionError, RuntimeError, ValueError) as exc:
                raise FarmError(f"cannot reach the Ray cluster at {self.address}: {exc}") from None

    def benches(self) -> int:
        import ray

        return int(ray.cluster_resources().get(BENCH_RESOURCE, 0))

    def prepare(self, runs: list[PlannedRun], out: Path, say: Callable[[str], None]) -> None:
        import ray

        self.say = say
        with self._lock:  # two campaigns of one process may start at once (make bench)
            self.connect()
            if not self.fingerprint:
                self.fingerprint = code_fingerprint()
        benches = self.benches()
        if benches == 0:
            raise FarmError(
                f"the Ray cluster at {self.address} offers no `{BENCH_RESOURCE}` resource: start each bench node "
                f'with `ray start ... --resources \'{{"{BENCH_RESOURCE}": N}}\'` (docs/hil.md "Bench farm")'
            )
        nodes = sum(1 for n in ray.nodes() if n["Alive"] and n["Resources"].get(BENCH_RESOURCE))
        say(f"[farm] {benches} bench(es) on {nodes} node(s) of the Ray cluster at {self.address}")
        expected = expected_wall_s(runs, say)
        with self._lock:
            self.expected_s.update(expected)
        wanted: dict[str, Path] = {}
        for run in runs:
            cfg = run.cfg
            wanted[cfg.model] = Path(cfg.model)
            wanted[cfg.trace] = Path(traces.resolve(cfg.trace))
            for spec in cfg.workload or ():
                for image in spec.images:
                    wanted[image] = Path(image)
            _keep_trace_beside(out, cfg.trace)
        with self._lock:
            for key, path in wanted.items():
                if key not in self.shipped:
                    self.shipped[key] = ship(path)
        size = sum(len(v.files) for v in self.shipped.values())
        say(f"[farm] shipping {len(self.shipped)} file(s) and folder(s) ({size} files) to the benches that run")

    def hand_in(
        self, runs: list[PlannedRun], started: Started, finished: Finished, stop: threading.Event
    ) -> FarmCampaign:
        """A campaign's runs into the shared queue (`enqueue`); the dispatcher starts if it is
        not running."""
        campaign = self.enqueue(runs, started, finished, stop)
        with self._lock:
            if campaign.left and self._dispatcher is None:
                self._dispatcher = threading.Thread(target=self._dispatch, name="bench-farm", daemon=True)
                self._dispatcher.start()
        return campaign

    def enqueue(
        self, runs: list[PlannedRun], started: Started, finished: Finished, stop: threading.Event
    ) -> FarmCampaign:
        """A campaign's runs into the shared queue, each with its expected length (`prepare`; one
        the plan did not see waits behind those it did, in rank order), and the campaign counted
        as handed in (one with no runs too). Its runs' starts and results go to `started` and
        `finished`."""
        name = str(Path(runs[0].cfg.out_dir).parent.parent) if runs else ""
        campaign = FarmCampaign(name, started, finished, stop, left={run.index for run in runs})
        # why earlier tries were lost, those of a driver before this one (stopped or dead) included
        campaign.lost = {run.index: reasons for run in runs if (reasons := _earlier_losses(run))}
        with self._lock:
            self._checked_in += 1
            if self._first_check_in is None:
                self._first_check_in = time.monotonic()
            for run in runs:
                self.queue.put(QueuedRun(campaign, run, self.expected_s.get(run.cfg.out_dir, 0.0)))
            if runs:
                self._serving.append(campaign)
            else:
                campaign.done.set()
        return campaign

    def execute(self, runs: list[PlannedRun], started: Started, finished: Finished, stop: threading.Event) -> None:
        campaign = self.hand_in(runs, started, finished, stop)
        try:
            while not campaign.done.wait(0.5):
                pass
        except KeyboardInterrupt:
            # the dispatcher cancels this campaign's runs under way (their buses stop), unrecorded
            stop.set()
            while not campaign.done.wait(0.5):
                pass
            raise
        if campaign.error is not None:
            raise campaign.error

    # ---- the dispatcher (one thread per farm, while a campaign it serves has runs left) ----------

    def _gathering(self) -> bool:
        """Whether the farm still waits for campaigns it was told of to hand in their runs."""
        return (
            self._checked_in < self.campaigns
            and self._first_check_in is not None
            and time.monotonic() - self._first_check_in < GATHER_S
        )

    def _dispatch(self) -> None:
        import ray

        flights: dict[Any, QueuedRun] = {}
        try:
            self._dispatch_loop(flights)
        except BaseException as exc:  # a bug here must not leave a campaign waiting for ever
            for gen in list(flights):
                ray.cancel(gen)
            with self._lock:
                for campaign in self._serving:
                    campaign.error = campaign.error or FarmError(f"the bench farm's dispatcher failed: {exc!r}")
                    campaign.done.set()
                self._serving.clear()
                self._dispatcher = None
            raise

    def _dispatch_loop(self, flights: dict[Any, QueuedRun]) -> None:
        import ray

        task = ray.remote(num_cpus=0, resources={BENCH_RESOURCE: 1}, max_retries=0, num_returns="streaming")(bench_run)
        system_errors = _system_errors()
        waiting_since: float | None = None
        gathered_said = False
        while True:
            with self._lock:
                # a campaign that stopped or failed: its runs under way are cut short, unrecorded
                for campaign in [c for c in self._serving if c.ended]:
                    self.queue.drop(campaign)
                    for gen, item in list(flights.items()):
                        if item.campaign is campaign:
                            ray.cancel(gen)
                            del flights[gen]
                    campaign.done.set()
                self._serving = [c for c in self._serving if not c.done.is_set()]
                if not self._serving and not flights:
                    self._dispatcher = None
                    return
                gathering = self._gathering()
                if not gathering:
                    free = self.benches() - len(flights)
                    while free > 0 and (next_run := self.queue.take()) is not None:
                        flights[task.remote(next_run.run.cfg, self.shipped, self.fingerprint)] = next_run
                        free -= 1
            if gathering:
                if not gathered_said:
                    self.say(
                        f"[farm] waiting for the other campaign(s) of this driver to hand in their runs "
                        f"({self._checked_in} of {self.campaigns}, at most {GATHER_S:.0f} s)"
                    )
                    gathered_said = True
                time.sleep(0.2)
                continue
            if not flights:
                if waiting_since is None or time.monotonic() - waiting_since > 60:
                    self.say(f"[farm] no free bench in the cluster: {len(self.queue)} run(s) wait for one")
                    waiting_since = time.monotonic()
                time.sleep(1.0)
                continue
            waiting_since = None
            ready, _ = ray.wait(list(flights), num_returns=1, timeout=0.5)
            for gen in ready:
                item = flights[gen]
                campaign, run = item.campaign, item.run
                try:
                    message: dict[str, Any] = ray.get(next(gen))  # type: ignore[arg-type,assignment]
                except system_errors as exc:
                    del flights[gen]
                    reason = _lost_reason(item, exc)
                    campaign.lost.setdefault(run.index, []).append(reason)
                    _note_losses(run, campaign.lost[run.index])
                    if item.where:
                        campaign.under_way[run.index] = campaign.under_way.get(run.index, 0) + 1
                    if campaign.under_way.get(run.index, 0) >= MAX_LOST:
                        why = "; ".join(campaign.lost[run.index])
                        campaign.error = FarmError(f"{run.what}: lost {MAX_LOST} times under way ({why})")
                        continue
                    self.say(f"[farm] {reason}: {run.what} runs again on another bench")
                    with self._lock:
                        self.queue.put(replace(item, again=True, where=""))
                    if not item.where:
                        # lost before it started: the cluster may not know yet that the node
                        # is gone; give it a moment before the run goes out again
                        time.sleep(1.0)
                    continue
                except StopIteration:  # pragma: no cover - the task yields twice or raises
                    del flights[gen]
                    campaign.error = FarmError(f"{run.what}: its task ended without a report")
                    continue
                except ray.exceptions.RayTaskError as exc:
                    del flights[gen]
                    cause = exc.as_instanceof_cause()
                    campaign.error = FarmError(f"{run.what} failed on {item.where or 'its bench'}: {cause}")
                    continue
                if campaign.ended:
                    continue  # cancelled with its campaign at the top of the loop
                if "started" in message:
                    item.where = message["started"]
                    campaign.started(run, item.where)
                    continue
                del flights[gen]
                unpack(message["run_dir"], Path(run.cfg.out_dir))
                report = BenchReport.from_json(message["report"])
                deliver(item, RunOutcome(report, message["where"], campaign.lost.get(run.index, [])))


def expected_wall_s(runs: list[PlannedRun], say: Callable[[str], None]) -> dict[str, float]:
    """Each run's expected wall seconds from the lifecycle simulator (hil/sim/plan.py), by its
    directory. A run the simulator cannot predict (a model it cannot read, say) is expected to
    play its whole trace: the plan only orders runs, so it is said and the campaign goes on."""
    from hil.sim import plan

    predictor = plan.RunPredictor()
    expected = {}
    for run in runs:
        try:
            expected[run.cfg.out_dir] = plan.FIT.wall_s(predictor.predict(run.cfg))
        except Exception as exc:  # noqa: BLE001 - a planning aid: any failure falls back, said
            trace = traces.load(traces.resolve(run.cfg.trace))
            scale = run.cfg.time_scale if isinstance(run.cfg.time_scale, float) else 0.1
            expected[run.cfg.out_dir] = trace.duration_s * scale
            say(f"[farm] {run.what}: no expected length from the simulator ({exc!r}); its whole trace assumed")
    if expected:
        longest = max(expected.values())
        say(
            f"[farm] {len(expected)} run(s) expected to take {sum(expected.values()) / 3600:.2f} run-hours "
            f"(the longest {longest:.0f} s): they go out longest first"
        )
    return expected


def _earlier_losses(run: PlannedRun) -> list[str]:
    """Why the tries of this run by an earlier driver of the campaign were lost (its LOST_NOTE,
    if that driver stopped or died before the run finished, with the same configuration)."""
    try:
        note = json.loads((Path(run.cfg.out_dir) / LOST_NOTE).read_text())
        if note["config"] == _config_key(run.cfg):
            return [str(reason) for reason in note["lost"]]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return []


def _note_losses(run: PlannedRun, reasons: list[str]) -> None:
    """Keep why this run's tries were lost in its directory on the driver until it finishes (its
    finished directory replaces the note; its campaign-run.json keeps the reasons)."""
    path = Path(run.cfg.out_dir) / LOST_NOTE
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"config": _config_key(run.cfg), "lost": reasons}, indent=1))
    tmp.replace(path)  # whole or absent


def _lost_reason(item: QueuedRun, exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    detail = f"{type(exc).__name__}: {text[0][:160]}" if text else type(exc).__name__
    return f"{item.where or 'its bench, before it started,'} was lost ({detail})"


def _keep_trace_beside(out: Path, trace: str) -> None:
    """A trace file the campaign names (not a shipped one, not one it generated) kept beside its
    runs, where the validation looks for the trace a run flew on another host (hil/sim/validate.py
    run_trace)."""
    if trace in traces.SHIPPED_NAMES:
        return
    source = Path(traces.resolve(trace))
    beside = out / SEED_TRACE_DIR / source.name
    if beside.exists() or source.resolve() == beside.resolve():
        return
    beside.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source, beside)
