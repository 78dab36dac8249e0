"""The paper's dense reference: each sparse run's Delta and what it was measured against.

Delta = L_XMoD - L_dense_hat (the paper's Eq. 10), where L_dense_hat is the dense
validation loss of the same N_act and L *at the same logged training FLOPs*:

1. **curve**: the validation curves (loss against training FLOPs, every eval
   point kept) of the dense runs of the same context and active size (within
   2%), interpolated linearly in ln FLOPs at the sparse run's compute C; a
   dense run's curve serves where its points bracket C (its final point counts,
   with one optimiser step of slack, 1%). Seeds that cover C are averaged.
2. **dense law** (the fallback, only where no curve covers C): the fitted dense
   law of that context (:mod:`xmodlm.law.dense`) at (N_act, D = C / F_dense),
   F_dense the training FLOPs per token of a dense run of the same size and
   context.
3. otherwise no reference: the run is left out of the fit and counted.

Every sparse run's row records which reference it got (``reference``:
``curve``, ``dense law`` or ``none``) and from which dense runs
(``reference_runs``). A point inside a dense curve comes from a run still
training on its schedule (the learning rate not yet decayed), so it reads a
little above a dense run trained to that budget: the paper's choice, kept, and
said here.

Which counts feed Eq. 14 (:func:`law_frame`): N = ``params_total`` and N_act =
``params_active`` plus the embedding parameters (``params_total -
params_non_embedding``), the dense model of the same active depth with its
embeddings, so N = N_act for a dense model. A table without
``params_non_embedding`` falls back to the paper's Eqs. 4-5 (N_act =
``params_active``, N = N_act rho with rho = blocks / active depth), with a note.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from xmodlm import depth
from xmodlm.errors import UserError
from xmodlm.law import dense, paper
from xmodlm.law.select import one_lr, one_variant
from xmodlm.law.table import validate

SIZE_RTOL = paper.SIZE_RTOL
STEP_RTOL = 0.01  # a run stops at the last whole step inside its budget


def read_curves(sweep_dir: str | Path) -> pd.DataFrame:
    """Every eval point of every run under ``sweep_dir`` (its ``runs/`` folder, or the
    folder itself): run_id, compute (tokens x the run's training FLOPs per token from
    its summary.json), val_loss (causal where recorded). Runs without a summary or
    metrics are skipped."""
    root = Path(sweep_dir)
    root = root / "runs" if (root / "runs").is_dir() else root
    if not root.is_dir():
        raise UserError(f"curves: folder {str(sweep_dir)!r} not found")
    rows = []
    for run in sorted(p for p in root.iterdir() if p.is_dir()):
        try:
            per_token = float(json.loads((run / "summary.json").read_text())["flops_per_token"])
            lines = (run / "metrics.jsonl").read_text(errors="replace").splitlines()
        except (OSError, ValueError, KeyError, TypeError):
            continue
        for line in lines:
            try:
                r = json.loads(line)
            except ValueError:
                continue  # a torn line
            if not isinstance(r, dict) or r.get("kind") != "eval" or not r.get("tokens"):
                continue
            loss = r.get("val_loss_causal", r.get("val_loss_topk"))
            if isinstance(loss, (int, float)) and np.isfinite(loss):
                rows.append({"run_id": run.name, "compute": per_token * float(r["tokens"]),
                             "val_loss": float(loss)})
    return pd.DataFrame(rows, columns=["run_id", "compute", "val_loss"])


def _on_curve(points: pd.DataFrame, compute: float) -> float | None:
    """The curve's loss at ``compute``, linear in ln FLOPs between the bracketing points;
    None outside the curve (the last point with one step of slack)."""
    c = points["compute"].to_numpy(float)
    loss = points["val_loss"].to_numpy(float)
    order = np.argsort(c)
    c, loss = c[order], loss[order]
    if not c[0] * (1 - STEP_RTOL) <= compute <= c[-1] * (1 + STEP_RTOL):
        return None
    return float(np.interp(np.log(compute), np.log(c), loss))


def references(frame: pd.DataFrame, curves: pd.DataFrame | None = None,
               use_law: bool = True, seed: int = 0) -> pd.DataFrame:
    """``reference_loss``, ``reference`` and ``reference_runs`` for every row of a
    validated table ``frame`` (dense rows get their own loss and ``self``)."""
    sparse = frame["is_sparse"].to_numpy()
    ids = frame["run_id"].astype(str) if "run_id" in frame else pd.Series(
        [f"row{i}" for i in range(len(frame))], index=frame.index)
    points = [pd.DataFrame({"run_id": ids[~sparse].to_numpy(),
                            "compute": frame.loc[~sparse, "compute"].to_numpy(float),
                            "val_loss": frame.loc[~sparse, "val_loss"].to_numpy(float)})]
    if curves is not None and len(curves):
        points.append(curves[curves["run_id"].astype(str).isin(set(ids[~sparse]))])
    by_run = {rid: g for rid, g in pd.concat(points).groupby("run_id")}
    laws = _dense_laws(frame, seed) if use_law else {}
    out_loss, out_kind, out_runs = [], [], []
    for i, row in enumerate(frame.itertuples(index=False)):
        if not sparse[i]:
            out_loss.append(float(row.val_loss))
            out_kind.append("self")
            out_runs.append(ids.iloc[i])
            continue
        same = ((~sparse) & (frame["context"].to_numpy() == row.context)
                & np.isclose(frame["params_active"].to_numpy(float), row.params_active,
                             rtol=SIZE_RTOL))
        found = {}
        for j in np.flatnonzero(same):
            v = _on_curve(by_run[ids.iloc[j]], float(row.compute))
            if v is not None:
                found[ids.iloc[j]] = v
        if found:
            out_loss.append(float(np.mean(list(found.values()))))
            out_kind.append("curve")
            out_runs.append(",".join(sorted(found)))
        elif same.any() and int(row.context) in laws:
            f_dense = float(np.median(frame.loc[same, "compute"] / frame.loc[same, "tokens"]))
            ln = dense.log_loss(laws[int(row.context)], np.log([row.params_active]),
                                np.log([row.compute / f_dense]))
            out_loss.append(float(np.exp(ln[0])))
            out_kind.append("dense law")
            out_runs.append("")
        else:
            out_loss.append(float("nan"))
            out_kind.append("none")
            out_runs.append("")
    return pd.DataFrame({"reference_loss": out_loss, "reference": out_kind,
                         "reference_runs": out_runs}, index=frame.index)


def _dense_laws(frame: pd.DataFrame, seed: int) -> dict[int, np.ndarray]:
    """The dense law of each context whose dense runs can fit one (others: none)."""
    rng = np.random.default_rng(seed)
    dense_rows = frame[~frame["is_sparse"]]
    out = {}
    for t, g in dense_rows.groupby("context"):
        try:
            fit = dense.fit_dense(np.log(g["params_active"].to_numpy(float)),
                                  np.log(g["tokens"].to_numpy(float)),
                                  np.log(g["val_loss"].to_numpy(float)), rng,
                                  f"dense runs at context {t}")
        except UserError:
            continue
        out[int(t)] = fit.params
    return out


def eq14_inputs(frame: pd.DataFrame, counts: str | None = None
                ) -> tuple[dict[str, pd.Series], str, str | None]:
    """What Eq. 14 reads of validated rows (:func:`xmodlm.law.table.validate`): N_act,
    N, L, K and A as columns (``params_active``, ``params_total``, ``context``,
    ``sparsity``, ``anchor_stride``), the counting rule, and a note where the rule had
    to fall back. One rule for the fit and for predictions (module docstring):
    ``counts`` is a fitted law's own rule, for rows predicted from it; None picks
    :data:`~xmodlm.law.paper.COUNTS_WITH_EMBEDDINGS` where the rows give
    ``params_non_embedding``, else :data:`~xmodlm.law.paper.COUNTS_EQS_4_5`."""
    split = "params_non_embedding" in frame and bool(frame["params_non_embedding"].notna().all())
    note = None
    if counts is None:
        counts = paper.COUNTS_WITH_EMBEDDINGS if split else paper.COUNTS_EQS_4_5
        if not split:
            note = "no params_non_embedding column: N and N_act without embeddings (Eqs. 4-5)"
    if counts == paper.COUNTS_WITH_EMBEDDINGS:
        if not split:
            raise UserError("rows without params_non_embedding cannot be counted as the law"
                            f" was fitted ({counts}); `xmod sweep --dry-run --plan` writes it")
        embed = frame["params_total"].astype(float) - frame["params_non_embedding"].astype(float)
        n_total = frame["params_total"].astype(float)
        n_act = frame["params_active"].astype(float) + embed
    elif counts == paper.COUNTS_EQS_4_5:
        n_act = frame["params_active"].astype(float)
        n_total = n_act * frame["rho"]
    else:
        raise UserError(f"unknown counting rule {counts!r}; known: {paper.COUNTS_WITH_EMBEDDINGS!r},"
                        f" {paper.COUNTS_EQS_4_5!r}")
    if "sparsity" in frame and frame["sparsity"].notna().all():
        k = frame["sparsity"].astype(float)
        a = frame["anchor_stride"].astype(float)
    else:
        ka = [depth.from_stride_capacity(int(s), float(c))
              for s, c in zip(frame["stride"], frame["capacity"], strict=True)]
        k, a = pd.Series([v[0] for v in ka], index=frame.index), pd.Series(
            [v[1] for v in ka], index=frame.index)
    return ({"params_active": n_act, "params_total": n_total,
             "context": frame["context"].astype(float), "sparsity": k, "anchor_stride": a},
            counts, note)


def law_frame(df: pd.DataFrame, curves: pd.DataFrame | None = None, loss: str = "causal",
              min_steps: int = 0, use_law: bool = True, seed: int = 0, family: str = "xmod",
              lr: float | None = None, counts: str | None = None
              ) -> tuple[pd.DataFrame, dict[str, Any]]:
    """The sparse runs of a results table as the paper's fit reads them (columns of
    :data:`xmodlm.law.paper_fit.COLUMNS` plus the reference), and a record of what
    was used and left out.

    One variant is fitted (``family``, :func:`xmodlm.law.select.one_variant`): a
    study's ablations and baselines share its table, and Eq. 14 describes X-MoD with
    all of its mechanisms. One peak learning rate: ``lr``, else the table's most common.
    ``counts``: the counting rule (:func:`eq14_inputs`), a fitted law's own where its
    runs are set beside runs it did not see."""
    runs = validate(df, loss=loss, min_steps=min_steps, evaluated=curves is None)
    frame = runs.frame.reset_index(drop=True)
    if not frame["is_sparse"].any():
        raise UserError("the paper's law is fitted on sparse runs; the table has none")
    frame, lr, other_lr = one_lr(frame, lr)
    frame, variant, excluded = one_variant(frame, family)
    frame = frame.reset_index(drop=True)
    ref = references(frame, curves, use_law, seed)
    frame = pd.concat([frame, ref], axis=1)
    sparse = frame[frame["is_sparse"]].copy()
    notes = list(runs.notes)
    eq14, counts, note = eq14_inputs(sparse, counts)
    notes += [note] if note else []
    out = pd.DataFrame({
        "run_id": sparse.get("run_id", pd.Series(sparse.index.astype(str), index=sparse.index)),
        **eq14,
        "dense_prefix": sparse.get("dense_prefix", 0),
        "val_loss": sparse["val_loss"], "reference_loss": sparse["reference_loss"],
        "reference": sparse["reference"], "reference_runs": sparse["reference_runs"],
    })
    out["delta"] = out["val_loss"] - out["reference_loss"]
    kinds = out["reference"].value_counts().to_dict()
    usable = out[out["reference"] != "none"].reset_index(drop=True)
    record = {"counts": counts, "references": {str(k): int(v) for k, v in kinds.items()},
              "left_out_no_reference": int(kinds.get("none", 0)), "loss": runs.loss,
              "variant": variant, "excluded_variants": excluded, "lr": lr,
              "left_out_other_lr": other_lr,
              "curves": curves is not None,  # dense references from validation curves
              "notes": notes,
              # each fitted run as Eq. 14 saw it: the fit can be drawn from its JSON alone
              "runs": usable[["run_id", *eq14, "val_loss", "reference_loss", "delta",
                              "reference", "reference_runs"]].to_dict(orient="records")}
    return usable, record
