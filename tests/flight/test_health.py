"""Health and safety in-process: boots that end while an item is handled, faults, the bus's word
on how a boot ended, quarantine and release. (tests/flight/test_red_team.py has the real crash
loop, with the real bus power-cycling a payload that dies.)"""

from __future__ import annotations

import os
import subprocess
import sys

from flight.runtime.health import EXIT_BOUND, MAIN, WORKER, Health, command_item, task_item


def _boot(directory, boot, **kw):
    events = []
    health = Health(str(directory), boot=boot, on_event=lambda kind, item, text: events.append((kind, item)), **kw)
    return health, events


def _die_while_handling(directory, boot, item, slot=WORKER):
    """A boot that ends (SIGKILL, as a power cut or a native crash) while handling `item`."""
    code = (
        f"from flight.runtime.health import Health\n"
        f"h = Health({str(directory)!r}, boot={boot}, fault_spec='kill:{item}')\n"
        f"with h.handling({item!r}, {slot}):\n    pass\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert proc.returncode == -9


def test_boots_that_die_at_one_item_quarantine_it_once_the_bus_calls_them_faults(tmp_path):
    for boot in range(1, EXIT_BOUND + 1):
        _die_while_handling(tmp_path, boot, "task:t-bad")
        health, events = _boot(tmp_path, boot + 1)
        assert health.held("task:t-bad")  # nothing decided until the bus says how the boot ended
        health.verdict(after_fault=True)
        assert not health.held("task:t-bad")
    assert health.is_quarantined("task:t-bad")
    assert events[-1] == ("quarantined", "task:t-bad")
    assert health.listing()[0][:2] == ("task:t-bad", EXIT_BOUND)
    rebooted, _ = _boot(tmp_path, 10)
    assert rebooted.is_quarantined("task:t-bad")  # durable
    assert rebooted.release("task:t-bad") and not rebooted.is_quarantined("task:t-bad")
    assert not _boot(tmp_path, 11)[0].is_quarantined("task:t-bad")


def test_power_cuts_count_for_nothing(tmp_path):
    for boot in range(1, EXIT_BOUND + 2):
        _die_while_handling(tmp_path, boot, "task:t-long")
        health, events = _boot(tmp_path, boot + 1)
        health.verdict(after_fault=False)  # the bus cut the power: a trace cut
    assert not health.is_quarantined("task:t-long") and not events


def test_without_a_word_from_the_bus_an_exit_is_not_counted(tmp_path, monkeypatch):
    import flight.runtime.health as h

    _die_while_handling(tmp_path, 1, "report:t1", MAIN)
    health, events = _boot(tmp_path, 2)
    assert health.held("report:t1")
    monkeypatch.setattr(h, "VERDICT_WAIT_S", 0.0)
    assert not health.held("report:t1") and not events and "report:t1" not in health.exits


def test_progress_resets_the_count(tmp_path):
    _die_while_handling(tmp_path, 1, "task:t2")
    health, _ = _boot(tmp_path, 2)
    health.verdict(True)
    assert health.exits["task:t2"][0] == 1
    health.progress("task:t2")  # a unit of work done: it was not stuck there
    assert "task:t2" not in _boot(tmp_path, 3)[0].exits


def test_a_crash_record_counts_without_the_bus(tmp_path):
    health, _ = _boot(tmp_path, 1)
    with open(health.crash_path, "a") as f:
        f.write("Fatal Python error: Segmentation fault\n")
    health._write_slot(WORKER, "command:STATUS:0011223344556677")
    again, events = _boot(tmp_path, 2)
    assert not again.awaiting_verdict() and events == [("abnormal_exit", "command:STATUS:0011223344556677")]
    assert os.path.exists(again.crash_path + ".previous")


def test_caught_faults_count_toward_quarantine_too(tmp_path):
    health, events = _boot(tmp_path, 1)
    for _ in range(EXIT_BOUND - 1):
        assert not health.fault("command:PING:00", "RuntimeError")
    assert health.fault("command:PING:00", "RuntimeError")
    assert [k for k, _ in events] == ["abnormal_exit"] * (EXIT_BOUND - 1) + ["quarantined"]


def test_command_items_name_the_content_not_the_sequence_number():
    from common.wire import messages as m

    a = m.UplinkTask(task_id="t1", prompt="p", images=[], max_new_tokens=1, priority=0)
    b = m.UplinkTask(task_id="t1", prompt="p", images=[], max_new_tokens=1, priority=0)
    assert command_item(a) == command_item(b) != command_item(m.CancelTask(task_id="t1"))
    assert task_item("t1") == "task:t1"


def test_a_cut_while_storing_a_tasks_inputs_leaves_nothing_behind(tmp_path, model_dirs, image_files):
    """A cut between the TASK_INPUTS write and its rename leaves a temporary (tens of MB for a
    multi-image task); the next try removes it, so a task cut at every first start does not fill
    the disk one temporary per cut."""
    import subprocess
    import sys
    from pathlib import Path
    from types import SimpleNamespace

    from flight.engine import EngineOptions
    from flight.model.loader import load_model
    from flight.runtime.app import FlightApp, FlightConfig

    app = FlightApp(
        FlightConfig(
            str(tmp_path / "data"), model_dirs["qwen3-vl"], str(tmp_path / "keys"), "tcp://127.0.0.1:1", EngineOptions()
        )
    )
    model = load_model(model_dirs["qwen3-vl"], device="cpu")
    task = SimpleNamespace(task_id="t1", images=["img0.png"], prompt="describe the scene", content_hash="h1")
    task_dir = Path(app.paths.task_dir("t1"))
    task_dir.mkdir(parents=True)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = task_dir / f".inputs.rec.{int(dead.stdout)}.140169240053440.2.tmp"  # a cut process's
    stale.write_bytes(bytes(1 << 20))
    app.inputs.build(task, model, [Path(image_files[0]).read_bytes()])
    assert sorted(p.name for p in task_dir.iterdir()) == ["inputs.rec", "pixels.rec"]


def test_a_task_whose_stored_pixels_are_damaged_builds_them_again_or_waits_for_its_image(tmp_path, model_dirs):
    """The pixel patches are read only when the vision phase starts from them; damaged then, they
    are built again from the task's verified image, and a task whose image is damaged too waits
    for the ground to send it again (the engine gets no pixels and ends the run AWAITING_INPUTS),
    as a task that has not started does."""
    import io
    from pathlib import Path
    from types import SimpleNamespace

    import numpy as np
    import torch
    from PIL import Image

    from common.wire import messages as m
    from flight.engine import EngineOptions
    from flight.model.loader import load_model
    from flight.runtime.app import FlightApp, FlightConfig

    app = FlightApp(
        FlightConfig(
            str(tmp_path / "data"), model_dirs["qwen3-vl"], str(tmp_path / "keys"), "tcp://127.0.0.1:1", EngineOptions()
        )
    )
    model = load_model(model_dirs["qwen3-vl"], device="cpu")
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(3).integers(0, 255, (64, 64, 3), dtype=np.uint8)).save(buf, "PNG")
    for chunk in m.ImageChunk.split("scene.png", buf.getvalue(), chunk_bytes=4096):
        app.images.put_chunk(chunk)
    assert app.images.is_verified("scene.png")
    task = SimpleNamespace(task_id="t1", images=["scene.png"], prompt="describe the scene", content_hash="h1")
    built = app.inputs.build(task, model, app.inputs.images_of(task))
    pixels = Path(app.paths.task_dir("t1")) / "pixels.rec"

    def damage(path):
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))

    damage(pixels)
    stored = app.inputs.stored(task, model)
    assert stored is not None and not stored.pixels_loaded
    assert torch.equal(stored.pixel_values, built.pixel_values)  # built again from the image, and stored again
    assert torch.equal(app.inputs.stored(task, model).pixel_values, built.pixel_values)
    damage(pixels)
    damage(Path(app.images.image_path("scene.png")))
    assert app.inputs.stored(task, model).pixels() is None  # the engine ends the run AWAITING_INPUTS
    assert not app.images.is_verified("scene.png") and app.awaited_images.get("t1") == "scene.png"


def test_a_load_of_the_engine_that_succeeds_resets_its_count(tmp_path, model_dirs):
    """Found by the chaos campaign: only tasks reset their count on progress, so OOM kills during
    engine loads months apart would add up to a quarantine of the engine. A load that succeeds is
    the engine's unit of work."""
    from flight.engine import EngineOptions
    from flight.runtime.app import FlightApp, FlightConfig
    from flight.runtime.health import ENGINE_ITEM

    app = FlightApp(
        FlightConfig(
            str(tmp_path / "data"), model_dirs["qwen3-vl"], str(tmp_path / "keys"), "tcp://127.0.0.1:1", EngineOptions()
        )
    )
    app.health.fault(ENGINE_ITEM, "killed loading the engine")
    app.health.fault(ENGINE_ITEM, "killed loading the engine")
    assert app.health.exits[ENGINE_ITEM][0] == 2
    assert app.worker.load_engine() is not None
    assert ENGINE_ITEM not in app.health.exits
