"""The paper's law (its Eq. 14) on the additive residual, and its Table 8 fit.

    Delta = L_XMoD - L_dense_hat
          = e - u N_act^-etaN [1 - (N / N_act)^-rhoN]          capacity reward
              + w L^-etaL (K^rhoL - 1)                         sparse-context penalty
              - z (K^rhoK - 1) [(2A / (A + 1))^rhoA - 1]       anchor-stride interaction

with u, w, z >= 0 and e free. Every term is 0 for a dense model (K = 1, N =
N_act), so Delta = e there; the anchor term is 0 at A = 1. L_dense_hat is the
dense loss of the same N_act and L at the same training FLOPs
(:mod:`xmodlm.law.reference`). N_act and N are parameter counts and L a token
count; their units are absorbed into u and w.

Which counts feed N and N_act (docs/law.md says why): N is the model's total
parameters with embeddings (the paper's Table 1 column) and N_act its
active-equivalent size, the dense model of the same active depth with
embeddings (what the paper's size labels approximate: 556M labels a 543M dense
model). Where a count with embeddings is not recorded, N / N_act falls back to
the paper's Eqs. 4-5 (non-embedding: blocks over active depth). A fit records
its rule (:data:`COUNTS_WITH_EMBEDDINGS` or :data:`COUNTS_EQS_4_5`), and what
predicts from it reads its rows by that rule: the same N_act under the other rule
is another number (about 2.3x at width 64, where embeddings outweigh the blocks).

The optimum (Eq. 16) is a proportionality only; :func:`k_hat` is the continuous
minimiser of Eq. 14 at A = 1 on a given backbone, which Eq. 16 approximates.
For A > 1 the anchor term grows as K^rhoK (0.80 in Table 8) against the context
penalty's K^rhoL (0.48), so Eq. 14 has no interior optimum there: only the range
the law was fitted on bounds the answer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from scipy.optimize import minimize_scalar

SIZE_RTOL = 0.02  # "the same N_act": within 2% (routers add a little to a sparse model's count)
NAMES = ("e", "u", "eta_n", "rho_n", "w", "eta_l", "rho_l", "z", "rho_k", "rho_a")
LINEAR = ("e", "u", "w", "z")  # solved by least squares given the exponents (u, w, z >= 0)
EXPONENTS = ("eta_n", "rho_n", "eta_l", "rho_l", "rho_k", "rho_a")
TERMS = ("capacity", "context", "anchor")

TABLE8 = {
    "e": 0.01848, "u": 0.93519, "eta_n": 0.07784, "rho_n": 1.19538,
    "w": 105.21108, "eta_l": 0.92624, "rho_l": 0.48494,
    "z": 0.07455, "rho_k": 0.79900, "rho_a": 0.28293,
}
"""The paper's Table 8 (N_act in parameters, L in tokens)."""

TABLE8_RANGE = {
    "sparsity": [3.0, 16.0],
    "anchor_stride": [0.5, 5.0],
    "context": [2048, 32768],
    "params_active": [165e6, 936e6],
}
"""Where Table 8 was fitted: its 109 in-range runs (appendix B.4): K 3-16 (K = 3 at
L = 2k only), A 0.5-5, L 2k-32k, N_act 165M-936M. L = 64k and N_act = 1.65B were
named out of range before fitting."""

TABLE8_PROVENANCE = {
    "source": "X-MoD: Scalable Sparse-Depth Routing with Practical Scaling Laws, Table 8"
              " (appendix C.1), CC BY 4.0",
    "fit": "two stages (A = 1 context and scale sweeps, then the A-sweep at N_act 165M,"
           " L = 32k); exponents by differential evolution, e free, u, w, z >= 0 by"
           " constrained least squares",
    "runs": "109 in-range observations, R^2_Delta 0.9853; L = 64k and N_act = 1.65B held"
            " out before fitting",
    "reference": "dense validation curves interpolated at the same logged FLOPs, same N_act"
                 " and L",
    "loss": "validation loss under the causal threshold rule",
    "counts": "N_act the active-equivalent size label, N the total with embeddings"
              " (Table 1); L in tokens",
}


# the two counting rules (module docstring), as a fit records them
COUNTS_WITH_EMBEDDINGS = "N = params_total, N_act = params_active + embeddings"
COUNTS_EQS_4_5 = "N_act = params_active, N = N_act x blocks / active depth (Eqs. 4-5)"


@dataclass(frozen=True)
class Point:
    """What Eq. 14 sees of a configuration, as arrays of one length."""

    params_active: np.ndarray  # N_act
    params_total: np.ndarray  # N
    context: np.ndarray  # L, tokens
    sparsity: np.ndarray  # K
    anchor_stride: np.ndarray  # A

    @classmethod
    def of(cls, params_active: Any, params_total: Any, context: Any, sparsity: Any,
           anchor_stride: Any) -> Point:
        arrays = np.broadcast_arrays(*(np.asarray(v, dtype=float) for v in (
            params_active, params_total, context, sparsity, anchor_stride)))
        return cls(*(np.atleast_1d(a) for a in arrays))

    def subset(self, mask: np.ndarray) -> Point:
        return Point(self.params_active[mask], self.params_total[mask], self.context[mask],
                     self.sparsity[mask], self.anchor_stride[mask])

    def __len__(self) -> int:
        return len(self.sparsity)


def features(x: Point, p: dict[str, float]) -> dict[str, np.ndarray]:
    """The three features of Eqs. 11-13 at exponents ``p`` (R_N, P_L, R_AK): Delta =
    e - u R_N + w P_L - z R_AK."""
    ratio = x.params_total / x.params_active
    omega = 2 * x.anchor_stride / (x.anchor_stride + 1)
    return {
        "capacity": x.params_active ** -p["eta_n"] * (1 - ratio ** -p["rho_n"]),
        "context": x.context ** -p["eta_l"] * (x.sparsity ** p["rho_l"] - 1),
        "anchor": (x.sparsity ** p["rho_k"] - 1) * (omega ** p["rho_a"] - 1),
    }


def terms(x: Point, p: dict[str, float]) -> dict[str, np.ndarray]:
    """The three signed terms of Eq. 14 in nats (capacity <= 0 and anchor <= 0 where
    they reward; context >= 0)."""
    f = features(x, p)
    return {"capacity": -p["u"] * f["capacity"], "context": p["w"] * f["context"],
            "anchor": -p["z"] * f["anchor"]}


def delta(x: Point, p: dict[str, float]) -> np.ndarray:
    """Eq. 14: the predicted Delta = L_XMoD - L_dense_hat in nats."""
    t = terms(x, p)
    return p["e"] + t["capacity"] + t["context"] + t["anchor"]


def eq16_exponents(p: dict[str, float]) -> dict[str, float]:
    """Eq. 16: K_hat ~ L^a N_act^b with a = etaL / (rhoN + rhoL), b = -etaN / (rhoN + rhoL)."""
    s = p["rho_n"] + p["rho_l"]
    return {"context": p["eta_l"] / s, "params_active": -p["eta_n"] / s}


def k_hat(p: dict[str, float], params_active: float, context: float,
          total_at: Any, bounds: tuple[float, float] = (1.0, 4096.0)) -> float:
    """The continuous minimiser of Eq. 14 over K at A = 1 (where the anchor term is 0),
    with N = ``total_at(K)``, a model's total parameters as a continuous function
    of K (:func:`xmodlm.law.backbone` at A = 1: N_layer (N0 + N1 (1 + K)) + 2 V d).
    Returns the upper bound where Eq. 14 keeps falling there (no interior optimum)."""
    def f(log_k: float) -> float:
        k = float(np.exp(log_k))
        x = Point.of(params_active, total_at(k), context, k, 1.0)
        return float(delta(x, p)[0])

    lo, hi = np.log(bounds[0]), np.log(bounds[1])
    res = minimize_scalar(f, bounds=(lo, hi), method="bounded", options={"xatol": 1e-6})
    return float(np.exp(res.x))


def r2(observed: np.ndarray, predicted: np.ndarray) -> float:
    """R^2_Delta = 1 - sum (Delta - Delta_hat)^2 / sum (Delta - mean Delta)^2 (appendix B.5)."""
    ss = float(np.sum((observed - observed.mean()) ** 2))
    return float("nan") if ss == 0 else 1 - float(np.sum((observed - predicted) ** 2)) / ss


SCHEMA = "xmodlm.law.paper/1"


@dataclass
class PaperLaw:
    """A fitted Eq. 14: point values, bootstrap draws (none for a published fit), the
    ranges it was fitted on, where it comes from, and its held-out scores."""

    name: str
    value: dict[str, float]
    ranges: dict[str, list[float]]
    provenance: dict[str, Any]
    samples: np.ndarray | None = None  # (B, 10) in NAMES order
    metrics: dict[str, Any] | None = None
    reference: dict[str, Any] | None = None  # which dense reference each fitted run got

    def fitted_runs(self) -> Any:
        """The runs the law was fitted on as a frame (run_id, Eq. 14's inputs, the
        run's loss, its reference and Delta), from the fit's own record; None for a
        law that keeps none (Table 8, or a fit written before the record held them)."""
        import pandas as pd

        runs = (self.reference or {}).get("runs") or []
        if not runs or "delta" not in runs[0]:
            return None
        return pd.DataFrame(runs)

    def counts(self) -> str | None:
        """The counting rule the fit read its runs by (:data:`COUNTS_WITH_EMBEDDINGS`
        or :data:`COUNTS_EQS_4_5`); None for Table 8, counted as the paper counts."""
        return (self.reference or {}).get("counts")

    def heldout_scores(self) -> dict[str, dict[str, Any]]:
        """Each held-out protocol's scores without its per-run points: the points are
        for the plots, and a summary printed or quoted would drown in them."""
        return {protocol: {k: v for k, v in (scores or {}).items() if k != "points"}
                for protocol, scores in ((self.metrics or {}).get("heldout") or {}).items()}

    def draws(self) -> list[dict[str, float]]:
        if self.samples is None:
            return []
        return [dict(zip(NAMES, row, strict=True)) for row in self.samples]

    def outside(self, point: dict[str, float]) -> list[str]:
        """Each input of ``point`` (keys of :data:`TABLE8_RANGE`) outside the fitted
        ranges, as "sparsity 24 outside [3, 16]". N_act within :data:`SIZE_RTOL` of the
        range is inside it: that is one backbone."""
        out = []
        for key, span in self.ranges.items():
            v = point.get(key)
            if v is None or span is None:
                continue
            tol = SIZE_RTOL if key == "params_active" else 1e-9
            if not span[0] * (1 - tol) <= v <= span[1] * (1 + tol):
                out.append(f"{key} {v:.4g} outside [{span[0]:.4g}, {span[1]:.4g}]")
        return out

    def to_json(self, samples: bool = True) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "law": "paper",
            "name": self.name,
            "form": "Eq. 14: Delta = e - u N_act^-eta_n [1 - (N/N_act)^-rho_n]"
                    " + w L^-eta_l (K^rho_l - 1) - z (K^rho_k - 1) [(2A/(A+1))^rho_a - 1]",
            "params": dict(self.value),
            "ranges": self.ranges,
            "provenance": self.provenance,
            "metrics": self.metrics,
            "reference": self.reference,
            **({"samples": self.samples.tolist()}
               if samples and self.samples is not None else {}),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> PaperLaw:
        samples = data.get("samples")
        return cls(
            name=str(data.get("name", "paper")),
            value={k: float(data["params"][k]) for k in NAMES},
            ranges=data["ranges"],
            provenance=data.get("provenance", {}),
            samples=None if samples is None else np.asarray(samples, dtype=float).reshape(
                -1, len(NAMES)),
            metrics=data.get("metrics"),
            reference=data.get("reference"),
        )


def table8() -> PaperLaw:
    """The paper's own fit (Table 8), shipped as the named law ``paper``."""
    return PaperLaw("paper", dict(TABLE8), {k: list(v) for k, v in TABLE8_RANGE.items()},
                    dict(TABLE8_PROVENANCE))


def is_paper_json(data: Any) -> bool:
    return isinstance(data, dict) and data.get("schema") == SCHEMA


def read_paper_law(name: str | None) -> PaperLaw | None:
    """The paper's law that ``name`` names: ``paper`` (Table 8) or a JSON file written
    by ``xmod law fit --form paper``; None for anything else (another kind of fit,
    whose own reader says what is wrong with it)."""
    import json
    from pathlib import Path

    if name == "paper" and not Path(name).is_file():
        return table8()
    if name and Path(name).is_file() and Path(name).suffix.lower() == ".json":
        try:
            data = json.loads(Path(name).read_text())
        except ValueError:
            return None
        if is_paper_json(data):
            return PaperLaw.from_json(data)
    return None
