"""A request's recovery record: one entry per restart, kept across cuts in its checkpoint
directory (docs/record-format.md, RECOVERY), and the bytes of checkpoint records it wrote over
its whole life, each counted once whatever boot wrote it."""

import os

from testkit import MAX_NEW, CutAfter, engine, inputs_for

from flight.engine import SimulatedCut
from flight.model.loader import load_model

PHASE_ORDER = ["start", "vision", "prefill", "decode"]


def test_one_entry_per_restart_and_every_byte_counted_once(model_dirs, tmp_path):
    model_dir = model_dirs["qwen3-vl"]
    model = load_model(model_dir, device="cpu")
    inputs = inputs_for(model)
    ref = engine(model).run(inputs, str(tmp_path / "ref"), MAX_NEW)
    assert ref.recoveries == [] and ref.lifetime_bytes_written == ref.bytes_written

    ckpt = tmp_path / "ck"
    committed: list[int] = []  # bytes of each record the writer committed, over every boot
    cuts = 0
    while True:  # each boot does five units of work, then the power goes
        model = load_model(model_dir, device="cpu")
        hooks = {"events": CutAfter(5).event, "after_commit": lambda what, nbytes: committed.append(nbytes)}
        try:
            result = engine(model, **hooks).run(inputs, str(ckpt), MAX_NEW)
            break
        except SimulatedCut:
            cuts += 1
            assert cuts < 20, "no progress across cuts"
    assert cuts >= 3
    assert result.token_ids == ref.token_ids and result.logits_sha256() == ref.logits_sha256()

    recoveries = result.recoveries
    assert [entry["restart"] for entry in recoveries] == list(range(1, cuts + 1))
    phases = [entry["phase"] for entry in recoveries]
    assert phases == sorted(phases, key=PHASE_ORDER.index), phases  # each restart resumes further on
    assert {"prefill", "decode"} <= set(phases)
    assert all(entry["restore_s"] >= 0 and isinstance(entry["planner"], str) for entry in recoveries)
    # the decode restarts, every block's KV stored, read it layer-first (restore.restart_planner)
    assert all(entry["planner"] == "layer-first" for entry in recoveries if entry["phase"] == "decode")
    written = [entry["written"] for entry in recoveries]
    assert written == sorted(written) and written[0] > 0

    # Every byte once: the records the writer committed in every boot, the MANIFEST and RESULT.
    records = sum(committed) + os.path.getsize(ckpt / "MANIFEST") + os.path.getsize(ckpt / "RESULT")
    assert result.lifetime_bytes_written == records
    assert result.lifetime_bytes_written >= ref.lifetime_bytes_written

    # A boot that finds the RESULT already there (cut after it was durable) is a restart too,
    # with nothing to plan; it writes no checkpoint record (nothing recounted).
    again = engine(load_model(model_dir, device="cpu")).run(inputs, str(ckpt), MAX_NEW)
    assert again.recoveries[:-1] == recoveries
    assert again.recoveries[-1]["restart"] == cuts + 1
    assert (again.recoveries[-1]["phase"], again.recoveries[-1]["planner"]) == ("done", "none")
    assert again.lifetime_bytes_written == result.lifetime_bytes_written
