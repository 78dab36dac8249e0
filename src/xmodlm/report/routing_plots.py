"""Pictures of where sparse compute goes.

* :func:`show_routing`: a passage with each token shaded by how many sparse blocks
  processed it (causal routing, the inference-time decision, or top-k, the training
  one), maps of sparse blocks x tokens of the router scores with the top-k choice and
  of the causal decision, and optionally a self-contained HTML page with the same
  shading (hover a token for its blocks and scores);
* :func:`plot_training`: coverage, per-token sparse-depth histogram (last eval) and
  Jaccard overlap of consecutive sparse blocks over training, from the eval
  records of ``metrics.jsonl``.

Figures use :class:`matplotlib.figure.Figure` with the Agg canvas, never pyplot.
"""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any

import numpy as np
import torch
from matplotlib import colormaps
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import Normalize
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from xmodlm.config import load_config
from xmodlm.data.tokenizer import Tokenizer
from xmodlm.errors import UserError
from xmodlm.fileio import atomic_savefig, atomic_write_text
from xmodlm.model import Transformer
from xmodlm.model.blocks import RoutedBlock
from xmodlm.model.layers import matmul_dtype
from xmodlm.runs import load_run, tokenizer_path
from xmodlm.train.loggers import read_metrics

CMAP = "YlOrRd"
LINE_CHARS = 90  # characters per rendered line of the passage
CHAR_IN = 0.09  # inches per character in the PNG


ROUTINGS = {"causal": "causal routing, as at inference",
            "topk": "top-k routing, as in training"}
"""What a picture of routing can show: the inference-time decision (``causal``, a
threshold on each token's own logit) or the training one (``topk``: the k = round(c T)
highest router scores of the sequence). Early in training the causal decision may
route nothing while top-k, by construction, always routes k tokens."""


@torch.no_grad()
def token_routing(model: Transformer, ids: list[int]) -> dict[str, np.ndarray]:
    """Per sparse block (rows, in depth order) and token: ``causal`` and ``topk``
    (bool, which tokens the block processes under each routing) and ``score``
    (sigmoid of the router logit in the top-k pass, the preference top-k ranks)."""
    idx = torch.tensor([ids], dtype=torch.long, device=model.embed.weight.device)
    pos = torch.arange(idx.shape[1], device=idx.device)
    rows: dict[str, list[np.ndarray]] = {"causal": [], "topk": [], "score": []}
    for mode in ROUTINGS:
        x = model.embed(idx)
        rot = model.rope(pos, matmul_dtype(x))
        _, outs = model.run_blocks(x, pos, mode, rot)
        for block, out in zip(model.blocks, outs, strict=True):
            if isinstance(block, RoutedBlock):
                assert out.processed_BT is not None and out.r_BT is not None
                rows[mode].append(out.processed_BT[0].cpu().numpy())
                if mode == "topk":
                    rows["score"].append(torch.sigmoid(out.r_BT[0].float()).cpu().numpy())
    n = len(ids)
    return {
        "causal": np.stack(rows["causal"]).astype(bool) if rows["causal"] else np.zeros((0, n), bool),
        "topk": np.stack(rows["topk"]).astype(bool) if rows["topk"] else np.zeros((0, n), bool),
        "score": np.stack(rows["score"]) if rows["score"] else np.zeros((0, n)),
    }


def routing_of_text(
    run_dir: str | Path, text: str, device: str = "cpu", routing: str = "causal"
) -> dict[str, Any]:
    """Tokens of ``text`` (after ``<|endoftext|>``, cut to the context) and their routing.

    ``selected``/``depth``/``mean_depth`` are of ``routing`` (one of :data:`ROUTINGS`);
    ``causal``, ``topk`` and ``scores`` are always given, and ``blocks`` numbers the
    sparse blocks by their place in the whole stack (0 = the first block), as the
    training figures do."""
    if routing not in ROUTINGS:
        raise UserError(f"routing {routing!r} is not one of {', '.join(ROUTINGS)}")
    if not text.strip():
        raise UserError("--text is empty: give a passage to route")
    cfg, model, ckpt = load_run(run_dir, device=device)
    if "s" not in model.layout:
        raise UserError(f"run {str(run_dir)!r} has no sparse blocks (layout {model.layout}): nothing to show")
    tok = Tokenizer.load(tokenizer_path(run_dir))
    ids = tok.encode(text)
    truncated = len(ids) > cfg.model.context - 1
    ids = ids[: cfg.model.context - 1]
    routed = {k: v[:, 1:] for k, v in token_routing(model, [tok.eot_id, *ids]).items()}
    sel = routed[routing]
    return {
        "tokens": [tok.decode([i]) for i in ids],
        "ids": ids,
        "routing": routing,
        "selected": sel.tolist(),
        "depth": [int(d) for d in sel.sum(0)],
        "causal": routed["causal"].tolist(),
        "topk": routed["topk"].tolist(),
        "scores": np.round(routed["score"], 4).tolist(),
        "blocks": sparse_blocks(model.layout),
        "n_sparse": int(sel.shape[0]),
        "layout": model.layout,
        "truncated": truncated,
        "checkpoint": str(ckpt),
        "mean_depth": float(sel.sum(0).mean()),
    }


def sparse_blocks(layout: str) -> list[int]:
    """Where each sparse block sits in the stack (0 = the first block): the one
    numbering of blocks in every routing figure, as in the residual-RMS plot."""
    return [i for i, kind in enumerate(layout) if kind == "s"]


def _shade(cmap: Any, norm: Normalize, depth: int) -> tuple[float, float, float, float]:
    """Colour of a token processed by ``depth`` sparse blocks: light enough for black text."""
    return cmap(0.05 + 0.6 * norm(depth))


def _display(token: str) -> str:
    return token.replace("\n", "\u23ce").replace("\t", " ")


def _tick_label(token: str) -> str:
    """A token as an axis label: its spaces visible (a leading space is what tells
    " the" from "the", and a label's spaces would otherwise vanish)."""
    return _display(token).replace(" ", "\u2423")


KEY_LABEL_IN = 0.16
"""Inches per label of the colour key at least (8-point labels then never overlap)."""


def colour_key(n_sparse: int, text_h: float, room: float) -> tuple[float, list[int]]:
    """Height (inches) of the depth colour key and the depths it labels: tall enough for
    a label per ``KEY_LABEL_IN`` inches within ``room``, labelling every k-th depth
    (and the top one) when that is too little for all of them."""
    bar_h = min(max(text_h, 1.2, KEY_LABEL_IN * (n_sparse + 1)), room)
    slots = max(2, int(bar_h / KEY_LABEL_IN))
    every = _tick_step(n_sparse + 1, slots - 1) if n_sparse + 1 > slots else 1
    depths = [d for d in range(0, n_sparse + 1, every)]
    if depths[-1] != n_sparse:
        if n_sparse - depths[-1] < every:  # too close to the top label: drop it
            depths.pop()
        depths.append(n_sparse)
    return bar_h, depths[::-1]


def _tick_step(n: int, most: int) -> int:
    """Label every k-th of ``n`` ticks so that at most ``most`` labels show."""
    return max(1, -(-n // most))


def _save(fig: Figure, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    FigureCanvasAgg(fig)
    atomic_savefig(fig, path, dpi=120)
    return path


def show_routing(
    run_dir: str | Path,
    text: str,
    out_png: str | Path,
    out_html: str | Path | None = None,
    device: str = "cpu",
    routing: str = "causal",
) -> dict[str, Any]:
    """Draw the routing of ``text``; returns :func:`routing_of_text`'s dict plus paths.

    The passage is shaded by sparse depth under ``routing``. Below it, two maps of
    sparse blocks x tokens: the router's score with the top-k choice marked (what
    training routes, meaningful from the first step), and the causal decision (what
    inference routes, empty until the decision has learned and been calibrated).

    Long on purpose: one figure laid out top to bottom (the passage, the score
    map, the decision map), whose panels share one geometry of inches per
    character computed at the start.
    """
    info = routing_of_text(run_dir, text, device, routing)
    tokens, depth, n_sparse = info["tokens"], info["depth"], info["n_sparse"]
    cmap, norm = colormaps[CMAP], Normalize(0, max(1, n_sparse))

    # lay the passage out in rows of LINE_CHARS monospace characters
    placed, col, row = [], 0, 0
    for t, d in zip(tokens, depth, strict=True):
        s = _display(t)
        if col + len(s) > LINE_CHARS and col > 0:
            row, col = row + 1, 0
            s = s.lstrip() or s
        placed.append((row, col, s, d))
        col += len(s)
    n_rows = row + 1
    # explicit axes in inches, so one data unit is exactly one monospace character:
    # DejaVu Sans Mono advances 0.602 em, so CHAR_IN inches per char sets the size
    text_w, text_h = LINE_CHARS * CHAR_IN, 0.3 * n_rows
    heat_h = 0.3 * n_sparse + 0.2
    left, right, top, gap, between, bottom = 1.1, 1.1, 0.45, 0.9, 0.45, 1.2
    W, H = left + text_w + right, top + text_h + gap + 2 * heat_h + between + bottom
    fig = Figure(figsize=(W, H))
    ax = fig.add_axes((left / W, (H - top - text_h) / H, text_w / W, text_h / H))
    ax.set_xlim(0, LINE_CHARS)
    ax.set_ylim(n_rows, 0)
    ax.axis("off")
    fontsize = CHAR_IN * 72 / 0.602
    for r, c, s, d in placed:
        ax.add_patch(Rectangle((c, r + 0.06), len(s), 0.88, color=_shade(cmap, norm, d), lw=0))
        ax.text(c, r + 0.5, s, family="DejaVu Sans Mono", fontsize=fontsize, va="center",
                ha="left")
    title = (f"sparse blocks processing each token ({ROUTINGS[routing]}),"
             f" layout {info['layout']}, mean depth {info['mean_depth']:.2f}")
    if not any(depth):
        title += " - no token routed"
    ax.set_title(title + (" [truncated to context]" if info["truncated"] else ""), fontsize=10,
                 loc="left")
    # the colour key: tall enough for its labels (at most one per 0.16 inch; it may
    # reach into the gap below the text, never above it nor beside the score map's key)
    bar_h, depths = colour_key(n_sparse, text_h, text_h + gap - 0.15)
    cax = fig.add_axes(((left + text_w + 0.15) / W, (H - top - bar_h) / H, 0.12 / W, bar_h / H))
    shades = [_shade(cmap, norm, d) for d in range(n_sparse + 1)]
    cax.imshow(np.array(shades)[::-1, None, :3], aspect="auto")
    cax.set_xticks([])
    cax.set_yticks([n_sparse - d for d in depths], [str(d) for d in depths], fontsize=8)
    cax.yaxis.tick_right()
    cax.yaxis.set_label_position("right")
    cax.set_ylabel("sparse depth (blocks)", fontsize=8)

    scores, topk = np.array(info["scores"]), np.array(info["topk"], dtype=bool)
    causal = np.array(info["causal"], dtype=float)
    sx = fig.add_axes((left / W, (bottom + heat_h + between) / H, text_w / W, heat_h / H))
    # the colours span the scores present: a young router's scores all sit near 0.5,
    # yet their order is what top-k acts on
    image = sx.imshow(scores, aspect="auto", cmap="Blues", interpolation="nearest",
                      vmin=scores.min(), vmax=max(scores.max(), scores.min() + 1e-6))
    rows, cols = np.nonzero(topk)
    sx.scatter(cols, rows, s=9, color="tab:orange", edgecolors="black", linewidths=0.4)
    sx.set_title("router score sigmoid(r) (blue, scaled to the scores shown);"
                 " orange: the top-k tokens training routes",
                 fontsize=9)
    sx.set_xticks([])
    kx = fig.add_axes(((left + text_w + 0.15) / W, (bottom + heat_h + between) / H, 0.12 / W,
                       heat_h / H))
    fig.colorbar(image, cax=kx).ax.tick_params(labelsize=7)

    hx = fig.add_axes((left / W, bottom / H, text_w / W, heat_h / H))
    hx.imshow(causal, aspect="auto", cmap="Greys", vmin=0, vmax=1.3, interpolation="nearest")
    hx.set_title("processed (dark) under causal routing, what inference runs"
                 + ("" if causal.any() else ": none yet (the causal decision has not learned)"),
                 fontsize=9)
    T = len(tokens)
    step = _tick_step(T, 60)
    hx.set_xticks(range(0, T, step), [_tick_label(tokens[i]) for i in range(0, T, step)],
                  rotation=90, fontsize=7, family="DejaVu Sans Mono")
    hx.set_xlabel("token (\u2423 = space)" + (f", every {step}th labelled" if step > 1 else ""),
                  fontsize=9)
    for a in (sx, hx):
        a.set_yticks(range(n_sparse), [f"block {i}" for i in info["blocks"]], fontsize=8)
        a.set_ylabel("sparse block", fontsize=9)
    info["png"] = str(_save(fig, out_png))
    if out_html is not None:
        info["html"] = str(_write_html(info, out_html, cmap, norm))
    return info


def _write_html(info: dict[str, Any], path: str | Path, cmap: Any, norm: Normalize) -> Path:
    n = info["n_sparse"]
    spans = []
    for j, (t, d) in enumerate(zip(info["tokens"], info["depth"], strict=True)):
        r, g, b, _ = _shade(cmap, norm, d)
        took = [str(b) for i, b in enumerate(info["blocks"]) if info["selected"][i][j]]
        scores = " ".join(f"{info['scores'][i][j]:.2f}" for i in range(n))
        tip = (f"token {j}: {d}/{n} sparse blocks (blocks {', '.join(took) or 'none'});"
               f" router scores {scores}")
        spans.append(
            f'<span style="background:rgb({int(r * 255)},{int(g * 255)},{int(b * 255)})"'
            f' title="{html.escape(tip)}">{html.escape(t)}</span>'
        )
    legend = "".join(
        '<span class="key" style="background:rgb({},{},{})">{}</span>'.format(
            *(int(v * 255) for v in _shade(cmap, norm, d)[:3]), d
        )
        for d in range(n + 1)
    )
    page = f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>xmod routing</title>
<style>
body {{ font-family: sans-serif; max-width: 60em; margin: 2em auto; }}
.text {{ font-family: monospace; white-space: pre-wrap; line-height: 1.8; font-size: 15px; }}
.key {{ display: inline-block; width: 2em; text-align: center; font-family: monospace; }}
</style></head><body>
<h3>{html.escape(ROUTINGS[info["routing"]].capitalize())}, layout {html.escape(info["layout"])}</h3>
<p>Shade = number of sparse blocks (of {n}) that processed the token; hover for the blocks
(numbered by place in the stack, 0 = the first) and each one's router score sigmoid(r).
Mean depth {info["mean_depth"]:.2f}.{" Truncated to the context." if info["truncated"] else ""}</p>
<p>depth: {legend}</p>
<div class="text">{"".join(spans)}</div>
</body></html>
"""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, page)
    return path


def plot_training(run_dir: str | Path, out_dir: str | Path) -> list[Path]:
    """Coverage, depth histogram and Jaccard overlap from the run's eval records; blocks
    are numbered by their place in the stack (:func:`sparse_blocks`), as in
    :func:`show_routing`, read from the run's ``config.yaml`` (sparse blocks counted
    from 0 when it is missing)."""
    evals = [r for r in read_metrics(run_dir) if r.get("kind") == "eval" and "coverage" in r]
    if not evals:
        raise UserError(
            f"run {str(run_dir)!r} has no eval records with routing statistics in metrics.jsonl"
        )
    out = Path(out_dir)
    steps = [r["step"] for r in evals]
    paths = []
    config = Path(run_dir) / "config.yaml"
    blocks = (sparse_blocks(load_config(config).model.block_layout) if config.is_file()
              else list(range(len(evals[-1]["depth_hist"]) - 1)))

    fig = Figure(figsize=(6, 4))
    ax = fig.add_subplot()
    for w in range(len(evals[-1]["coverage"])):
        ax.plot(steps, [r["coverage"][w] for r in evals], marker="o", label=f"window {w}")
    ax.set(xlabel="step", ylabel="coverage (tokens in >= 1 sparse block)", ylim=(0, 1.02),
           title="per-window coverage")
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(_save(fig, out / "routing_coverage.png"))

    fig = Figure(figsize=(6, 4))
    ax = fig.add_subplot()
    hist = evals[-1]["depth_hist"]
    ax.bar(range(len(hist)), hist, color=colormaps[CMAP](0.6))
    ax.set(xlabel="sparse blocks processing a token", ylabel="fraction of tokens",
           title=f"per-token sparse depth at step {steps[-1]}")
    ax.set_xticks(range(len(hist)))
    fig.tight_layout()
    paths.append(_save(fig, out / "routing_depth_hist.png"))

    fig = Figure(figsize=(6, 4))
    ax = fig.add_subplot()
    for i in range(len(evals[-1].get("jaccard", []))):
        ax.plot(steps, [r["jaccard"][i] for r in evals], marker="o",
                label=f"blocks {blocks[i]} and {blocks[i + 1]}")
    ax.set(xlabel="step", ylabel="Jaccard overlap", ylim=(0, 1.02),
           title="overlap of consecutive sparse blocks' selections")
    if evals[-1].get("jaccard"):
        ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(_save(fig, out / "routing_jaccard.png"))
    return paths
