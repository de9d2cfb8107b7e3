"""Result storage: DOWNLINK_RESULT until the task's TASK_RESULT comes (waiting for its COMPLETED
or FAILED if asked to), saved in local state with the time it came down."""

from __future__ import annotations

import time

from common.wire import ResponseCode
from common.wire import messages as m
from ground.client.session import CommandSession, after
from ground.client.tasks import TaskTracker
from ground.errors import CommandRejected, NoAnswer
from ground.images import check_operator_name
from ground.report import to_jsonable


class ResultStore:
    """Results asked for, waited for and kept: over a session's link, for tasks a tracker knows."""

    def __init__(self, session: CommandSession, tracker: TaskTracker):
        self.session = session
        self.tracker = tracker

    def result(
        self, task_id: str, *, wait: bool = False, max_wait_s: float | None = None, poll_s: float = 30.0
    ) -> m.TaskResult:
        """DOWNLINK_RESULT -> TASK_RESULT. With `wait`, a task not finished yet is waited for
        without asking again while it runs: its COMPLETED (then asked again), its FAILED
        (CommandRejected, failed=True), or `poll_s` passing with nothing heard about the task (no
        report, no event naming it: asked again, in case its COMPLETED was missed). So a running
        task answers RESULT_NOT_READY once, not once per poll (wire-protocol.md §3.6). Saves the
        result locally."""
        task_id = check_operator_name(task_id, "task id")
        self.tracker.track_task(task_id)
        deadline = None if max_wait_s is None else time.monotonic() + max_wait_s
        self.session.arrivals.watched.setdefault(task_id, ())
        said_silent = False
        completed_acted_on = -1  # arrival number of the last COMPLETED that made us ask again
        while True:
            known = self.session.state.task(task_id) or {}
            if wait and known.get("state") in ("failed", "cancelled"):
                code = ResponseCode.__members__.get(str(known.get("code")), ResponseCode.INTERNAL_ERROR)
                raise CommandRejected(f"task {task_id}", code, known.get("reason", ""), failed=True)
            try:
                _, result = self.session.transact(
                    m.DownlinkResult(task_id=task_id),
                    f"DOWNLINK_RESULT {task_id}",
                    reply=lambda mark: after(self.session.arrivals.results.get(task_id), mark),
                )
                self._store_result(result)
                return result
            except CommandRejected as exc:
                if not wait or exc.code != ResponseCode.RESULT_NOT_READY:
                    raise
                # Any final report seen in this session counts, even one that came before we asked.
                seen = self.session.arrivals.task_final.get(task_id)
                if seen is not None and isinstance(seen[1], m.Failed):
                    raise CommandRejected(f"task {task_id}", seen[1].code, seen[1].reason, failed=True) from None
                if seen is not None and seen[0] > completed_acted_on:
                    completed_acted_on = seen[0]  # completed meanwhile: ask again at once
                    continue
                self._follow_task(task_id, deadline, poll_s)
            except NoAnswer as exc:
                if not wait:
                    raise
                if not said_silent:
                    self.session.notify(f"{exc}; still waiting")
                    said_silent = True
                # The DOWNLINK_RESULT waits at the bus for the payload's next power-up; more of
                # them would only queue there. Follow the task instead, as while it runs.
                self._follow_task(task_id, deadline, poll_s)
            if deadline is not None and time.monotonic() >= deadline:
                raise NoAnswer(f"task {task_id}: no result within {max_wait_s:g} s")

    def _follow_task(self, task_id: str, deadline: float | None, poll_s: float) -> None:
        """Pump packets until the task's COMPLETED or FAILED arrives (FAILED raises), `poll_s`
        passes with nothing heard about the task, or the deadline."""
        mark = self.session.arrivals.count
        since = time.monotonic()

        def done() -> object | None:
            final = after(self.session.arrivals.task_final.get(task_id), mark)
            if final is not None:
                return final
            now = time.monotonic()
            if now - max(since, self.session.arrivals.task_heard.get(task_id, since)) >= poll_s:
                return "quiet"
            if deadline is not None and now >= deadline:
                return "deadline"
            return None

        final = self.session.wait(done, float("inf"))
        if isinstance(final, m.Failed):
            raise CommandRejected(f"task {task_id}", final.code, final.reason, failed=True) from None

    def _store_result(self, result: m.TaskResult) -> None:
        record = to_jsonable(result)
        record["downlinked"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        self.session.state.save_result(result.task_id, record)
        if self.session.state.task(result.task_id) is not None:
            self.session.state.update_task(result.task_id, state="completed", result_tokens=len(result.token_ids))
