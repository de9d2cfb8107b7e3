"""The scheduler: one piece of code that decides what runs, for the real engine and the simulator.

It is pure decision logic with time passed in (`now`, seconds): no threads, no sleeping, no
tensors. The real serving engine (`engine.py`) and the discrete-event simulator (`sim.py`) both
call the same three methods:

    submit(request)        a request arrived at the server
    plan(now)              what the next lockstep runs (or None when idle)
    complete(plan, now)    the lockstep finished; returns the requests whose action chunk is ready

`LockstepScheduler` is Robion's serving engine (§4.1): a VLM executor and an ADiT executor run
concurrently in *locksteps*. At each lockstep start it takes one fixed-size VLM batch from one
model's VLM queue and one fixed-size ADiT batch from one model's ADiT queue (the queue chosen by
ESF, RR or LQF), and sets the VLM share of SMs (GPU) or threads (CPU) that the profile says
minimises that pair's lockstep time. Requests that finished their VLM stage in lockstep k enter
the ADiT queue and run in a later lockstep. Batches are fixed for the whole stage: no request
joins a running batch, so nothing inspects or repacks buffers between denoising steps.

`SequentialScheduler` is the Monolithic baseline: one batch runs VLM then ADiT on the whole
device; the next batch starts when it is done.
"""

from __future__ import annotations

import bisect
import enum
import itertools
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from common.vla.profiles import ProfileTable


class Stage(enum.StrEnum):
    VLM = "vlm"
    ADIT = "adit"


_ids = itertools.count()


@dataclass(eq=False)
class VlaRequest:
    """One robot request. Times are seconds on the clock of whoever drives the scheduler."""

    model: str
    sent_at: float  # when the robot sent it (the SLO clock starts here)
    arrived_at: float  # when the server received it
    deadline: float  # sent_at + the model's SLO
    robot: str = ""
    request_id: int = field(default_factory=lambda: next(_ids))
    payload: Any = None  # real backend: PolicyInputs; simulator: None
    prefix: Any = None  # the VLM stage's output, handed to the ADiT stage
    result: Any = None  # the action chunk once the ADiT stage ran
    vlm_done_at: float | None = None
    done_at: float | None = None

    def remaining(self, now: float) -> float:
        return self.deadline - now


@dataclass(frozen=True)
class StageBatch:
    stage: Stage
    model: str
    arch: str
    requests: tuple[VlaRequest, ...]
    padded_size: int  # the fixed batch size the executor runs (pad rows are discarded)

    @property
    def size(self) -> int:
        return len(self.requests)


@dataclass(frozen=True)
class LockstepPlan:
    index: int
    vlm: StageBatch | None
    adit: StageBatch | None
    vlm_share: float  # fraction of SMs (GPU) or intra-op threads (CPU) given to the VLM stage
    sequential: bool = False  # Monolithic: VLM then ADiT on the whole device, same requests
    predicted_ms: float | None = None  # from the profile, when one is loaded


def plan_ms(profile: ProfileTable, plan: LockstepPlan) -> float:
    """Predicted duration of a plan on `profile`'s device (the simulator's clock advances by
    this). Here, not on the profile: a profile is a table the scheduler reads and knows no plan."""
    if plan.sequential:
        assert plan.vlm is not None and plan.adit is not None  # sequential: both stages, same requests
        return profile.vlm_alone(plan.vlm.arch, plan.vlm.padded_size) + profile.adit_alone(
            plan.adit.arch, plan.adit.padded_size
        )
    v, a = plan.vlm, plan.adit
    share = None if (v is None or a is None) else plan.vlm_share
    return profile.lockstep(
        v.arch if v else None,
        v.padded_size if v else 0,
        a.arch if a else None,
        a.padded_size if a else 0,
        share=share,
    ).lockstep_ms


@dataclass(frozen=True)
class PlanRecord:
    """What a lockstep ran, without timing: identical for the engine and the simulator."""

    index: int
    vlm_model: str | None
    vlm_requests: tuple[int, ...]
    adit_model: str | None
    adit_requests: tuple[int, ...]
    vlm_share: float
    sequential: bool

    @classmethod
    def of(cls, plan: LockstepPlan, ids: Callable[[VlaRequest], int] = lambda r: r.request_id) -> PlanRecord:
        def part(b):
            return (b.model, tuple(ids(r) for r in b.requests)) if b else (None, ())

        vm, vr = part(plan.vlm)
        am, ar = part(plan.adit)
        return cls(plan.index, vm, vr, am, ar, plan.vlm_share, plan.sequential)


# ---------------------------------------------------------------- queue policies


class QueuePolicy(ABC):
    """Chooses which model's queue a stage serves at a lockstep."""

    name: str

    @abstractmethod
    def pick(self, queues: Mapping[str, deque], now: float) -> str | None: ...


class EarliestSloFirst(QueuePolicy):
    """ESF: the queue whose head request has the least remaining SLO time (Robion §4.1.3)."""

    name = "esf"

    def pick(self, queues, now):
        ready = [(q[0].remaining(now), m) for m, q in queues.items() if q]
        return min(ready)[1] if ready else None


class RoundRobin(QueuePolicy):
    """RR: non-empty queues in turn, in a fixed model order."""

    name = "rr"

    def __init__(self) -> None:
        self._last: str | None = None

    def pick(self, queues, now):
        order = sorted(queues)
        if self._last in order:
            i = order.index(self._last) + 1
            order = order[i:] + order[:i]
        for m in order:
            if queues[m]:
                self._last = m
                return m
        return None


class LongestQueueFirst(QueuePolicy):
    """LQF: the longest queue (ties: earliest head deadline)."""

    name = "lqf"

    def pick(self, queues, now):
        ready = [(-len(q), q[0].remaining(now), m) for m, q in queues.items() if q]
        return min(ready)[2] if ready else None


POLICIES: dict[str, type[QueuePolicy]] = {"esf": EarliestSloFirst, "rr": RoundRobin, "lqf": LongestQueueFirst}


def make_policy(name: str) -> QueuePolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown queue policy {name!r}; choose from {', '.join(POLICIES)}") from None


# ---------------------------------------------------------------- schedulers


class _SchedulerBase:
    """max_batch: one cap for every model, or a cap per model (models absent from the mapping
    get the largest fixed batch size). Each cap must be one of the fixed batch sizes."""

    def __init__(
        self,
        models: Mapping[str, str],
        *,
        policy: str = "esf",
        max_batch: int | Mapping[str, int] = 4,
        batch_sizes: tuple[int, ...] | None = None,
        profile: ProfileTable | None = None,
        record: bool = True,
    ):
        if not models:
            raise ValueError("a scheduler needs at least one model")
        self.models = dict(models)  # model name -> architecture name
        self.profile = profile
        sizes = tuple(sorted(batch_sizes or (profile.batch_sizes if profile else (1, 2, 4, 8))))
        if isinstance(max_batch, Mapping):
            caps = {m: int(max_batch.get(m, sizes[-1])) for m in self.models}
        else:
            caps = {m: int(max_batch) for m in self.models}
        for m, cap in caps.items():
            if cap not in sizes:
                raise ValueError(f"max batch {cap} for {m} is not one of the fixed batch sizes {sizes}")
        self.max_batch_of = caps
        self.max_batch = max(caps.values())
        self.batch_sizes = tuple(b for b in sizes if b <= self.max_batch)
        self.policy_name = policy
        self._index = 0
        self.trace: list[PlanRecord] | None = [] if record else None

    def padded(self, n: int) -> int:
        return self.batch_sizes[bisect.bisect_left(self.batch_sizes, n)]

    def _take(self, stage: Stage, model: str, queue: deque) -> StageBatch:
        reqs = tuple(queue.popleft() for _ in range(min(len(queue), self.max_batch_of[model])))
        return StageBatch(stage, model, self.models[model], reqs, self.padded(len(reqs)))

    def _emit(self, plan: LockstepPlan) -> LockstepPlan:
        self._index += 1
        if self.trace is not None:
            self.trace.append(PlanRecord.of(plan))
        return plan

    def _check_model(self, req: VlaRequest) -> None:
        if req.model not in self.models:
            raise KeyError(f"model {req.model!r} is not served here (serving: {', '.join(self.models)})")


class LockstepScheduler(_SchedulerBase):
    """Robion: concurrent VLM and ADiT executors in lockstep, shared by all co-located models.

    sm_mode: "dynamic" takes each batch pair's best VLM share from the profile (§4.1.2);
    "static" always uses `static_share` (the paper's ablation restricts the VLM to 96 of 188 SMs).
    Without a profile the share is `static_share`.
    """

    def __init__(
        self,
        models,
        *,
        policy="esf",
        max_batch=4,
        batch_sizes=None,
        profile=None,
        sm_mode: str = "dynamic",
        static_share: float = 0.5,
        record: bool = True,
    ):
        super().__init__(
            models, policy=policy, max_batch=max_batch, batch_sizes=batch_sizes, profile=profile, record=record
        )
        if sm_mode not in ("dynamic", "static"):
            raise ValueError("sm_mode is 'dynamic' or 'static'")
        self.sm_mode, self.static_share = sm_mode, static_share
        self.vlm_queues: dict[str, deque[VlaRequest]] = {m: deque() for m in self.models}
        self.adit_queues: dict[str, deque[VlaRequest]] = {m: deque() for m in self.models}
        # Separate policy state per stage (RR keeps its own turn for each executor).
        self._vlm_policy, self._adit_policy = make_policy(policy), make_policy(policy)

    def submit(self, req: VlaRequest) -> None:
        self._check_model(req)
        self.vlm_queues[req.model].append(req)

    def pending(self) -> int:
        return sum(map(len, self.vlm_queues.values())) + sum(map(len, self.adit_queues.values()))

    def plan(self, now: float) -> LockstepPlan | None:
        vm = self._vlm_policy.pick(self.vlm_queues, now)
        am = self._adit_policy.pick(self.adit_queues, now)
        if vm is None and am is None:
            return None
        vlm = self._take(Stage.VLM, vm, self.vlm_queues[vm]) if vm else None
        adit = self._take(Stage.ADIT, am, self.adit_queues[am]) if am else None
        share, predicted = self.static_share, None
        if self.profile is not None:
            entry = self.profile.lockstep(
                vlm.arch if vlm else None,
                vlm.padded_size if vlm else 0,
                adit.arch if adit else None,
                adit.padded_size if adit else 0,
                share=None if self.sm_mode == "dynamic" else self.static_share,
            )
            share, predicted = entry.vlm_share, entry.lockstep_ms
        return self._emit(LockstepPlan(self._index, vlm, adit, share, False, predicted))

    def complete(self, plan: LockstepPlan, now: float) -> list[VlaRequest]:
        if plan.vlm:
            for r in plan.vlm.requests:  # FIFO within a model keeps each queue in deadline order
                r.vlm_done_at = now
                self.adit_queues[r.model].append(r)
        done = list(plan.adit.requests) if plan.adit else []
        for r in done:
            r.done_at = now
        return done


class SequentialScheduler(_SchedulerBase):
    """Monolithic baseline: VLM and ADiT as one pipeline over the whole device, one batch at a time."""

    def __init__(self, models: Mapping[str, str], **options: Any) -> None:
        """The base's options (policy, max_batch, batch_sizes, profile, record)."""
        super().__init__(models, **options)
        self.queues: dict[str, deque[VlaRequest]] = {m: deque() for m in self.models}
        self._policy = make_policy(self.policy_name)

    def submit(self, req: VlaRequest) -> None:
        self._check_model(req)
        self.queues[req.model].append(req)

    def pending(self) -> int:
        return sum(map(len, self.queues.values()))

    def plan(self, now: float) -> LockstepPlan | None:
        m = self._policy.pick(self.queues, now)
        if m is None:
            return None
        vlm = self._take(Stage.VLM, m, self.queues[m])
        adit = StageBatch(Stage.ADIT, m, vlm.arch, vlm.requests, vlm.padded_size)
        predicted = None
        if self.profile is not None:
            predicted = self.profile.vlm_alone(vlm.arch, vlm.padded_size) + self.profile.adit_alone(
                vlm.arch, vlm.padded_size
            )
        return self._emit(LockstepPlan(self._index, vlm, adit, 1.0, True, predicted))

    def complete(self, plan: LockstepPlan, now: float) -> list[VlaRequest]:
        assert plan.vlm is not None  # a sequential plan always runs its requests' VLM stage
        for r in plan.vlm.requests:
            r.vlm_done_at = r.done_at = now
        return list(plan.vlm.requests)


SYSTEMS = ("robion", "monolithic")


def make_scheduler(system: str, models: Mapping[str, str], **kw) -> LockstepScheduler | SequentialScheduler:
    if system == "robion":
        return LockstepScheduler(models, **kw)
    if system == "monolithic":
        kw.pop("sm_mode", None)
        kw.pop("static_share", None)
        return SequentialScheduler(models, **kw)
    raise ValueError(f"unknown system {system!r}; the shared scheduler drives {', '.join(SYSTEMS)}")
