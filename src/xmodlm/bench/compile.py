"""``torch.compile`` in the bench: per block, the whole model, and which mode won.

Two compiled modes are timed beside eager, because they answer different
questions:

* ``compiled`` (per block): blocks of one type and shape share a compiled
  graph, so a 12-block model compiles in the time of one block; the head, loss
  and optimiser stay eager. MoE blocks stay eager (their expert batches have
  data-dependent sizes). Cheap to compile, and the same method applies to every
  model compared (ours and the GPT-2 reference).
* ``compiled_model`` (whole model): ``torch.compile`` of the model, forward
  and backward as one graph with the head and loss in it, exactly what
  ``xmod train`` runs under ``train.compile=on`` (the studies' setting) in one
  process. Fusions cross block boundaries, so on a CPU, where each kernel pays a
  thread barrier, it is the mode that removes the most per-op cost; MoE is
  compiled too, with a graph break at its dropless split.

``torch._dynamo`` is reset between sizes, so that every size compiles graphs
for its own static shapes instead of accumulating shape variants (and falling
back to eager once dynamo's cache limit is reached).

All modes are timed in the same interleaved rounds, and :func:`faster_mode`
picks, per model, the mode with the lower median step time, as DESIGN 11 asks:
measure each on each platform, use the faster, say which.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

from torch import nn

HOW = {
    "compiled": "torch.compile per block (blocks of one type and shape share a graph);"
                " head, loss and optimiser eager; MoE blocks eager",
    "compiled_model": "torch.compile of the whole model (forward, backward, head and loss;"
                      " the trainer's train.compile=on); optimiser eager",
}
COMPILED = tuple(HOW)  # the compiled modes, in the order they are built
MODES = ("eager", *COMPILED)


def block_kind(block: nn.Module) -> str | None:
    """``dense`` (anchor or GPT-2 block), ``routed`` (sparse) or None (MoE: stays eager)."""
    from xmodlm.model.blocks import RoutedBlock
    from xmodlm.model.moe import MoEMLP

    if isinstance(block, RoutedBlock):
        return "routed"
    if isinstance(getattr(getattr(block, "block", None), "mlp", None), MoEMLP):
        return None
    return "dense"


def compilable(model: nn.Module, mode: str) -> bool:
    """Whether compiling ``model`` in ``mode`` changes anything: per block, any
    block not MoE; the whole model, always."""
    if mode == "compiled_model":
        return True
    return any(block_kind(b) is not None for b in getattr(model, "blocks", []))


def compile_model(model: nn.Module) -> nn.Module:
    """The whole model compiled as the trainer compiles it (``torch.compile``, defaults)."""
    import torch

    return torch.compile(model)


class CompiledBlocks:
    """Every block of a model that is not MoE, compiled, switched on only inside
    :meth:`active`, so that the eager and per-block cases of one model can share its
    weights, optimiser and batch (one copy of the model's state for all its modes).

    A block's ``nn.Module.compile()`` sets its ``_compiled_call_impl``, which every call
    of the block then takes; here that attribute is set on entering :meth:`active` and
    cleared on leaving, so the same block runs eager everywhere else (in the eager
    case, and when traced as part of the whole-model compile).
    """

    def __init__(self, model: nn.Module) -> None:
        import torch

        blocks = list(getattr(model, "blocks", []))
        self.compiled = [(b, torch.compile(b._call_impl)) for b in blocks
                         if block_kind(b) is not None]
        done, total = len(self.compiled), len(blocks)
        self.mode = ("eager" if done == 0 else "compiled" if done == total
                     else f"compiled {done} of {total} blocks, others eager")

    @contextmanager
    def active(self) -> Iterator[None]:
        for block, impl in self.compiled:
            block._compiled_call_impl = impl
        try:
            yield
        finally:
            for block, _ in self.compiled:
                block._compiled_call_impl = None


def parse_modes(modes: str | Iterable[str] | None) -> tuple[str, ...]:
    """Compiled modes from ``"compiled,compiled_model"`` or a list (None: all of
    :data:`COMPILED`); anything else raises :class:`~xmodlm.errors.UserError`."""
    from xmodlm.errors import UserError

    if modes is None:
        return COMPILED
    names = [m.strip() for m in (modes.split(",") if isinstance(modes, str) else modes)]
    names = [m for m in names if m]
    bad = [m for m in names if m not in COMPILED]
    if bad or not names:
        raise UserError(f"compile modes {','.join(names) or '(none)'!s}: each must be one of"
                        f" {', '.join(COMPILED)}")
    return tuple(m for m in COMPILED if m in names)


# Dynamo keeps compiled variants per code object, shared by every model in the
# process: one size compiles the same ``Transformer.forward`` (and, after MoE's graph
# breaks, ``_aux_losses`` as a frame of its own) for six models, again at each thread
# count (a guard of the compile). The default limit of 8 then sends some models back
# to eager in the middle of the bench; a trainer compiles one model and never nears it.
RECOMPILE_LIMIT = 64


def reset() -> None:
    """Forget every compiled graph (between sizes) and let one process hold every
    model's variants (:data:`RECOMPILE_LIMIT`); nothing if dynamo is unavailable."""
    try:
        import torch._dynamo as dynamo
    except ImportError:
        return
    dynamo.reset()
    dynamo.config.recompile_limit = max(dynamo.config.recompile_limit, RECOMPILE_LIMIT)


def faster_mode(medians: dict[str, float]) -> str:
    """The mode with the lowest median step time (the earlier of :data:`MODES` on a tie)."""
    return min(MODES, key=lambda m: (medians.get(m, float("inf")), MODES.index(m)))
