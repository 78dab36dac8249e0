"""IsoFLOP profiles (xmodlm.report.isoflop): parabola minima, bracketing, differences."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from xmodlm.report.isoflop import fit_parabola, isoflop

SIZES = [1e5, 2e5, 4e5, 8e5, 1.6e6]
SEEDS = {1e5: 1, 2e5: 3, 4e5: 3, 8e5: 3, 1.6e6: 1}


def _runs(family: str, floor: float, n_star: float, sizes=SIZES, noise=0.01, seed=0,
          curvature=0.05) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    rows = []
    for n in sizes:
        for s in range(SEEDS.get(n, 3)):
            loss = floor + curvature * np.log(n / n_star) ** 2 + rng.normal(0, noise)
            rows.append({"family": family, "stride": 1 if family == "dense" else 8,
                         "capacity": 1.0 if family == "dense" else 0.125, "context": 512,
                         "tier": 3e13, "params_active": n, "seed": s, "loss": loss,
                         "tokens": 3e13 / (6 * n)})
    return pd.DataFrame(rows)


def test_parabola_vertex_is_exact_on_a_parabola() -> None:
    x = np.log(np.array(SIZES))
    a, x_star, l_star = fit_parabola(x, 3.0 + 0.2 * (x - np.log(3e5)) ** 2, np.ones(5))
    assert a == pytest.approx(0.2) and np.exp(x_star) == pytest.approx(3e5)
    assert l_star == pytest.approx(3.0)
    a, x_star, _ = fit_parabola(x, 3.0 - 0.1 * x, np.ones(5))  # no curvature: no minimum
    assert a <= 1e-12 and np.isnan(x_star) or a > 0 and x_star > x.max()


def test_a_bracketed_minimum_and_its_interval_cover_the_truth() -> None:
    (entry,) = isoflop(_runs("dense", 4.0, 4e5), ("family", "stride", "capacity"), n_boot=400)
    (m,) = entry["minima"]
    assert m["bracketed"] and m["best_size"] == 4e5 and m["seeds"] == [1, 3, 3, 3, 1]
    lo, hi = m["n_star_ci95"]
    assert lo < 4e5 < hi and hi / lo < 4
    lo, hi = m["loss_star_ci95"]
    assert lo < 4.0 < hi and hi - lo < 0.05
    assert m["tokens_per_param"][0] == pytest.approx(3e13 / 6 / 1e10)


def test_a_profile_on_one_side_of_its_minimum_is_not_bracketed() -> None:
    df = _runs("dense", 4.0, 4e6, curvature=0.2)  # every size left of the minimum
    (entry,) = isoflop(df, ("family", "stride", "capacity"), n_boot=200)
    assert not entry["minima"][0]["bracketed"]


def test_difference_of_minima_recovers_the_offset() -> None:
    df = pd.concat([_runs("dense", 4.0, 4e5, seed=1), _runs("xmod", 3.95, 6e5, seed=2)])
    (entry,) = isoflop(df, ("family", "stride", "capacity"), n_boot=400)
    (vs,) = entry["vs_dense"]
    assert vs["config"]["family"] == "xmod"
    assert vs["minus"] == pytest.approx(-0.05, abs=0.02)
    lo, hi = vs["ci95"]
    assert lo < -0.05 < hi and vs["resolved"] and vs["both_bracketed"]
    # two sizes only: no profile at all
    assert isoflop(_runs("dense", 4.0, 4e5, sizes=SIZES[:2]), ("family",), n_boot=10) == []


def test_equal_size_compares_each_routed_size_with_the_dense_parabola_there() -> None:
    """X-MoD 0.03 behind a dense profile at every size: each routed size inside the
    dense range reads +0.03 (interval covering it); sizes outside are not compared."""
    dense = _runs("dense", 4.0, 4e5, seed=3, noise=0.005)
    xmod = _runs("xmod", 4.03, 4e5, sizes=[5e4, 2e5, 4e5, 8e5], seed=4, noise=0.005)
    (entry,) = isoflop(pd.concat([dense, xmod]), ("family", "stride", "capacity"), n_boot=400)
    (vs,) = entry["vs_dense"]
    got = {q["params_active"]: q for q in vs["equal_size"]}
    assert sorted(got) == [2e5, 4e5, 8e5]  # 5e4 lies below the dense sizes tried
    for q in got.values():
        assert q["minus"] == pytest.approx(0.03, abs=0.015)
        assert q["ci95"][0] < 0.03 < q["ci95"][1]
        assert q["tokens_per_param"] == pytest.approx(3e13 / 6 / q["params_active"] ** 2)


def test_single_seed_profiles_give_no_interval_and_resolve_nothing() -> None:
    """With one seed a size no replicate moves: a zero-wide interval would claim a
    resolved difference, so there is none, and nothing is called resolved."""
    dense = _runs("dense", 4.0, 4e5, seed=5)
    xmod = _runs("xmod", 3.9, 4e5, seed=6)
    keep = lambda df: df[df["seed"] == 0]  # noqa: E731
    (entry,) = isoflop(pd.concat([keep(dense), keep(xmod)]), ("family", "stride", "capacity"),
                       n_boot=50)
    assert all(m["seeds"] == [1] * len(SIZES) for m in entry["minima"])
    assert all(m["bracketed"] is None for m in entry["minima"])  # unknown, not "yes"
    (vs,) = entry["vs_dense"]
    assert vs["ci95"] is None and not vs["resolved"]
    assert vs["equal_size"] and all(q["ci95"] is None and not q["resolved"]
                                    for q in vs["equal_size"])


def test_the_figure_draws_each_profile_through_its_own_minimum(tmp_path) -> None:
    """One axis per budget; each configuration's curve is the parabola the table's
    minimum comes from (its lowest point is L* at N*), drawn over the sizes run."""
    from xmodlm.report.isoflop_plots import isoflop_figure, plot_isoflop

    df = pd.concat([_runs("dense", 4.0, 4e5, seed=1), _runs("xmod", 3.95, 6e5, seed=2),
                    _runs("dense", 3.8, 8e5, seed=3).assign(tier=9e13)])
    entries = isoflop(df, ("family", "stride", "capacity"), n_boot=100)

    def label(values: tuple) -> str:
        return f"{values[0]} S={values[1]}"

    fig = isoflop_figure(entries, label)
    axes = fig.axes
    assert len(axes) == 2 and "3e+13" in axes[0].get_title() and "9e+13" in axes[1].get_title()
    curves = [line for line in axes[0].get_lines() if len(line.get_xdata()) > 2]
    assert len(curves) == 2
    for line, m in zip(curves, entries[0]["minima"], strict=True):
        x, y = np.asarray(line.get_xdata()), np.asarray(line.get_ydata())
        assert x.min() == pytest.approx(SIZES[0]) and x.max() == pytest.approx(SIZES[-1])
        assert y.min() == pytest.approx(m["loss_star"], abs=1e-4)
        assert x[np.argmin(y)] == pytest.approx(m["n_star"], rel=0.05)
    names = [t.get_text() for t in fig.legends[0].get_texts()]
    assert "dense" in names and "xmod S=8" in names
    assert plot_isoflop(entries, tmp_path / "iso.png", label).stat().st_size > 0
    assert plot_isoflop([], tmp_path / "none.png", label) is None
    assert not (tmp_path / "none.png").exists()
    from xmodlm.report.isoflop import isoflop_markdown

    assert "![isoFLOP profiles](iso.png)" in isoflop_markdown(entries, label, "iso.png")
    assert not any("![" in line for line in isoflop_markdown(entries, label))
