"""The resumable VLM engine: one request, three phases, block by block.

    vision   vision blocks 0..V-1 one at a time, then the merger
    prefill  the prompt in chunks of C tokens x decoder layers in groups of G: a grid of blocks
    decode   greedy, one token per step

After every unit of work the checkpoint policy decides what to persist; the writer commits it
off the compute thread. On start the engine reads the request's directory, rebuilds the frontier
(vision block, prefill blocks done, decode step) and continues from there; the prefill part of
that is a recovery plan (flight/recovery/) that overlaps reads with recomputation. A fresh run
is the same code with an empty frontier. Tokens and logits are bitwise those of an
uninterrupted run (tests/engine/).

Where things are (docs/engine.md):

    request.py   Engine (names resolved here: policy, cost model), Result, RunOutcome (how a run
                 ended: finished, or stopped by a StopToken at a unit boundary), one request's run
    context.py   what the phases share (RequestContext, rotary positions) and the KV state
    vision.py    the vision phase, its read-ahead after a reboot, vision.out
    restore.py   the prefill phase as a recovery plan: plan, execute, replan on a bad record
    prefill.py   one prefill block: embed, layers, re-projection, what it persists
    decode.py    the decode loop, a decode restart's first step, decode records
    records.py   where records go (the writer), cadence timing, held-state peaks, RESULT
    pacing.py    pace emulation (a slower payload's compute time)
    int8.py      int8 quantisation of decode-record KV
"""

from flight.checkpoint.policies import Geometry
from flight.options import EngineOptions  # defined apart so `ow flight run` parses options without torch

from .request import Engine, RequestRun, Result, RunOutcome, SimulatedCut
from .restore import MAX_REPLANS

__all__ = [
    "MAX_REPLANS",
    "Engine",
    "EngineOptions",
    "Geometry",
    "RequestRun",
    "Result",
    "RunOutcome",
    "SimulatedCut",
]
