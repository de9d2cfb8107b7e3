"""Run the VLA edge-scheduler benchmarks: `python -m bench.vla.run [ow vla bench options]`.

The experiments live in `common.vla.bench` so that the installed `ow vla bench` runs them too;
this entry point forwards its arguments there, e.g.

    python -m bench.vla.run --quick
    python -m bench.vla.run --profile h100x4 --experiments single,multi --json runs/vla-bench.json
"""

from __future__ import annotations

import sys

from common.cli import main as ow_main


def main(argv: list[str] | None = None) -> int:
    return ow_main(["vla", "bench", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
