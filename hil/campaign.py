"""Campaigns: traces x workloads x seeds x policies through the testbench, and the report an
operator reads after a test day (markdown with tables, PNG plots).

By default every shipped generated trace (trace-a, trace-b, sat1-like, sat2-like,
dellingr-like), two workloads -- the paper's two specified requests per trace, and four requests
served back to back -- and OrbitWeaver with its fixed and its adaptive checkpoint cadence beside
the three baselines. The report puts each policy's completion rate beside its end-to-end times,
and says so where a policy completes nothing: a ratio is only formed where both sides finished
every request.
"""

from __future__ import annotations

import heapq
import itertools
import json
import shutil
import statistics
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import traces
from flight.checkpoint.policies import takes_adaptive_cadence
from flight.options import default_cadence, resolve_cadence
from hil.testbench import (
    BenchConfig,
    BenchReport,
    BenchSetup,
    PowerModel,
    RequestReport,
    RequestSpec,
    Testbench,
    default_workload,
    reference_run,
)
from traces.catalog import GENERATED_NAMES

DEFAULT_TRACES = ("trace-a", "trace-b", "sat1-like", "sat2-like", "dellingr-like")
DEFAULT_POLICIES = ("orbitweaver", "sonic-layer", "sonic-chunk", "hcache")
#: requests uplinked together at the trace's start and served in order: the paper's "two specified
#: requests" per trace (Sec. 7.2), and a back-to-back queue twice as long
WORKLOADS = {"paper": 2, "back-to-back": 4}


@dataclass
class CampaignCell:
    trace: str
    policy: str  # the label: a policy, or orbitweaver with its cadence
    seed: int
    report: BenchReport
    workload: str = "paper"
    cadence: str = "fixed"
    report_dir: str = ""  # the run's own directory (its logs), for the report to link
    bench: str = ""  # where it ran on a bench farm ("bench B on node N"); "" on this machine
    lost: list[str] = field(default_factory=list)  # why earlier tries of it were lost (bench farm)


def variants(policies: list[str], cadences: list[str]) -> list[tuple[str, str, str]]:
    """(label, policy, cadence): a policy that takes the adaptive cadence (orbitweaver) once per
    cadence, each baseline with its own."""
    out = []
    for policy in policies:
        if takes_adaptive_cadence(policy):
            out += [
                (policy if cadence == "fixed" and len(cadences) == 1 else f"{policy} ({cadence})", policy, cadence)
                for cadence in cadences
            ]
        else:
            out.append((policy, policy, default_cadence(policy)))
    return out


def workload_requests(base: BenchConfig, n: int, max_new_tokens: int | None = None) -> list:
    """n requests: the base configuration's own requests repeated in turn, or the sample scenes."""
    if base.workload:
        return [base.workload[i % len(base.workload)] for i in range(n)]
    return default_workload(n, max_new_tokens or 24)


def trace_for_seed(trace: str, seed: int, out_dir: Path) -> str:
    """A generated trace kind gets one realisation per seed (seed 0: the shipped file); other
    traces are used as they are."""

    if seed == 0 or trace not in GENERATED_NAMES:
        return trace
    path = out_dir / SEED_TRACE_DIR / seed_trace_filename(trace, seed)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        traces.dump(traces.generate(trace, seed=seed), path)
    return str(path)


#: where a campaign keeps the traces it generated for seeds > 0, beside its `runs/`
SEED_TRACE_DIR = "traces"


def seed_trace_filename(trace: str, seed: int) -> str:
    return f"{trace}-seed{seed}.jsonl"


def seed_trace_from_filename(filename: str) -> traces.Trace | None:
    """The trace a campaign generated for a seed, generated again from its file's name (the
    generator is deterministic per kind and seed), or None if the name is not one of those."""
    stem = Path(filename).name.removesuffix(".jsonl")
    kind, sep, seed = stem.rpartition("-seed")
    if not sep or kind not in GENERATED_NAMES or not seed.isdigit():
        return None
    return traces.generate(kind, seed=int(seed))


#: In each run's directory: the run's configuration and its report, written once the run has
#: ended (so a run cut short by a stopped campaign has none and runs again on resume).
RUN_RECORD = "campaign-run.json"


def _config_key(cfg: BenchConfig) -> dict:
    """What makes two runs the same run: the whole configuration but where it is written."""
    return json.loads(json.dumps(replace(cfg, out_dir=""), default=_jsonable))


def _jsonable(value):
    if hasattr(value, "__dataclass_fields__"):
        return asdict(value)
    return str(value)


def _keep_run(cfg: BenchConfig, report: BenchReport, outcome: RunOutcome | None = None) -> None:
    path = Path(cfg.out_dir) / RUN_RECORD
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    record: dict = {"config": _config_key(cfg), "report": report.to_json()}
    if outcome is not None and (outcome.bench or outcome.lost):
        record["bench"], record["lost"] = outcome.bench, list(outcome.lost)  # where a bench farm ran it
    tmp.write_text(json.dumps(record, indent=1))
    tmp.replace(path)  # whole or absent: a campaign stopped mid-write reruns the run


def kept_outcome(cfg: BenchConfig) -> RunOutcome | None:
    """A finished earlier run with exactly this configuration (its report, and where a bench farm
    ran it), or None (no record, an unreadable one, or a different configuration: then the run
    runs)."""
    try:
        record = json.loads((Path(cfg.out_dir) / RUN_RECORD).read_text())
        if record["config"] != _config_key(cfg):
            return None
        return RunOutcome(
            BenchReport.from_json(record["report"]), str(record.get("bench", "")), list(record.get("lost", []))
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None


def kept_run(cfg: BenchConfig) -> BenchReport | None:
    """The report of a finished earlier run with exactly this configuration, or None."""
    outcome = kept_outcome(cfg)
    return None if outcome is None else outcome.report


def config_of_run(run_dir: str | Path) -> BenchConfig:
    """The configuration a finished campaign run ran with (its RUN_RECORD), writing into
    `run_dir`: to run it again elsewhere, replace `out_dir`. Raises OSError or ValueError for a
    run that left no readable record."""
    try:
        stored = dict(json.loads((Path(run_dir) / RUN_RECORD).read_text())["config"])
        stored["workload"] = (
            None
            if stored.get("workload") is None
            else [RequestSpec(tuple(w["images"]), w["prompt"], w["max_new_tokens"]) for w in stored["workload"]]
        )
        stored["power"] = PowerModel(**stored["power"])
        stored["extra_flight_args"] = tuple(stored.get("extra_flight_args") or ())
        if stored.get("endpoints") is not None:
            raise ValueError("a run on fixed endpoints cannot run again beside others")
        return BenchConfig(**{**stored, "out_dir": str(run_dir)})
    except (KeyError, TypeError) as exc:
        raise ValueError(f"{run_dir}: its {RUN_RECORD} is not a campaign run's record ({exc!r})") from exc


def run_again(
    run_dirs: list[str], out: Path, times: int, slots: RunSlots, say=print, resume: bool = False
) -> dict[str, list[str]]:
    """Each finished run of `run_dirs` again, `times` times, with its own configuration, into
    OUT/<run>-again<k>: {run_dir: [its repeats' directories]}. What the simulator's validation
    cannot tell from one run -- whether the testbench itself lands on the same side of a cut
    twice -- a repeat of the same configuration shows. `resume` keeps repeats already finished."""
    plan = [
        (run_dir, replace(config_of_run(run_dir), out_dir=str(out / f"{Path(run_dir).name}-again{k}")))
        for run_dir in run_dirs
        for k in range(1, times + 1)
    ]
    lock = threading.Lock()

    def run_one(index: int) -> None:
        run_dir, cfg = plan[index]
        if resume and kept_run(cfg) is not None:
            return
        slots.acquire((index,))
        try:
            with lock:
                say(f"[again] {index + 1}/{len(plan)}: {Path(cfg.out_dir).name}")
            shutil.rmtree(cfg.out_dir, ignore_errors=True)
            _keep_run(cfg, _started_one_at_a_time(slots.starting, cfg))
        finally:
            slots.release()

    with ThreadPoolExecutor(max_workers=max(1, len(plan))) as pool:
        for future in [pool.submit(run_one, i) for i in range(len(plan))]:
            future.result()
    out_dirs: dict[str, list[str]] = {}
    for run_dir, cfg in plan:
        out_dirs.setdefault(run_dir, []).append(cfg.out_dir)
    return out_dirs


class RunSlots:
    """At most `jobs` testbench runs at a time, shared by every campaign given the same slots
    (make bench runs its two end-to-end parts at once), handed out in rank order (the lowest
    rank among the runs waiting first), and started one at a time (`starting`: held from a run's
    start until its trace clock runs).

    Why an order: a run that never finishes lasts its trace's whole powered time (about an hour
    of wall time on the short-window traces at make bench's pace); started last, such runs leave
    the other slots idle at the end of a campaign. Why one pool: two campaigns of `jobs` runs
    each load the machine twice as much, and one after the other they take the sum of their
    tails."""

    def __init__(self, jobs: int):
        if jobs < 1:
            raise ValueError(f"a campaign needs at least one run slot, not {jobs}")
        self.jobs = jobs
        self.starting = threading.Lock()
        self._free = jobs
        self._waiting: list[tuple] = []  # (rank, ticket): a heap
        self._tickets = itertools.count()
        self._changed = threading.Condition()

    def acquire(self, rank: tuple) -> None:
        """Wait for a slot; among the runs waiting, the lowest rank gets it first."""
        with self._changed:
            entry = (rank, next(self._tickets))
            heapq.heappush(self._waiting, entry)
            self._changed.wait_for(lambda: self._free > 0 and self._waiting[0] == entry)
            heapq.heappop(self._waiting)
            self._free -= 1
            self._changed.notify_all()  # the next in line may find a slot too

    def release(self) -> None:
        with self._changed:
            self._free += 1
            self._changed.notify_all()


def _started_one_at_a_time(starting: threading.Lock, cfg: BenchConfig, setup: BenchSetup | None = None) -> BenchReport:
    """Run the testbench once `starting` is free, holding it until the run's trace clock starts."""
    released = threading.Event()

    def release() -> None:
        if not released.is_set():
            released.set()
            starting.release()

    starting.acquire()
    try:
        return Testbench(cfg, say=lambda line: None, on_clock_started=release, setup=setup).run()
    finally:
        release()


@dataclass
class PlannedRun:
    """One run of a campaign's matrix: its place in the plan, its axes and its configuration
    (`cfg.out_dir` is where its directory ends up, OUT/runs/<name>), and its rank (lowest first)."""

    index: int
    trace: str
    workload: str
    seed: int
    label: str
    cadence: str
    cfg: BenchConfig
    rank: tuple = ()

    @property
    def name(self) -> str:
        return Path(self.cfg.out_dir).name

    @property
    def what(self) -> str:
        return f"trace {self.trace} workload {self.workload} seed {self.seed} policy {self.label}"


@dataclass
class RunOutcome:
    """A finished run as an executor hands it back: its report (its directory is in place at
    `cfg.out_dir`), where it ran ("" on this machine; on a bench farm "bench B on node N"), and
    why earlier tries of it were lost (a bench farm runs a run again whose node died under it)."""

    report: BenchReport
    bench: str = ""
    lost: list[str] = field(default_factory=list)


#: what an executor calls as a run starts (the run, where: "" or "bench B on node N")
Started = Callable[[PlannedRun, str], None]
#: what an executor calls once a run has finished and its directory is in place
Finished = Callable[[PlannedRun, RunOutcome], None]


class RunExecutor(ABC):
    """Where a campaign's runs run. The campaign (its plan, kept runs, records, report and
    validation) is the same whatever runs them: `LocalPool`, this machine's slots, or
    `hil.farm.BenchFarm`, one run per bench of a Ray cluster."""

    def prepare(self, runs: list[PlannedRun], out: Path, say: Callable[[str], None]) -> None:  # noqa: B027
        """Before any run starts (nothing by default)."""

    @abstractmethod
    def execute(self, runs: list[PlannedRun], started: Started, finished: Finished, stop: threading.Event) -> None:
        """Run every one of `runs` (given in rank order; the lowest rank gets a free slot first),
        each from nothing in its `cfg.out_dir`; call `started` as each starts and `finished` once
        it has ended with its directory in place. Once `stop` is set no run starts any more;
        return when none is under way. A KeyboardInterrupt sets `stop` and is raised once the
        runs under way have ended."""


class LocalPool(RunExecutor):
    """This machine: as many runs at once as `slots` gives (shared with the other campaigns
    given the same slots), started one at a time (RunSlots.starting)."""

    def __init__(self, slots: RunSlots):
        self.slots = slots

    def prepare(self, runs: list[PlannedRun], out: Path, say: Callable[[str], None]) -> None:
        # References once, before any run (computed in this process and cached; runs share them).
        for run in runs:
            cfg = run.cfg
            for i, spec in enumerate(cfg.workload or default_workload(cfg.requests)):
                reference_run(cfg.model, spec, cfg, str(out / "reference" / f"{run.index}-{i}"))

    def execute(self, runs: list[PlannedRun], started: Started, finished: Finished, stop: threading.Event) -> None:
        slots = self.slots

        def run_one(run: PlannedRun) -> None:
            slots.acquire(run.rank)
            try:
                if stop.is_set():
                    return
                started(run, "")
                # What is there is the campaign's own: a run a stopped campaign cut short, or one of
                # an earlier campaign run again. A run starts from nothing, never on top of it.
                shutil.rmtree(run.cfg.out_dir, ignore_errors=True)
                report = _started_one_at_a_time(slots.starting, run.cfg)
                finished(run, RunOutcome(report))
            finally:
                slots.release()

        # Every run has a thread, submitted in rank order (the first to ask get the free slots);
        # the slots decide which of those waiting runs next.
        with ThreadPoolExecutor(max_workers=max(1, len(runs))) as pool:
            try:
                for future in [pool.submit(run_one, run) for run in runs]:
                    future.result()
            except KeyboardInterrupt:
                # Leaving the pool waits for every thread: the runs waiting for a slot must not start.
                stop.set()
                raise


def plan_runs(
    base: BenchConfig,
    traces_: list[str],
    policies: list[str],
    seeds: list[int],
    workloads: list[str] | None,
    cadences: list[str],
    max_new_tokens: int | None = None,
) -> list[PlannedRun]:
    """A campaign's plan: every trace x workload x seed x policy variant, each with its
    configuration (writing into OUT/runs/<run>; a seed's trace is generated into OUT/traces/) and
    its rank. The plan alone, nothing run (bench/farm_bench.py plans make bench's matrix so)."""
    out = Path(base.out_dir)
    plan: list[PlannedRun] = []
    no_workload: list[str | None] = [None]  # the base config's own workload
    for trace in traces_:
        for workload in workloads or no_workload:
            for seed in seeds:
                trace_arg = trace_for_seed(trace, seed, out)
                for label, policy, cadence in variants(policies, cadences):
                    cfg = replace(base, trace=trace_arg, policy=policy, cadence=cadence)
                    if workload is not None:
                        cfg = replace(
                            cfg,
                            requests=WORKLOADS[workload],
                            workload=workload_requests(base, WORKLOADS[workload], max_new_tokens),
                        )
                    slug = label.replace(" (", "-").replace(")", "")
                    name = f"{Path(trace).stem}-{workload or 'w'}-s{seed}-{slug}"
                    cfg = replace(cfg, out_dir=str(out / "runs" / name))
                    # Rank: the traces in the order given (make bench gives the short-window ones
                    # first: their baselines never finish and last the trace's whole powered
                    # time), a longer queue first, then the plan's order.
                    rank = (traces_.index(trace), -cfg.requests, len(plan))
                    plan.append(PlannedRun(len(plan), trace, workload or "paper", seed, label, cadence, cfg, rank))
    return plan


def run_campaign(
    base: BenchConfig,
    traces_: list[str],
    policies: list[str],
    seeds: list[int],
    say=print,
    workloads: list[str] | None = None,
    cadences: list[str] | None = None,
    jobs: int = 1,
    max_new_tokens: int | None = None,
    resume: bool = False,
    slots: RunSlots | None = None,
    stop: threading.Event | None = None,
    executor: RunExecutor | None = None,
) -> list[CampaignCell]:
    """Every trace x workload x seed x policy variant; `jobs` runs at once (each is a bus, a
    payload and a ground link of its own), the first traces' first, or as many as `slots` gives,
    shared with the other campaigns given the same slots; or wherever `executor` runs them (a
    bench farm: `hil.farm.BenchFarm`). Without `workloads`,
    `base.workload` (or its request count) is the only one. With `resume`, a run that an earlier
    campaign into the same directory finished with the same configuration is kept as it was
    (`kept_run`), not run again: a campaign of hours that was stopped goes on where it stopped.

    `stop` set (a Ctrl-C: KeyboardInterrupt here sets it too) ends the campaign: no run starts any
    more, and a run that ends after it is not recorded as finished (a Ctrl-C in a terminal also
    reaches each run's bus, which stops early: that run's report is not what the run would have
    measured, so --resume runs it again). KeyboardInterrupt is raised once the runs under way end."""
    out = Path(base.out_dir)
    stop = stop or threading.Event()
    cadences = cadences or [resolve_cadence("orbitweaver", base.cadence)]
    no_workload: list[str | None] = [None]  # the base config's own workload
    plan = plan_runs(base, traces_, policies, seeds, workloads, cadences, max_new_tokens)
    lock = threading.Lock()
    # Runs start one at a time (RunSlots.starting): a run's trace clock starts once its zygote has
    # imported the payload's libraries (seconds of CPU each), and ten of those at once on a 2-core
    # machine slowed the first windows of the runs already under way (a load average of 17; three
    # sat1-like runs lost a window to it, docs/hil.md "Campaigns").
    executor = executor or LocalPool(slots or RunSlots(jobs))
    cells: list[CampaignCell | None] = [None] * len(plan)
    # Kept runs are known before any run starts, so the counters below count what this campaign
    # runs and what is done, in the order things happen. (They used to print a run's place in the
    # plan at its start; runs start in rank order, not plan order, so the first line of the
    # README's campaign read 11/40: its first run was the plan's eleventh.)
    kept_runs: dict[int, RunOutcome] = {}
    for run in plan if resume else ():
        if (kept := kept_outcome(run.cfg)) is not None:
            kept_runs[run.index] = kept
    ordered = sorted(plan, key=lambda run: run.rank)
    to_run = [run for run in ordered if run.index not in kept_runs]
    counts = {"started": 0, "done": 0}
    started_once: set[int] = set()
    axes = [
        f"{len(traces_)} trace(s)",
        f"{len(workloads or no_workload)} workload(s)",
        f"{len(seeds)} seed(s)",
        f"{len(variants(policies, cadences))} policy variant(s)",
    ]
    say(
        f"[campaign] {len(plan)} runs ({' x '.join(axes)}) into {out}: "
        + (
            f"{len(kept_runs)} kept from an earlier campaign, {len(to_run)} to run"
            if resume
            else f"{len(to_run)} to run"
        )
    )
    if to_run:
        say("[campaign] Ctrl-C stops it; the same command with --resume keeps every finished run and runs the rest")

    def record(run: PlannedRun, outcome: RunOutcome, how: str) -> None:
        with lock:
            counts["done"] += 1
            say(f"[campaign] {counts['done']}/{len(plan)} done: {run.what} ({how})")
            say("  " + outcome.report.summary().replace("\n", "\n  "))
            cells[run.index] = CampaignCell(
                run.trace,
                run.label,
                run.seed,
                outcome.report,
                run.workload,
                run.cadence,
                run.cfg.out_dir,
                outcome.bench,
                list(outcome.lost),
            )
            write_report(out, [c for c in cells if c is not None])  # partial results survive a stop

    def started(run: PlannedRun, where: str) -> None:
        with lock:
            if run.index in started_once:  # a run a bench farm lost, started again: counted once
                say(f"[campaign] run starting again: {run.what}" + (f" on {where}" if where else ""))
                return
            started_once.add(run.index)
            counts["started"] += 1
            say(
                f"[campaign] run {counts['started']}/{len(to_run)} starting: {run.what}"
                + (f" on {where}" if where else "")
            )

    def finished(run: PlannedRun, outcome: RunOutcome) -> None:
        if stop.is_set():
            return  # cut short by the stop: not a finished run
        _keep_run(run.cfg, outcome.report, outcome)
        how = "finished" + (f" on {outcome.bench}" if outcome.bench else "")
        if outcome.lost:
            how += f"; run again after: {'; '.join(outcome.lost)}"
        record(run, outcome, how)

    for run in ordered:
        if run.index in kept_runs:
            record(run, kept_runs[run.index], "kept from an earlier campaign")
    if not stop.is_set():
        if to_run:
            executor.prepare(to_run, out, say)
        # with nothing to run too: an executor shared by several campaigns (a bench farm) learns
        # that this one hands in no runs, and does not wait for them
        executor.execute(to_run, started, finished, stop)
    done = [c for c in cells if c is not None]
    if not stop.is_set():  # stopped: each finished run already rewrote the report; keep it as is
        write_report(out, done)
    return done


def load_cells(out: Path) -> list[CampaignCell]:
    """The cells of a campaign from its campaign.json (to rewrite the report of a finished or
    stopped campaign)."""

    data = json.loads((Path(out) / "campaign.json").read_text())
    cells = []
    for row, run in zip(data["rows"], data["runs"], strict=True):
        run = dict(run)
        run["requests"] = [RequestReport(**q) for q in run["requests"]]
        cells.append(
            CampaignCell(
                row["trace"],
                row["policy"],
                row["seed"],
                BenchReport(**run),
                row["workload"],
                row.get("cadence", "fixed"),
                bench=row.get("bench") or "",
                lost=list(row.get("run_again_because") or []),
            )
        )
    return cells


def trace_a_claim(rows: list[dict]) -> list[str]:
    """The paper's Sec. 7.2 claim, checked on the runs of trace-a with the paper's workload."""
    mine = [r for r in rows if Path(r["trace"]).stem == "trace-a" and r["workload"] == "paper"]
    if not mine:
        return []
    complete = [r["policy"] for r in mine if r["runs_all_completed"] == r["runs"]]
    partial = [f"{r['policy']} ({r['completed']}/{r['requests']})" for r in mine if r["runs_all_completed"] < r["runs"]]
    ours = [p for p in complete if p.startswith("orbitweaver")]
    others = [p for p in complete if not p.startswith("orbitweaver")]
    verdict = (
        "holds here"
        if ours and not others
        else "does not hold here: baselines complete too"
        if others
        else "does not hold here: orbitweaver does not complete both requests in every seed"
    )
    return [
        "## The paper's Trace A claim",
        "",
        'Paper, Sec. 7.2: "in short Trace A, only OrbitWeaver completes two specified requests". Trace-a, the '
        "paper's workload, every seed: completed both requests in every seed: "
        + (", ".join(complete) or "nobody")
        + "; did not: "
        + (", ".join(partial) or "nobody")
        + f". The claim {verdict}.",
        "",
    ]


def _mean(values):
    values = [v for v in values if v is not None]
    return statistics.mean(values) if values else None


def _fmt(value, spec=".1f", none="-"):
    return none if value is None else format(value, spec)


def finished(request: RequestReport) -> bool:
    """Completed as the report counts it: its result came and its COMPLETED report was seen
    within the trace (which gives its end-to-end time). A result whose COMPLETED report was
    missed has no end-to-end time: that request counts as not completed."""
    return request.completed and request.e2e_trace_s is not None


def _makespan_trace_s(run: CampaignCell) -> float:
    """The last request's end-to-end time (trace s) of a run whose requests all finished."""
    ends = [q.e2e_trace_s for q in run.report.requests if q.e2e_trace_s is not None]
    assert len(ends) == len(run.report.requests), "a finished request has its end-to-end time"
    return max(ends)


def summarise(cells: list[CampaignCell]) -> list[dict]:
    """One row per workload x trace x policy, over seeds: requests completed, outputs, end-to-end
    (mean over completed requests; mean of the per-seed maxima for seeds that completed all)."""
    groups: dict[tuple, list[CampaignCell]] = {}
    for c in cells:
        groups.setdefault((c.workload, c.trace, c.policy), []).append(c)
    rows = []
    for (workload, trace, policy), group in groups.items():
        requests = [q for c in group for q in c.report.requests]
        done = [q for q in requests if finished(q)]
        complete_runs = [c for c in group if all(finished(q) for q in c.report.requests)]
        rows.append(
            {
                "workload": workload,
                "trace": trace,
                "policy": policy,
                "seeds": sorted(c.seed for c in group),
                "requests": len(requests),
                "completed": len(done),
                "completion_rate": len(done) / len(requests) if requests else 0.0,
                "runs_all_completed": len(complete_runs),
                "runs": len(group),
                # every output that came back is checked, counted as completed or not
                "bitwise": all(q.correct for q in requests if q.completed) if done else None,
                "e2e_mean_trace_s": _mean(q.e2e_trace_s for q in done),
                "makespan_trace_s": _mean(_makespan_trace_s(c) for c in complete_runs),
                "cuts": sum(c.report.cuts_total for c in group),
                "lost_units": sum(sum(sum(q.work_lost_units) for q in c.report.requests) for c in group),
                "mib_written": sum(c.report.bytes_written for c in group) / 2**20,
            }
        )
    return rows


def _outputs(run: dict) -> str:
    if run["completed"].startswith("0/"):
        return "none completed"
    return "bitwise equal" if run["correct"] else "MISMATCH"


def completion_text(row: dict) -> str:
    if row["completed"] == 0:
        return f"**none completed** (0/{row['requests']})"
    text = f"{row['completed']}/{row['requests']} ({row['completion_rate']:.0%})"
    return text if row["bitwise"] else text + " **MISMATCH**"


def speedups(rows: list[dict], reference: str) -> list[dict]:
    """Baseline makespan / `reference`'s, per workload and trace, only where both completed every
    request in every seed; otherwise the reason."""
    by = {(r["workload"], r["trace"], r["policy"]): r for r in rows}
    out = []
    for (workload, trace, policy), row in by.items():
        if policy == reference:
            continue
        ref = by.get((workload, trace, reference))
        if ref is None:
            continue
        both = (
            row["runs_all_completed"] == row["runs"]
            and ref["runs_all_completed"] == ref["runs"]
            and row["makespan_trace_s"]
            and ref["makespan_trace_s"]
        )
        out.append(
            {
                "workload": workload,
                "trace": trace,
                "policy": policy,
                "ratio": row["makespan_trace_s"] / ref["makespan_trace_s"] if both else None,
                "why_not": None
                if both
                else (
                    f"{policy} completed {row['completed']}/{row['requests']}, "
                    f"{reference} {ref['completed']}/{ref['requests']}"
                ),
            }
        )
    return out


def farm_lines(runs: list[dict]) -> list[str]:
    """The report's bench farm section: where each run ran, and every run that ran again and why
    (none on this machine: no section)."""
    farmed = [r for r in runs if r.get("bench")]
    if not farmed:
        return []
    again = [r for r in farmed if r["run_again_because"]]
    lines = [
        "## Bench farm",
        "",
        f'{len(farmed)} of {len(runs)} runs ran on a bench farm (docs/hil.md "Bench farm"), on '
        f"{len({r['bench'] for r in farmed})} bench(es); {len(again)} of them ran again after losing a "
        "bench under them, each counted once (its last, finished run).",
        "",
        "| trace | workload | policy | seed | ran on | run again because |",
        "|---|---|---|---|---|---|",
    ]
    for r in farmed:
        lines.append(
            f"| {Path(r['trace']).stem} | {r['workload']} | {r['policy']} | {r['seed']} | {r['bench']} | "
            + ("; ".join(r["run_again_because"]) or "-")
            + " |"
        )
    return lines + [""]


def write_report(out: Path, cells: list[CampaignCell]) -> Path:
    # lazy: matplotlib (~0.5 s), only to draw the plots
    import matplotlib

    matplotlib.use("Agg")
    # lazy: matplotlib (~0.5 s), only to draw the plots
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    runs = []
    for c in cells:
        report = c.report
        done = [q for q in report.requests if finished(q)]
        runs.append(
            {
                "trace": c.trace,
                "workload": c.workload,
                "policy": c.policy,
                "cadence": c.cadence,
                "seed": c.seed,
                "completed": f"{len(done)}/{len(report.requests)}",
                "completion_rate": len(done) / max(1, len(report.requests)),
                "correct": report.all_correct,
                "e2e_trace_s": _mean(q.e2e_trace_s for q in done),
                "cuts": report.cuts_total,
                "recovery_s": _mean(x for q in report.requests for x in q.recovery_latency_s),
                "lost_units": sum(sum(q.work_lost_units) for q in report.requests),
                "mib_written": report.bytes_written / 2**20,
                "energy_j": report.energy_j,
                "wall_s": report.wall_s,
                "start_residual_s": report.start_residual_s,
                # a bench farm's: where the run ran, and why earlier tries of it were lost
                "bench": c.bench or None,
                "run_again_because": list(c.lost),
            }
        )
    rows = summarise(cells)
    reference = next((r["policy"] for r in rows if r["policy"].startswith("orbitweaver")), None)
    ratios = speedups(rows, reference) if reference else []
    (out / "campaign.json").write_text(
        json.dumps(
            {"summary": rows, "ratios": ratios, "rows": runs, "runs": [c.report.to_json() for c in cells]}, indent=2
        )
    )
    workloads = list(dict.fromkeys(c.workload for c in cells))
    traces_ = list(dict.fromkeys(c.trace for c in cells))
    policies = list(dict.fromkeys(c.policy for c in cells))
    plots = []
    keys = [(w, t) for w in workloads for t in traces_]
    for metric, label, fname in (
        ("e2e_mean_trace_s", "mean end-to-end time of completed requests (trace s)", "e2e.png"),
        ("completion_rate", "requests completed (fraction)", "completion.png"),
        ("mib_written", "MiB written by the payload (all seeds)", "bytes.png"),
    ):
        fig, ax = plt.subplots(figsize=(2.0 + 1.3 * len(keys), 3.4))
        width = 0.8 / max(1, len(policies))
        for i, policy in enumerate(policies):
            vals = [
                next(
                    (r[metric] or 0.0 for r in rows if (r["workload"], r["trace"], r["policy"]) == (w, t, policy)), 0.0
                )
                for w, t in keys
            ]
            ax.bar([k + i * width for k in range(len(keys))], vals, width, label=policy)
        ax.set_xticks(
            [k + width * (len(policies) - 1) / 2 for k in range(len(keys))],
            [f"{Path(t).stem}\n{w}" for w, t in keys],
            fontsize=7,
        )
        ax.set_ylabel(label, fontsize=8)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / fname, dpi=110)
        plt.close(fig)
        plots.append((label, fname))
    seeds = sorted({c.seed for c in cells})
    lines = [
        "# Testbench campaign",
        "",
        f"{len(cells)} runs: traces {', '.join(traces_)}; workloads {', '.join(workloads)}; policies "
        f"{', '.join(policies)}; seeds {', '.join(str(s) for s in seeds)}.",
        "Real bus and payload processes (SIGKILL at every cut), real ZeroMQ/CurveZMQ link, this machine's CPU, "
        "paced and time-scaled as each run's line says, the payload's boot emulated (docs/hil.md). A request "
        "counts as completed when its COMPLETED report comes within the trace; every output is checked bit for "
        "bit against an uninterrupted reference.",
        "",
        "## Completion and end-to-end time",
        "",
        "Per workload and trace, over the seeds: requests completed, and the mean end-to-end time (trace s) "
        "of the completed ones.",
        "",
        "| workload | trace | " + " | ".join(policies) + " |",
        "|---|---|" + "---|" * len(policies),
    ]
    for w, t in keys:
        cells_text = []
        for policy in policies:
            row = next((r for r in rows if (r["workload"], r["trace"], r["policy"]) == (w, t, policy)), None)
            if row is None:
                cells_text.append("-")
            else:
                e2e = f", {row['e2e_mean_trace_s']:.0f} s" if row["e2e_mean_trace_s"] else ""
                cells_text.append(completion_text(row) + e2e)
        lines.append(f"| {w} | {Path(t).stem} | " + " | ".join(cells_text) + " |")
    if ratios:
        lines += [
            "",
            f"## Speed-up of {reference}",
            "",
            f"Baseline makespan (the last request of a run to complete) / {reference}'s, mean over seeds. Formed "
            "only where both completed every request of every seed: a policy that completes less is not "
            "slower by some ratio, it fails.",
            "",
            "| workload | trace | policy | makespan ratio |",
            "|---|---|---|---|",
        ]
        for r in ratios:
            lines.append(
                f"| {r['workload']} | {Path(r['trace']).stem} | {r['policy']} | "
                + (f"{r['ratio']:.2f}x" if r["ratio"] else f"n/a: {r['why_not']}")
                + " |"
            )
    lines += [""] + trace_a_claim(rows)
    lines += [
        "## Every run",
        "",
        "| trace | workload | policy | seed | completed | outputs | mean e2e (trace s) | cuts | "
        "mean recovery (wall s) | units lost | MiB written | start-up after boot (s) | wall (s) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in runs:
        lines.append(
            f"| {Path(row['trace']).stem} | {row['workload']} | {row['policy']} | {row['seed']} | "
            f"{row['completed']} | {_outputs(row)} | "
            f"{_fmt(row['e2e_trace_s'], '.0f')} | {row['cuts']} | {_fmt(row['recovery_s'], '.2f')} | "
            f"{row['lost_units']} | {row['mib_written']:.1f} | {_fmt(row['start_residual_s'], '.2f')} | "
            f"{row['wall_s']:.0f} |"
        )
    lines += ["", "Per-run details: `runs/<trace>-<workload>-s<seed>-<policy>/summary.txt` and `report.json`.", ""]
    lines += farm_lines(runs)
    for label, fname in plots:
        lines += [f"## {label[0].upper() + label[1:]}", "", f"![{label}]({fname})", ""]
    lines += [
        "Definitions (docs/hil.md): end-to-end = task accepted (or the trace's start, if later) to "
        "COMPLETED, in trace seconds; recovery latency = payload power-up to the first progress report of "
        "the resumed task (emulated boot included); units lost = work units (vision blocks, prefill blocks, "
        "decode steps) done before a cut and done again after it; bytes written = the payload process's "
        "device-level writes (/proc write_bytes) summed over power cycles.",
        "",
    ]
    path = out / "report.md"
    path.write_text("\n".join(lines))
    return path


if __name__ == "__main__":
    import sys

    if len(sys.argv) != 3 or sys.argv[1] != "report":
        sys.exit("usage: python -m hil.campaign report CAMPAIGN_DIR   (rewrite report.md from campaign.json)")
    print(write_report(Path(sys.argv[2]), load_cells(Path(sys.argv[2]))))
