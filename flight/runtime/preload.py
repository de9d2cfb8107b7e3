"""The payload's boot image: every module `ow flight run` imports before its first unit of work.

Two users:

* the testbench's zygote (hil/bus/zygote.py) imports this once and forks each payload from it, so
  that the target's boot is emulated by a documented wait instead of this machine's imports;
* the flight process itself imports it on a background thread while the main thread already
  answers the bus (`engine_stack()`), so the link is up within a fraction of a second of exec.

Importing this module must not start any thread (the zygote forks after it): no tensor op, no
ZeroMQ context, no thread pool -- imports only.
"""

from __future__ import annotations


def engine_stack() -> None:
    """Import what the inference worker needs (torch, transformers' model classes, the engine)."""
    import PIL.PngImagePlugin  # noqa: F401  (decoding the uplinked images)

    # lazy: torch/transformers (seconds), only when the engine runs; the bus and `ow --help` never do
    import flight.engine  # noqa: F401  (torch, transformers' masks and caches, the adapters)
    import flight.model.inputs  # noqa: F401
    import flight.recovery.optimal  # noqa: F401
    import flight.runtime.app  # noqa: F401
    from flight.model import loader

    loader.import_model_classes()


def command_line() -> None:
    """Import what `python -m common.cli flight run` needs before it reaches the payload's main."""
    import common.cli  # noqa: F401
    import flight.cli  # noqa: F401
    import flight.runtime.cli  # noqa: F401


def boot_image() -> None:
    """Everything, for the zygote."""
    command_line()
    engine_stack()
