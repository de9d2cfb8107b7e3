"""Hammer a TaskQueue with a deterministic sequence of operations, printing each one's index
after it returns (= acknowledged). Killed at random instants by test_queue_kills.py."""

import sys

import numpy as np

from flight.runtime.queue import TaskQueue


def operations(run: int, n: int = 10_000):
    rng = np.random.default_rng(run)
    ids = []
    for i in range(n):
        kind = rng.choice(
            ["submit", "priority", "start", "complete", "fail", "cancel"], p=[0.4, 0.15, 0.15, 0.15, 0.05, 0.1]
        )
        if kind == "submit" or not ids:
            ids.append(f"r{run}-t{i}")
            yield ("submit", ids[-1], int(rng.integers(0, 9)))
        else:
            yield (str(kind), ids[int(rng.integers(0, len(ids)))], int(rng.integers(0, 9)))


def apply(q: TaskQueue, op):
    kind, task_id, value = op
    if kind == "submit":
        q.submit(task_id, "prompt " * value, ["a.png"], 4, value, (0x20, 1, value, 0x110), f"h{task_id}")
    elif kind == "priority":
        q.set_priority(task_id, value)
    elif kind == "start":
        q.start(task_id)
    elif kind == "complete":
        q.complete(task_id, {"token_ids": [value], "text": "x"})
    elif kind == "fail":
        q.fail(task_id, 600, "boom")
    else:
        q.cancel(task_id)


if __name__ == "__main__":
    directory, run = sys.argv[1], int(sys.argv[2])
    q = TaskQueue(directory)
    print("open", flush=True)
    for i, op in enumerate(operations(run)):
        apply(q, op)
        print(i, flush=True)
