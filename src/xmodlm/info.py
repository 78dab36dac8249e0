"""``xmod info``: what a configuration costs, as one JSON-able object."""

from __future__ import annotations

from typing import Any

from xmodlm import flops
from xmodlm.config import ModelConfig, load_config
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
        "gate_gamma_init": gate_gamma_init(cfg.model, cfg.train.seed),
        "config": cfg.to_dict(),
    }


def gate_gamma_init(m: ModelConfig, seed: int) -> list[float]:
    """Initial gamma of each variance-scaled sparse layer, in depth order (empty if none).

    The rule measures the initialised stack (``Transformer.init_gates_``), so this
    builds the model with the seed training would use; nothing is built when no
    layer has a variance-scaled gate.
    """
    if m.gating != "variance_scaled" or "s" not in m.block_layout:
        return []
    import torch

    from xmodlm.model import Transformer

    torch.manual_seed(seed)
    model = Transformer(m)
    return [float(b.gamma.detach()) for b in model.blocks if getattr(b, "gamma", None) is not None]


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
            *(
                [f"  initial gate gamma  {info['gate_gamma_init'][0]:.4g} (every sparse layer)"]
                if info["gate_gamma_init"]
                else []
            ),
        ]
    )
