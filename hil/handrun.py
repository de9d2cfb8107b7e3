"""The README's "The whole system by hand", as a script: the same commands, in the same order, run
the way a person runs them in three terminals, with how long each took.

    python -m hil.handrun [--workdir DIR] [--keep-going S]

The README's code block is made from `STEPS` (`readme_block()`), and `tests/hil/test_handrun.py`
checks that the README shows exactly that block and runs this script on the demo trace with the
tiny model, so the README and the commands cannot drift apart.

Run from the repository root (or with --workdir: a directory that has, or links, `hil/samples/`),
it writes models/tiny, runs/req1, runs/bus and keys/ there. `ow` is this interpreter's `python -m
common.cli`, so it runs from a checkout without the `ow` entry point. The ground and the bus take
their endpoints from $OW_COMMANDS_ENDPOINT, $OW_PAYLOAD_ENDPOINT and $OW_TELEMETRY_ENDPOINT
(defaults: loopback ports 5550-5552), as the commands do.

What it does with the terminals: terminal 1's bus and terminal 2's `events --follow` run in the
background until the result is in (the bus keeps running after its trace ends, until Ctrl-C);
then both get the Ctrl-C (SIGINT) a person would give them. Exit status 0 when every command
did what the README says (each exit status 0, the result printed), 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from common.wire.link import Endpoints

TASK_ID = "TASK_ID"  # in a command: the task id the uplink printed


@dataclass(frozen=True)
class Step:
    """One command of the README's block. `terminal`: where a person types it (1, 2, 3). `mode`:
    `run` (wait for it to end), `follow` (keeps running until Ctrl-C: started in the background),
    `task` (its output is the TASK_ID of the commands after it). `note`: the comment line(s)
    shown above it in the README."""

    terminal: int
    command: str
    mode: str = "run"
    note: str = ""


# The commands, as the README shows them (one shell line each; `\` continuations are README
# layout only: readme_block() folds long ones the same way every time).
STEPS: tuple[Step, ...] = (
    Step(
        1,
        "ow model build-tiny --arch qwen3-vl --size tiny --seed 0 --out models/tiny",
        note="terminal 1 (5 s): a tiny Qwen3-VL with seeded random weights -- it answers with random words;\n"
        "for real answers point --model at a real checkpoint (below)",
    ),
    Step(
        1,
        'ow infer --model models/tiny --image hil/samples/coast.png --image hil/samples/harbor.png --prompt "count the '
        'ships near the coast" --max-new-tokens 16 --ckpt-dir runs/req1 --chunk 8 --group 2 --pace-ms 200 --json',
        note="one request, resumable (about 15 s): kill it (kill -9) at any moment and run the same command again",
    ),
    Step(1, "ow ground keys init --keys keys", note="the link's keys (once)"),
    Step(
        1,
        "ow bus run --trace demo --time-scale 1 --data-dir runs/bus --keys keys --model models/tiny "
        "--flight-arg=--chunk=8 --flight-arg=--pace-ms=300",
        mode="follow",
        note="terminal 1: the bus; it powers the payload and cuts it four times in the demo trace's first 64 s.\n"
        "The trace ends at 300 s; the bus keeps running after it (payload on) until Ctrl-C",
    ),
    Step(
        2,
        "ow ground events --keys keys --follow",
        mode="follow",
        note="terminal 2: what the bus and the payload send, as it comes, until Ctrl-C",
    ),
    Step(
        3,
        'ow ground uplink --keys keys --image hil/samples/clouds.png --prompt "describe the clouds" '
        "--max-new-tokens 40",
        mode="task",
        note="terminal 3: queue a task (a second; prints its id), then wait for its result (about 30 s:\n"
        "its progress, and its resume after the first cut, on stderr)",
    ),
    Step(3, f"ow ground results --keys keys --wait {TASK_ID}"),
)

WRAP = 110  # README line length for a command before it is continued with `\`


def readme_block() -> str:
    """The README's code block for STEPS (without the ``` fences)."""
    lines = [". .venv/bin/activate"]
    for step in STEPS:
        lines += [f"# {line}" for line in step.note.splitlines()]
        lines += _folded(step.command)
    return "\n".join(lines) + "\n"


def _folded(command: str) -> list[str]:
    """The command as README lines: options with their values kept together, a line continued with
    a backslash before an option that would pass WRAP, continuations aligned after the subcommand."""
    words = [w if w == TASK_ID else shlex.quote(w).replace("'", '"') for w in shlex.split(command)]
    # the README quotes with "..."
    groups: list[str] = []
    for word in words:
        if groups and groups[-1].startswith("--") and " " not in groups[-1] and not word.startswith("--"):
            groups[-1] += " " + word  # an option's value stays with it
        else:
            groups.append(word)
    indent = " " * (len(words[0]) + len(words[1]) + 2)
    lines: list[str] = []
    current = ""
    for group in groups:
        candidate = f"{current} {group}" if current else group
        if current.strip() and len(candidate) > WRAP and group.startswith("--"):
            lines.append(current + " \\")
            current = indent + group
        else:
            current = candidate
    lines.append(current)
    return lines


def _argv(command: str, task_id: str | None) -> list[str]:
    words = shlex.split(command)
    assert words[0] == "ow", command
    if task_id is not None:
        words = [task_id if w == TASK_ID else w for w in words]
    return [sys.executable, "-m", "common.cli", *words[1:]]


def _wait_for(what: str, condition, deadline_s: float, procs: list[subprocess.Popen[bytes]]) -> None:
    end = time.monotonic() + deadline_s
    while not condition():
        for p in procs:
            if p.poll() is not None:
                raise RuntimeError(f"waiting for {what}: `{p.args!r}` ended with {p.returncode}")
        if time.monotonic() > end:
            raise RuntimeError(f"{what}: not within {deadline_s:g} s")
        time.sleep(0.2)


def _ctrl_c_as_in_a_terminal() -> None:
    # A terminal's foreground command dies of Ctrl-C by default; a hand-run started in the background
    # of a non-interactive shell (nohup, `&`, some CI runners) would pass SIGINT down ignored, and
    # its follow terminals would then outlive the Ctrl-C that ends the session.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def run(workdir: Path, say=print, timeout_s: float = 600.0) -> dict:
    """Run STEPS in `workdir`; returns {"steps": [{terminal, command, seconds, rc, out, err}], "task_id",
    "events": the events terminal's output}. Raises RuntimeError when a command fails."""
    env = dict(os.environ)
    repo = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = repo + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    background: list[tuple[Step, subprocess.Popen, Path, Path, float]] = []
    done: list[dict] = []
    task_id: str | None = None
    logs = workdir / "runs" / "handrun"
    logs.mkdir(parents=True, exist_ok=True)
    try:
        for i, step in enumerate(STEPS):
            argv = _argv(step.command, task_id)
            say(f"[terminal {step.terminal}] $ {shlex.join(['ow', *argv[3:]])}")
            started = time.monotonic()
            if step.mode == "follow":
                out, err = logs / f"{i}-stdout.txt", logs / f"{i}-stderr.txt"
                with open(out, "wb") as o, open(err, "wb") as e:
                    proc = subprocess.Popen(
                        argv, cwd=workdir, env=env, stdout=o, stderr=e, preexec_fn=_ctrl_c_as_in_a_terminal
                    )
                background.append((step, proc, out, err, started))
                if argv[3:5] == ["bus", "run"]:
                    # a person starts the next terminal once the bus says it runs: here, once its
                    # run log has its first entry (written when its links are bound)
                    log = workdir / "runs" / "bus" / "bus-log.jsonl"
                    _wait_for("the bus to start", lambda log=log: log.exists() and log.stat().st_size > 0, 120, [proc])
                elif argv[3:5] == ["ground", "events"]:
                    archive = workdir / "keys" / "state" / "telemetry.jsonl"
                    _wait_for("events to record", archive.exists, 60, [b[1] for b in background])
                continue
            result = subprocess.run(argv, cwd=workdir, env=env, capture_output=True, text=True, timeout=timeout_s)
            seconds = time.monotonic() - started
            done.append(
                {
                    "terminal": step.terminal,
                    "command": step.command,
                    "seconds": seconds,
                    "rc": result.returncode,
                    "out": result.stdout,
                    "err": result.stderr,
                }
            )
            for line in (result.stdout + result.stderr).splitlines()[-12:]:
                say(f"    {line}")
            say(f"    ({seconds:.1f} s, exit {result.returncode})")
            if result.returncode != 0:
                raise RuntimeError(f"`{step.command}` exited {result.returncode}: {result.stderr.strip()[-500:]}")
            if step.mode == "task":
                task_id = result.stdout.strip().splitlines()[-1]
    finally:
        # Ctrl-C in terminal 2, then in terminal 1, as a person ends the session
        for step, proc, out, err, started in reversed(background):
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
            try:
                rc = proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                rc = proc.wait()
            seconds = time.monotonic() - started
            done.append(
                {
                    "terminal": step.terminal,
                    "command": step.command,
                    "seconds": seconds,
                    "rc": rc,
                    "out": out.read_text(errors="replace"),
                    "err": err.read_text(errors="replace"),
                }
            )
            say(f"[terminal {step.terminal}] Ctrl-C: `{step.command.split(' --')[0]}` exit {rc} after {seconds:.1f} s")
    return {"steps": done, "task_id": task_id}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=f"endpoints: {Endpoints.from_env()}")
    p.add_argument("--workdir", default=".", help="where models/, runs/ and keys/ go (default: here)")
    p.add_argument("--json", action="store_true", help="print every step's command, time, exit status and output")
    args = p.parse_args(argv)
    try:
        report = run(Path(args.workdir), say=(lambda line: None) if args.json else print)
    except RuntimeError as exc:
        print(f"handrun: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(report, indent=1))
    bad = [s for s in report["steps"] if s["rc"] != 0]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
