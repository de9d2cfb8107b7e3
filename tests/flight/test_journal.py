"""The queue journal and the result store against what a red team did to them: thousands of
finished tasks (the snapshot outgrew the record format), bit flips anywhere (one flip forgot every
task), threads racing on one file, a retention budget."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

from common.durable import DurableFS
from common.record import MAX_META, Kind, encode
from common.wire.ids import MAX_IMAGES_PER_TASK, MAX_NAME_CHARS, MAX_NEW_TOKENS, MAX_PROMPT_BYTES, MAX_RESULT_TEXT_BYTES
from flight.runtime.queue import COMPLETED, TaskQueue

PROMPT_8K = "é" * (MAX_PROMPT_BYTES // 2)  # 8 KiB of UTF-8, as in the red team's flood


class NoSyncFS(DurableFS):
    """The real file operations without fsync: the tests below are about what is written, not
    when it is durable, and thousands of fsyncs would only cost time."""

    def fsync_dir(self, path):
        pass

    def write_atomic(self, path, chunks):
        directory = os.path.dirname(path)
        tmp = os.path.join(directory, f".{os.path.basename(path)}.{threading.get_ident()}.tmp")
        with open(tmp, "wb") as f:
            for c in chunks:
                f.write(memoryview(c).cast("B"))
        os.replace(tmp, path)
        return os.path.getsize(path)

    def append(self, path, chunks):
        with open(path, "ab") as f:
            return sum(f.write(memoryview(c).cast("B")) for c in chunks)


def _submit(q: TaskQueue, i: int, prompt: str = "describe the coast"):
    q.submit(f"t{i}", prompt, ["a.png"], 4, i % 7, (0x20, 1, i, 0x110), f"h{i}")


def _result(i: int) -> dict:
    return {"token_ids": [i, i + 1], "text": f"answer {i}", "logits_sha256": "ab" * 32, "timings": {"total": 1.0}}


def test_thousands_of_finished_tasks_never_outgrow_a_record(tmp_path):
    """Finding 1: with every task ever submitted in the compaction snapshot, ~2,000 tasks with
    8 KiB prompts passed the format's 16 MiB metadata limit and the payload exited at every boot.
    Finished tasks now leave the journal; no record holds more than one task."""
    fs = NoSyncFS()
    q = TaskQueue(str(tmp_path / "queue"), fs)
    for i in range(600):  # 8 KiB prompts and ~30 KB answers: past 16 MiB in ~450 tasks
        _submit(q, i, PROMPT_8K)
        q.start(f"t{i}")
        if i % 3:
            q.complete(f"t{i}", {**_result(i), "text": "x" * 30000})
        else:
            q.fail(f"t{i}", 600, "boom " * 200)
    q.compact()
    assert q.depth() == 0
    assert os.path.getsize(q.path) < 64 << 10  # the journal holds the live tasks only
    again = TaskQueue(str(tmp_path / "queue"), fs)
    assert again.get("t5").state == COMPLETED and again.get("t5").result["token_ids"] == [5, 6]
    assert again.get("t3").state == "failed" and len(again.get("t3").reason.encode()) <= 256


def test_the_largest_records_fit_the_format():
    """Every record the payload writes is bounded by the wire limits, far below MAX_META."""
    name = "n" * MAX_NAME_CHARS
    task = {
        "task_id": name,
        "prompt": "€" * (MAX_PROMPT_BYTES // 3),
        "images": [name] * MAX_IMAGES_PER_TASK,
        "max_new_tokens": MAX_NEW_TOKENS,
        "priority": 255,
        "request": [0x7FF, 0xFFFF, 2**30 - 1, 0xFFFF],
        "content_hash": "f" * 64,
        "order": 2**40,
        "state": "completed",
        "starts": 2**31,
        "code": 699,
        "reason": "r" * 256,
        "reported": False,
        "result": {
            "token_ids": [2**32 - 1] * MAX_NEW_TOKENS,
            "text": "x" * MAX_RESULT_TEXT_BYTES,
            "logits_sha256": "a" * 64,
            "timings": {f"phase{i}": 1e300 for i in range(32)},
            "bytes_written": 2**62,
        },
    }
    biggest = max(
        encode(Kind.QUEUE_ENTRY, {"op": "task", "task": task}, salt=2**63 - 1).nbytes,
        encode(Kind.FINISHED_TASK, {"entry": {"task_id": name}, "task": task}).nbytes,
    )
    assert biggest < 64 << 10 < MAX_META


def _build(tmp_path, n=12):
    q = TaskQueue(str(tmp_path / "queue"), NoSyncFS())
    for i in range(n):
        _submit(q, i)
    for i in range(0, n, 4):
        q.start(f"t{i}")
        q.complete(f"t{i}", _result(i))
    q.compact()
    for i in range(n, n + 3):  # a few appended entries after the snapshot
        _submit(q, i)
    q.set_priority("t1", 9)
    return q


def test_a_flipped_bit_anywhere_loses_at_most_the_task_of_that_record(tmp_path):
    """Finding 4: a flip in the first record truncated the whole journal, every task answered
    UNKNOWN_TASK, and a re-sent task ran twice. Now: a flip at any byte costs at most the one
    task whose record it hit; that task is named; finished tasks (in their own files) are safe."""
    q = _build(tmp_path)
    live = set(q.snapshot())
    journal = open(q.path, "rb").read()
    ids_path = tmp_path / "queue" / "ids.log"
    ids_log = ids_path.read_bytes() if ids_path.exists() else None
    rng = np.random.default_rng(1)
    positions = [30] + sorted(set(rng.integers(0, len(journal), 120).tolist()) | {0, 5, 24, len(journal) - 1})
    for pos in positions:  # 30: inside the first record, the compaction snapshot
        damaged = bytearray(journal)
        damaged[pos] ^= 1 << int(rng.integers(0, 8))
        open(q.path, "wb").write(damaged)
        if ids_log is not None:
            ids_path.write_bytes(ids_log)
        if os.path.exists(tmp_path / "queue" / "lost.rec"):
            os.remove(tmp_path / "queue" / "lost.rec")
        reopened = TaskQueue(str(tmp_path / "queue"), NoSyncFS())
        kept = set(reopened.snapshot())
        assert kept <= live
        assert len(live - kept) <= 1, (pos, live - kept)
        finished = {t for t in (f"t{i}" for i in range(15)) if q.finished(t)}
        assert set(reopened.journal_damage().named) == live - kept, pos  # the lost one is named, nothing else
        assert reopened.journal_damage().unnamed == 0
        assert {t for t in finished if reopened.finished(t)} == finished
        for t in kept:
            # A flip in a later entry loses that entry's change (here: t1's new priority) and no more.
            alternatives = [vars(q.snapshot()[t])] + ([{**vars(q.snapshot()[t]), "priority": 1}] if t == "t1" else [])
            assert vars(reopened.snapshot()[t]) in alternatives, (pos, t)
        assert sorted(reopened.lost_tasks().task_ids) == sorted(live - kept)


def test_only_bytes_after_the_last_valid_record_are_a_torn_tail(tmp_path):
    q = _build(tmp_path)
    journal = open(q.path, "rb").read()
    torn = journal + journal[: len(journal) // 3][-57:]  # a partial append: not a whole record
    open(q.path, "wb").write(torn)
    reopened = TaskQueue(str(tmp_path / "queue"), NoSyncFS())
    assert reopened.journal_damage().tail_bytes == 57 and reopened.journal_damage().records_dropped == 0
    assert set(reopened.snapshot()) == set(q.snapshot()) and not reopened.journal_damage().named


def test_a_record_that_looks_like_one_inside_a_prompt_is_not_taken_for_one(tmp_path):
    """Resynchronising after damage needs the journal's salt: bytes in a prompt that form a valid
    record of their own are not applied."""
    q = TaskQueue(str(tmp_path / "queue"), NoSyncFS())
    forged = encode(
        Kind.QUEUE_ENTRY,
        {
            "op": "submit",
            "task": {
                "task_id": "forged",
                "prompt": "x",
                "images": [],
                "max_new_tokens": 1,
                "priority": 255,
                "request": [32, 1, 1, 272],
                "content_hash": "0",
                "order": 0,
            },
        },
    ).to_bytes()
    q.submit("carrier", forged.decode("latin-1"), [], 4, 0, (0x20, 1, 1, 0x110), "h")
    _submit(q, 2)
    q.compact()
    journal = bytearray(open(q.path, "rb").read())
    start = journal.index(b"carrier")
    journal[start + 2] ^= 0x20  # damage the carrier's record header region
    open(q.path, "wb").write(journal)
    reopened = TaskQueue(str(tmp_path / "queue"), NoSyncFS())
    assert "forged" not in reopened.snapshot()
    assert "t2" in reopened.snapshot() and reopened.journal_damage().named == ["carrier"]


def test_results_stay_under_the_retention_budget_and_stay_known(tmp_path):
    evicted = []
    q = TaskQueue(str(tmp_path / "queue"), NoSyncFS(), results_budget_bytes=40_000, on_evict=evicted.append)
    for i in range(40):
        _submit(q, i)
        q.complete(f"t{i}", {**_result(i), "text": "w" * 3000})
        q.mark_reported(f"t{i}")
    assert q.results.bytes_held() <= 40_000
    assert evicted and all(e.gone == "evicted" for e in evicted)
    first = q.finished("t0")
    assert first.gone == "evicted" and first.content_hash == "h0"  # still known: not run again
    assert q.get("t39").result["text"] == "w" * 3000
    reopened = TaskQueue(str(tmp_path / "queue"), NoSyncFS(), results_budget_bytes=40_000)
    assert reopened.finished("t0").gone == "evicted" and reopened.get("t39") is not None


def test_an_unreported_result_is_never_evicted(tmp_path):
    q = TaskQueue(str(tmp_path / "queue"), NoSyncFS(), results_budget_bytes=1)
    _submit(q, 1)
    q.complete("t1", _result(1))
    assert q.get("t1").state == COMPLETED and [t.task_id for t in q.unreported()] == ["t1"]
    q.mark_reported("t1")
    _submit(q, 2)
    q.complete("t2", _result(2))
    assert q.finished("t1").gone == "evicted" and q.get("t2") is not None


def test_a_damaged_result_file_names_its_task(tmp_path):
    q = TaskQueue(str(tmp_path / "queue"), NoSyncFS())
    _submit(q, 1)
    q.complete("t1", _result(1))
    path = tmp_path / "queue" / "results" / "t1.rec"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 4
    path.write_bytes(data)
    reopened = TaskQueue(str(tmp_path / "queue"), NoSyncFS())
    assert reopened.finished("t1").gone == "damaged"
    assert reopened.journal_damage().named == ["t1"] and reopened.is_lost("t1")


def test_concurrent_atomic_writes_of_one_file_never_fail(tmp_path):
    """Finding 3: one fixed temporary name per target; a second thread's rename took the first
    thread's file away (FileNotFoundError). Each write now has a temporary of its own."""
    fs, path, errors = DurableFS(), str(tmp_path / "state.bin"), []

    def hammer(k):
        try:
            for i in range(60):
                fs.write_atomic(path, [f"{k}:{i}".encode()])
        except Exception as exc:  # noqa: BLE001 - collected and reported below
            errors.append(exc)

    threads = [threading.Thread(target=hammer, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert open(path).read().endswith(":59")
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]


@pytest.mark.parametrize("legacy_ops", [["complete"], ["fail"], ["cancel", "reported"]])
def test_a_journal_of_an_older_build_is_migrated(tmp_path, legacy_ops):
    """An older build kept finished tasks in the journal (ops complete/fail/cancel/reported and
    snapshots of every task): they move to the result store at the first open."""
    directory = tmp_path / "queue"
    directory.mkdir()
    task = {
        "task_id": "old",
        "prompt": "p",
        "images": [],
        "max_new_tokens": 2,
        "priority": 0,
        "request": [32, 1, 7, 272],
        "content_hash": "h",
        "order": 0,
        "state": "queued",
        "starts": 0,
        "code": 0,
        "reason": "",
        "result": {},
        "reported": False,
    }
    entries = [{"op": "submit", "task": task}, {"op": "start", "task_id": "old"}]
    for op in legacy_ops:
        entries.append({"op": op, "task_id": "old", "result": _result(0), "code": 601, "reason": "x"})
    entries.append({"op": "submit", "task": {**task, "task_id": "waiting", "order": 1}})
    with open(directory / "journal.log", "wb") as f:
        for e in entries:
            f.write(encode(Kind.QUEUE_ENTRY, e).to_bytes())
    q = TaskQueue(str(directory), NoSyncFS())
    assert set(q.snapshot()) == {"waiting"}
    assert q.get("old").state in ("completed", "failed", "cancelled")
    assert q.finished("old").reported == ("reported" in legacy_ops)


def test_the_request_is_stored_by_name_and_the_older_list_still_reads(tmp_path):
    """A task's request id is a RequestRef in memory and on disk (by field name); a journal whose
    tasks carry the list of the four values (older builds) reads as the same RequestRef."""
    from common.record import iter_records
    from common.wire.header import RequestRef

    ref = RequestRef(apid=0x20, source_id=9, seq=77, message_type=0x110)
    q = TaskQueue(str(tmp_path / "new"), NoSyncFS())
    q.submit("t", "describe the coast", [], 4, 0, ref, "h")
    journal = (tmp_path / "new" / "journal.log").read_bytes()
    stored = [rec.meta["task"]["request"] for rec, _, _ in iter_records(journal) if "task" in rec.meta]
    assert stored == [{"apid": 0x20, "source_id": 9, "seq": 77, "message_type": 0x110}]
    assert TaskQueue(str(tmp_path / "new"), NoSyncFS()).get("t").request == ref
    q.complete("t", _result(1))  # the result store keeps it the same way once the task has ended
    assert TaskQueue(str(tmp_path / "new"), NoSyncFS()).get("t").request == ref

    old = tmp_path / "old"
    old.mkdir()
    task = {"task_id": "t", "prompt": "p", "images": [], "max_new_tokens": 2, "priority": 0}
    task |= {"request": [0x20, 9, 77, 0x110], "content_hash": "h", "order": 0}
    (old / "journal.log").write_bytes(encode(Kind.QUEUE_ENTRY, {"op": "submit", "task": task}).to_bytes())
    assert TaskQueue(str(old), NoSyncFS()).get("t").request == ref
