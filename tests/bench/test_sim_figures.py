"""`python -m bench.sim_figures` promises Figures 10-14: it draws them (PNG, beside its JSON) from
the simulator's numbers, and says where (issue 33: it printed tables only)."""

from __future__ import annotations

from pathlib import Path

from PIL import Image

from bench.sim_figures import CONFIGS, FIGURES, plot_figures


def test_figures_10_to_14_are_drawn_beside_the_numbers(tmp_path: Path):
    from hil.sim.figures import Config, fig10, fig11, fig12_14

    # the real simulator, made small: one configuration, one trace, one seed, one arrival
    cfg = Config(**dict(CONFIGS["2b-agx"], boot_s=20.0, commit_latency_s=1e-3))
    entry = {
        "label": cfg.label(),
        "fig10": fig10(cfg, traces_=("trace-a",), seeds=(0,), n_arrivals=1),
        "fig11": fig11(cfg),
        "fig12_14": fig12_14(cfg, tokens_per_frame=(256, 1024)),
    }
    out_json = tmp_path / "sim.json"
    paths = plot_figures({"configs": {"2b-agx": entry}}, str(out_json))
    assert list(paths) == list(FIGURES)
    for name, path in paths.items():
        assert Path(path) == tmp_path / f"sim-{name}.png"
        with Image.open(path) as image:
            assert image.format == "PNG" and image.size[0] >= 400, (name, image.size)
