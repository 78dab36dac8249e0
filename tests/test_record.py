"""The run record owns the layout, the family, the sparse rule, rho and the row: every
reader of a run agrees with it, for an explicit layout too."""

from __future__ import annotations

import ast
import dataclasses
import re
from collections.abc import Callable
from pathlib import Path

import pandas as pd
import pytest

from xmodlm import depth, flops, record
from xmodlm.config import ModelConfig
from xmodlm.law.table import validate
from xmodlm.report.analysis import run_label

SRC = Path(__file__).resolve().parents[1] / "src" / "xmodlm"


def _anchors_first() -> ModelConfig:
    """The anchors ablation: one anchor then sparse blocks only, an explicit layout
    whose rho is not the derived layout's S / (1 + c (S - 1))."""
    dense = ModelConfig(vocab_size=256, d_model=64, n_layers=4, n_heads=2, context=64,
                        balance_coef=record.XMOD_DEFAULTS["balance_coef"])
    cfg, _ = flops.flop_match(dense, 4, 0.25, first_anchor_only=True)
    assert cfg.layout.startswith("Ds") and set(cfg.layout[1:]) == {"s"}
    return cfg


def _row(cfg: ModelConfig) -> dict:
    counts = flops.count(cfg)
    return {**record.config_row(cfg, counts), "tokens": 1e6, "compute": 1e6 * counts.flops_train,
            "val_loss": 3.0, "status": "ok", "lr": 1e-3}


def test_rho_of_an_explicit_layout_agrees_across_law_report_and_flops() -> None:
    cfg = _anchors_first()
    derived = dataclasses.replace(cfg, layout="", n_layers=4)
    rho = flops.expansion_ratio(cfg)
    assert rho == pytest.approx(len(cfg.layout) / flops.active_depth(cfg))
    assert rho != pytest.approx(flops.expansion_ratio(derived))  # not the derived formula
    table = pd.DataFrame([_row(cfg), _row(derived), _row(dataclasses.replace(cfg, layout="",
                          n_layers=4, stride=1, capacity=1.0))])
    frame = validate(table).frame
    assert list(frame["rho"]) == pytest.approx([rho, flops.expansion_ratio(derived), 1.0])
    assert list(frame["is_sparse"]) == [True, True, False]
    assert list(frame["variant"]) == ["xmod[anchors=prefix]", "xmod", "dense"]
    labels = [run_label(r) for r in table.to_dict("records")]
    assert labels[0].endswith("anchors=prefix lr=0.001") and "anchors" not in labels[1]
    assert labels[2] == "dense lr=0.001"


def test_paper_ablations_are_variants_of_their_own() -> None:
    """The replication study's four ablations of A1K8 on cpu-d64 each fit and report
    apart from the full model and from each other (two pooled would mix mechanisms in
    one law), and the optimiser names the model in the report's labels."""
    from xmodlm.config import load_config

    base = ["model.sparsity=8", "model.anchor_stride=1", "model.vocab_size=256"]
    variants = {
        "xmod": [],
        "xmod[balance=none]": ["model.balance=none"],
        "xmod[anchors=prefix]": ["model.anchors=false"],
        "xmod[gating=sigmoid]": ["model.gating=sigmoid"],
        "xmod[prefix=0]": ["model.dense_prefix=0"],
    }
    rows = [_row(load_config("cpu-d64", base + extra).model) for extra in variants.values()]
    rows.append(_row(load_config("cpu-d64", ["model.vocab_size=256"]).model))
    frame = validate(pd.DataFrame(rows)).frame
    assert list(frame["variant"]) == [*variants, "dense"]
    labels = [run_label({**r, "optimizer": "muon"}) for r in rows]
    assert len(set(labels)) == len(labels) and all(" muon" in x for x in labels)
    assert "bal=none" in labels[1] and "anchors=prefix" in labels[2] and labels[-1] == "dense muon lr=0.001"


def test_derived_layout_rho_is_the_closed_form() -> None:
    for stride, capacity in ((2, 0.125), (4, 0.25), (8, 0.5)):
        layout = depth.legacy_layout(2 * stride, stride, capacity)
        assert depth.expansion_ratio(layout, capacity) == stride / (1 + capacity * (stride - 1))


def test_family_and_sparse_rule() -> None:
    assert depth.legacy_layout(4, 2, 0.5) == "DsDs"
    assert depth.legacy_layout(4, 2, 1.0) == "DDDD"
    assert depth.legacy_layout(2, 1, 0.5, dense="E") == "EE"
    assert record.family("DsDs", "logit", 2) == "mod"
    assert record.family("DsDs", "sigmoid", 2, gate_scope="ffn") == "mod"
    assert record.family("DsDs", "sigmoid", 2) == "xmod"
    assert record.family("DsDs", "variance_scaled", 2) == "xmod"
    assert record.family("DDDD", "logit", 2) == record.DENSE
    assert record.family("EE", "logit", 1) == "moe"
    assert record.is_sparse(4, 0.5) and not record.is_sparse(4, 1.0)
    assert record.is_sparse(1, 1.0, "Dss") and not record.is_sparse(4, 0.5, "DDDD")


def _code_sites(match: Callable[[ast.AST], bool]) -> list[str]:
    """``file:line`` of every node of the package's code (docstrings and comments
    aside) for which ``match`` holds."""
    found = []
    for path in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if match(node):
                found.append(f"{path.relative_to(SRC)}:{node.lineno}")
    return found


def _rho_closed_form(node: ast.AST) -> bool:
    return isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div) and bool(
        re.search(r"/ \(1 \+ [\w\[\]'\"]+ \* \([\w\[\]'\"]+ - 1\)\)", ast.unparse(node)))


def _sparse_rule(node: ast.AST) -> bool:
    return isinstance(node, ast.BoolOp) and bool(re.search(
        r"stride\W* > 1 and .*capacity\W* < 1|stride\W* == 1 or .*capacity\W* >= 1",
        ast.unparse(node)))


def _prefix_only_rule(node: ast.AST) -> bool:
    return isinstance(node, ast.BoolOp) and "'D' not in" in ast.unparse(node)


def _row_mapping(node: ast.AST) -> bool:
    keys = {k.value for k in getattr(node, "keys", []) if isinstance(k, ast.Constant)}
    return isinstance(node, ast.Dict) and {"family", "width", "params_active"} <= keys


@pytest.mark.parametrize("rule", [_rho_closed_form, _sparse_rule, _prefix_only_rule,
                                  _row_mapping], ids=lambda r: r.__name__.strip("_"))
def test_each_rule_has_one_home(rule: Callable[[ast.AST], bool]) -> None:
    """rho, the sparse rule, the anchors ablation and a config's row are written once:
    the sparse rule in depth.py (the layout's construction), the rest in record.py
    (the closed form of rho not even there: it is derived from the layout)."""
    sites = _code_sites(rule)
    home = {_rho_closed_form: [], _sparse_rule: ["depth.py"]}.get(rule, ["record.py"])
    assert [s.split(":")[0] for s in sites] == home, sites


def _kv_bytes_per_token(node: ast.AST) -> bool:
    return isinstance(node, ast.BinOp) and bool(
        re.fullmatch(r"2 \* [\w.]*(d_model|kv_heads) \* [\w.]+( \* \w+)?", ast.unparse(node)))


def _progress_class(node: ast.AST) -> bool:
    return isinstance(node, ast.ClassDef) and "Progress" in node.name


@pytest.mark.parametrize(("rule", "home"), [(_kv_bytes_per_token, "flops.py"),
                                            (_progress_class, "progress.py")],
                         ids=["kv_bytes_per_token", "progress_class"])
def test_counts_and_progress_have_one_home(rule: Callable[[ast.AST], bool], home: str) -> None:
    """The KV-cache bytes a token costs are counted beside the other analytic counts,
    and every long phase (a sweep's runs included) reports through one helper."""
    assert sorted({s.split(":")[0] for s in _code_sites(rule)}) == [home]
    for line in ("2 * cfg.d_model * b", "2 * cfg.attn_kv_heads * cfg.attn_head_dim * b"):
        copy = f"class SweepProgress:\n    def f(self, cfg, b):\n        return {line}\n"
        assert any(rule(n) for n in ast.walk(ast.parse(copy)))


def test_one_home_check_sees_a_copy(tmp_path: Path) -> None:
    """The checks above turn red on a reintroduced copy."""
    copy = ("def f(stride, capacity, layout, m, c):\n"
            "    rho = stride / (1 + capacity * (stride - 1))\n"
            "    sparse = stride > 1 and capacity < 1\n"
            "    prefix = layout.find('s') > 0 and 'D' not in layout[1:]\n"
            "    return {'family': m.family, 'width': m.d_model, 'params_active': c.params_active}\n")
    nodes = list(ast.walk(ast.parse(copy)))
    for rule in (_rho_closed_form, _sparse_rule, _prefix_only_rule, _row_mapping):
        assert any(rule(n) for n in nodes), rule.__name__
