"""``xmod info``: what a configuration costs, as one JSON-able object."""

from __future__ import annotations

from typing import Any

from xmodlm import flops
from xmodlm.config import load_config
from xmodlm.model import active_depth


def model_info(config: str, overrides: list[str] | tuple[str, ...] = ()) -> dict[str, Any]:
    """Parameters, FLOPs per token at the config's context, layout and resolved config."""
    cfg = load_config(config, overrides)
    m = cfg.model
    counts = flops.count(m)
    layout = m.block_layout
    return {
        "name": cfg.name,
        "family": m.family,
        **counts.as_dict(),
        "layout": layout,
        "stride": m.stride,
        "capacity": m.capacity,
        "n_layers": m.n_layers,
        "active_depth": active_depth(m),
        "expansion_ratio": len(layout) / active_depth(m),
        "config": cfg.to_dict(),
    }


def format_info(info: dict[str, Any]) -> str:
    """A short human-readable summary of :func:`model_info`."""
    f = info["flops_per_token"]
    return "\n".join(
        [
            f"{info['name']} ({info['family']})  layout {info['layout']}",
            f"  params total        {info['params_total']:>14,}",
            f"  params non-embedding{info['params_non_embedding']:>14,}",
            f"  params active (N_ae){info['params_active']:>14,.0f}",
            f"  FLOPs/token fwd     {f['forward']:>14,.0f}   train {f['train']:,.0f}"
            f"   (context {info['context']})",
            f"  active depth {info['active_depth']:.3g} of {info['n_layers']}"
            f"  (expansion ratio rho = {info['expansion_ratio']:.3g})",
        ]
    )
