"""Pictures: loss curves of runs (``xmod plot``), the routing picture's labels and colour
key, and the law plots' legend and log-axis labels."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import numpy as np
import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg

from conftest import tiny_model_cfg
from test_train import small_cfg
from xmodlm import flops
from xmodlm.cli import main
from xmodlm.config import load_config
from xmodlm.errors import UserError
from xmodlm.flops import capacity_tokens
from xmodlm.law.fit import fit_law
from xmodlm.law.synthetic import synthetic_runs
from xmodlm.law.table import validate
from xmodlm.model import Transformer
from xmodlm.model.blocks import RoutedBlock
from xmodlm.report import law_plots
from xmodlm.report.curves import loss_figure, run_curves
from xmodlm.report.dynamics_plots import depth_hist_figure, residual_rms_figure
from xmodlm.report.routing_plots import (
    KEY_LABEL_IN,
    _tick_label,
    colour_key,
    show_routing,
    sparse_blocks,
    token_routing,
)
from xmodlm.report.sweep_report import _plot_names
from xmodlm.train.trainer import train


def _fake_run(path: Path, sparse: bool) -> Path:
    path.mkdir(parents=True)
    records = []
    for step in range(1, 13):
        records.append({"step": step, "loss": 8.0 - 0.1 * step, "tokens": 512 * step})
        if step % 4 == 0:
            topk = 8.0 - 0.1 * step
            records.append({"step": step, "kind": "eval", "val_loss_topk": topk,
                            "val_loss_causal": topk + (0.05 if sparse else 0.0)})
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_plot_draws_train_and_both_validation_losses(tmp_path: Path) -> None:
    xmod = _fake_run(tmp_path / "xmod", sparse=True)
    dense = _fake_run(tmp_path / "dense", sparse=False)
    out = tmp_path / "curves.png"
    assert main(["plot", str(xmod), str(dense), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    fig = loss_figure([run_curves(xmod), run_curves(dense)], ["xmod", "dense"], x="step")
    ax = fig.axes[0]
    assert ax.get_xlabel() == "optimiser step" and "loss" in ax.get_ylabel()
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend == ["xmod: train", "xmod: validation (top-k routing)",
                      "xmod: validation (causal routing)", "dense: train", "dense: validation"]
    causal = ax.get_lines()[2]
    assert list(causal.get_xdata()) == [4, 8, 12]
    assert list(causal.get_ydata()) == pytest.approx([7.65, 7.25, 6.85])


def test_loss_curves_on_tokens_or_flops_with_a_trailing_mean(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = _fake_run(tmp_path / "xmod", sparse=True)
    cfg = load_config("xmod-tiny")
    (run / "config.yaml").write_text(cfg.to_yaml())
    curves = run_curves(run)
    fig = loss_figure([curves], ["xmod"])  # tokens by default
    ax = fig.axes[0]
    assert ax.get_xlabel() == "training tokens"
    train_line, topk = ax.get_lines()[:2]
    assert list(train_line.get_xdata()) == [512 * s for s in range(1, 13)]
    assert list(topk.get_xdata()) == [512 * 4, 512 * 8, 512 * 12]  # evals: step x tokens/step
    per_token = flops.count(cfg.model).flops_train
    ax = loss_figure([curves], ["xmod"], x="flops").axes[0]
    assert ax.get_lines()[0].get_xdata()[-1] == pytest.approx(512 * 12 * per_token)
    assert "FLOPs" in ax.get_xlabel()
    ax = loss_figure([curves], ["xmod"], smooth=4).axes[0]
    raw, mean = ax.get_lines()[:2]
    assert list(mean.get_ydata()) == pytest.approx(
        [7.9, 7.85, 7.8, 7.75, 7.65, 7.55, 7.45, 7.35, 7.25, 7.15, 7.05, 6.95])  # trailing
    assert "mean of 4 logged steps" in ax.get_legend().get_texts()[0].get_text()
    bare = _fake_run(tmp_path / "bare", sparse=False)  # no config.yaml: no FLOPs to count
    out = tmp_path / "x.png"
    assert main(["plot", str(bare), "--out", str(out), "--x", "flops"]) == 2
    assert "--x tokens" in capsys.readouterr().err and not out.exists()
    assert main(["plot", str(run), "--out", str(out), "--x", "flops", "--smooth", "5"]) == 0


def test_plot_errors_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plot", str(tmp_path / "none"), "--out", str(tmp_path / "x.png")]) == 2
    assert "not found" in capsys.readouterr().err
    run = _fake_run(tmp_path / "r", sparse=False)
    assert main(["plot", str(run), "--out", str(tmp_path / "x.txt")]) == 2
    assert ".png" in capsys.readouterr().err


def test_routing_labels_keep_spaces_and_key_labels_do_not_overlap() -> None:
    assert _tick_label(" the") == "\u2423the" and _tick_label("\n") == "\u23ce"
    for n_sparse in (1, 3, 9, 15, 31, 63):
        bar_h, depths = colour_key(n_sparse, text_h=0.6, room=3.0)
        assert depths[0] == n_sparse and depths[-1] == 0  # the ends are always labelled
        per_depth = bar_h / (n_sparse + 1)
        gaps = [(a - b) * per_depth for a, b in zip(depths, depths[1:], strict=False)]
        assert min(gaps) >= KEY_LABEL_IN - 1e-9, (n_sparse, depths)


@pytest.fixture(scope="module")
def law_fit() -> tuple:
    runs = synthetic_runs(60, sigma=0.01, seed=1)
    return fit_law(runs, form="base", n_boot=100, seed=0), validate(runs).frame


def _tick_texts(fig: object, ax: object) -> list[str]:
    FigureCanvasAgg(fig).draw()  # type: ignore[arg-type]
    return [t.get_text() for t in ax.get_xticklabels(minor=False) + ax.get_xticklabels(minor=True)
            if t.get_text()]


def test_law_plots_have_plain_log_ticks_and_a_readable_legend(law_fit: tuple) -> None:
    fit, frame = law_fit
    delta = law_plots._delta(fit, frame)
    ax = delta.axes[0]
    ticks = _tick_texts(delta, ax)
    assert "1" in ticks and "2" in ticks, ticks
    assert not any(re.search(r"\\times|\^|\$", t) for t in ticks), ticks  # never 2x10^0
    legend = ax.get_legend()
    assert min(t.get_fontsize() for t in legend.get_texts()) >= 8
    iso = law_plots._isoflop(fit, frame)
    ticks = _tick_texts(iso, iso.axes[0])
    assert any(t.endswith("M") for t in ticks) and not any("$" in t for t in ticks), ticks


def test_law_bootstrap_names_parameters_labels_axes_and_keeps_outliers_off_the_bins(
    law_fit: tuple,
) -> None:
    fit = copy.deepcopy(law_fit[0])
    g_cap = fit.delta.spec.names.index("g_cap")
    fit.delta.samples[:2, g_cap] = 50.0  # two refits (2%) in another optimum
    fig = law_plots._bootstrap(fit)
    titles = [ax.get_title() for ax in fig.axes]
    assert "irreducible loss E\n(dense law, context 256)" in titles
    assert "capacity gain g_cap\n(delta law, base)" in titles
    assert all(ax.get_xlabel() == "parameter value" for ax in fig.axes)
    assert fig.axes[0].get_ylabel() == "bootstrap refits"
    assert "red line: the fit to all runs" in fig.get_suptitle()
    ax = fig.axes[titles.index("capacity gain g_cap\n(delta law, base)")]
    bars = ax.containers[0].patches  # the histogram's bins
    assert max(p.get_x() + p.get_width() for p in bars) < 1.0  # not stretched to 50
    drawn = int(sum(p.get_height() for p in bars))
    outside = len(fit.delta.samples) - drawn
    assert outside >= 2
    assert [t.get_text() for t in ax.texts] == [f"{outside} outside"]
    red = [line for line in ax.get_lines() if line.get_color() == "tab:red"]
    assert red and red[0].get_xdata()[0] == pytest.approx(fit.delta.value[g_cap])


def _dyn_group(config: str, tier: float, depth_hist: list[float], se: list[float] | None) -> dict:
    return {"config": config, "tier": tier, "context": 128, "width": 64,
            "depth_hist": {"n": 3, "mean": depth_hist, "se": se},
            "residual_rms_end": {"n": 3, "mean": [1.0, 2.0], "se": None},
            "residual_rms_init": {"n": 3, "mean": [0.1, 0.1], "se": None}}


def test_dynamics_figures_have_one_panel_per_budget_unique_labels_and_se_bars() -> None:
    configs = [_dyn_group(name, tier, [0.5, 0.3, 0.2, 0.0, 0.0], se)
               for tier in (1e13, 3e13)
               for name, se in (("dense L=4", None), ("xmod S=4 L=8", [0.01, 0.02, 0.03, 0, 0]))]
    groups = [{**c, **_plot_names(c)} for c in configs]
    for fig in (depth_hist_figure(groups), residual_rms_figure(groups)):
        assert [ax.get_title() for ax in fig.axes] == [
            "budget 1e+13 FLOPs, context 128", "budget 3e+13 FLOPs, context 128"]
        for ax in fig.axes:
            labels = [t.get_text() for t in ax.get_legend().get_texts()]
            configs_shown = [x for x in labels if x.startswith(("dense", "xmod"))]
            assert configs_shown == ["dense L=4 d=64", "xmod S=4 L=8 d=64"], labels
    fig = depth_hist_figure(groups)
    assert "error bars +- 1 SE" in fig.get_suptitle()
    bars = fig.axes[0].containers
    assert [c.has_yerr for c in bars] == [False, True]  # one seed: no bar; seeds: one SE
    segments = bars[1].lines[2][0].get_segments()
    assert [s[1][1] - s[0][1] for s in segments] == pytest.approx([0.02, 0.04, 0.06, 0.0])
    line = bars[1].lines[0]
    assert list(line.get_xdata()) == [0, 1, 2, 3]  # empty tail past depth 2 trimmed to one


def test_token_routing_gives_topk_and_scores_when_causal_routes_nothing() -> None:
    """A router whose causal decision takes no token (a young one) still shows where
    training sends compute: top-k takes the k highest-scoring tokens of each block."""
    model = Transformer(tiny_model_cfg(n_layers=4, stride=2, capacity=0.25)).eval()
    for block in model.blocks:
        if isinstance(block, RoutedBlock):
            block.router.threshold.fill_(1e9)
    ids = list(range(1, 17))
    got = token_routing(model, ids)
    assert not got["causal"].any()
    k = capacity_tokens(0.25, len(ids))
    assert got["topk"].shape == got["score"].shape == (2, len(ids))
    for chosen, score in zip(got["topk"], got["score"], strict=True):
        assert set(np.flatnonzero(chosen)) == set(np.argsort(-score)[:k])
    assert sparse_blocks(model.layout) == [1, 3]


def test_show_routing_numbers_blocks_by_place_in_the_stack(
    tiny_data_dir: Path, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    train(small_cfg(tiny_data_dir, "train.max_steps=2", "model.n_layers=6", "model.stride=3"),
          run, progress=False)
    png, page = tmp_path / "r.png", tmp_path / "r.html"
    info = show_routing(run, "The whale saw the ship.", png, page, routing="topk")
    assert info["layout"] == "DssDss" and info["blocks"] == [1, 2, 4, 5]
    assert info["selected"] == info["topk"] and info["depth"] == list(
        np.array(info["topk"]).sum(0))
    assert "(blocks " in page.read_text() and "Top-k routing, as in training" in page.read_text()
    with pytest.raises(UserError, match="not one of causal, topk"):
        show_routing(run, "x", png, routing="both")


def test_bootstrap_panel_of_draws_a_rounding_error_apart() -> None:
    """A parameter whose draws differ only by rounding (a bound the fit sits on) still
    gets a panel: 30 bins over a range of 1e-16 cannot be drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from xmodlm.report.law_plots import _boot_panel

    fig, ax = plt.subplots()
    value = 1.9999999999125369
    draws = np.array([value, np.nextafter(value, 3.0), value, value])
    _boot_panel(ax, draws, value)
    lo, hi = ax.get_xlim()
    assert hi - lo > 1e-3
    plt.close(fig)
