"""``torch.compile`` in the bench: per block, and which mode won.

The bench compiles block by block rather than the whole model: blocks of one
type and shape share a compiled graph, so a 12-block model compiles in the
time of one block; the head, loss and optimiser stay eager; and the same
method applies to every model compared (ours and the GPT-2 reference), so a
compiled comparison is like for like. MoE blocks stay eager: their expert
batches have data-dependent sizes. ``torch._dynamo`` is reset between sizes,
so that every size compiles graphs for its own static shapes instead of
accumulating shape variants (and falling back to eager once dynamo's cache
limit is reached).

Eager and compiled models are timed in the same interleaved rounds, and
:func:`faster_mode` picks, per model, the mode with the lower median step
time, as DESIGN 11 asks: measure both on each platform, use the faster, say
which.
"""

from __future__ import annotations

from torch import nn

HOW = ("torch.compile per block (blocks of one type and shape share a graph);"
       " head, loss and optimiser eager")
MODES = ("eager", "compiled")


def block_kind(block: nn.Module) -> str | None:
    """``dense`` (anchor or GPT-2 block), ``routed`` (sparse) or None (MoE: stays eager)."""
    from xmodlm.model.blocks import RoutedBlock
    from xmodlm.model.moe import MoEMLP

    if isinstance(block, RoutedBlock):
        return "routed"
    if isinstance(getattr(getattr(block, "block", None), "mlp", None), MoEMLP):
        return None
    return "dense"


def compilable(model: nn.Module) -> bool:
    """Whether compiling ``model`` per block changes anything (any block not MoE)."""
    return any(block_kind(b) is not None for b in getattr(model, "blocks", []))


def compile_blocks(model: nn.Module) -> str:
    """``torch.compile`` in place every block of ``model`` that is not MoE; says what ran."""
    done = 0
    for block in getattr(model, "blocks", []):
        if block_kind(block) is not None:
            block.compile()
            done += 1
    total = len(getattr(model, "blocks", []))
    if done == 0:
        return "eager"
    return "compiled" if done == total else f"compiled {done} of {total} blocks, others eager"


def reset() -> None:
    """Forget every compiled graph (between sizes); nothing if dynamo is unavailable."""
    try:
        import torch._dynamo as dynamo
    except ImportError:
        return
    dynamo.reset()


def faster_mode(medians: dict[str, float]) -> str:
    """The mode with the lower median step time (eager on a tie)."""
    return min(MODES, key=lambda m: (medians.get(m, float("inf")), m != "eager"))
