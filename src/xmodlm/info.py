"""``xmod info``: what a configuration costs, as one JSON-able object.

Counting is arithmetic on the config: no model is built for a config whose
weights would not fit comfortably in memory (:data:`BUILD_LIMIT_PARAMS`), so
``info`` answers for a model of any size. :func:`check_memory` is the same
arithmetic turned into a refusal, before training or loading allocates anything.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from xmodlm import flops
from xmodlm.config import ModelConfig, load_config
from xmodlm.errors import UserError
from xmodlm.model import active_depth

if TYPE_CHECKING:
    import torch

BUILD_LIMIT_PARAMS = 50_000_000
"""Above this many parameters ``info`` does not build the model to measure the gate
(200 MB of fp32 weights plus a few forward passes): training measures it."""
BYTES_PER_PARAM = {"train": 16, "load": 4}
"""fp32 bytes per parameter: training holds weights, gradients and Adam's two moments;
loading a checkpoint holds the weights."""


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
        "sparsity": m.depth.sparsity,
        "anchor_stride": m.depth.anchor_stride,
        "dense_prefix": m.depth.dense_prefix,
        "stride": m.depth.stride,
        "capacity": m.depth.capacity,
        "n_layers": m.num_blocks,
        "active_depth": active_depth(m),
        "expansion_ratio": flops.expansion_ratio(m),
        "flops_over_dense": flops.flops_over_dense(m),
        "gate_gamma_init": gate_gamma_init(cfg.model, cfg.train.seed),
        "config": cfg.to_dict(),
    }


def gate_gamma_init(m: ModelConfig, seed: int) -> list[float] | None:
    """Initial gamma of each variance-scaled sparse layer, in depth order (empty if none;
    None where the model is too large to build here).

    The rule measures the initialised stack (``Transformer.init_gates_``), so this
    builds the model with the seed training would use; nothing is built when no
    layer has a variance-scaled gate, or when the model has more than
    :data:`BUILD_LIMIT_PARAMS` parameters.
    """
    if m.gating != "variance_scaled" or "s" not in m.block_layout:
        return []
    if flops.count(m).params_total > BUILD_LIMIT_PARAMS:
        return None
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
            f"  FLOPs/token LM head {f['lm_head']:>14,.0f}   fwd without it"
            f" {f['forward'] - f['lm_head']:,.0f} (the paper's Table 6 count)",
            f"  active depth {info['active_depth']:.3g} of {info['n_layers']}"
            f"  (expansion ratio rho = {info['expansion_ratio']:.3g});  K {info['sparsity']:g},"
            f" A {info['anchor_stride']:g}, dense prefix {info['dense_prefix']}",
            *([f"  phi / phi_D         {info['flops_over_dense']:>14.3f}   (forward without the"
               " LM head, over dense of the same active depth)"]
              if info["flops_over_dense"] is not None else []),
            *(
                [f"  initial gate gamma  {info['gate_gamma_init'][0]:.4g} (every sparse layer)"]
                if info["gate_gamma_init"]
                else ["  initial gate gamma  measured when training starts (too large to build"
                      " here)"] if info["gate_gamma_init"] is None else []
            ),
        ]
    )


def memory_total(device: torch.device) -> int | None:
    """Bytes of memory of ``device`` (RAM for the CPU), or None where unknown."""
    if device.type == "cuda":
        import torch

        return int(torch.cuda.get_device_properties(device).total_memory)
    try:
        return int(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return None


def check_memory(m: ModelConfig, device: torch.device, purpose: str = "train") -> None:
    """Refuse a model whose weights (and, to train, gradients and Adam state) exceed
    the device's memory, before anything is allocated: otherwise a mistyped size
    (``model.vocab_size=2e9``) ends in an allocator failure deep inside torch."""
    need = flops.count(m).params_total * BYTES_PER_PARAM[purpose]
    have = memory_total(device)
    if have is not None and need > have:
        raise UserError(
            f"the model has {flops.count(m).params_total:.3g} parameters: {purpose}ing it needs"
            f" at least {need / 2**30:.3g} GiB ({BYTES_PER_PARAM[purpose]} bytes each), more than"
            f" the {have / 2**30:.3g} GiB of {device}: check model.vocab_size, d_model and"
            " n_layers"
        )
