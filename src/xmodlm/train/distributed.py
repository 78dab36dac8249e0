"""Parallelism for the trainer, applied from outside the model: joining the process
group, DDP or FSDP2 wrapping, compilation, and the sharded (gathered, by-name)
checkpoint state.

When ``WORLD_SIZE > 1`` (as set by ``torchrun``) the model is wrapped in DDP (gloo
on CPU, NCCL on GPU), or sharded with FSDP2 when ``train.fsdp`` is set. Sharded
checkpoints hold full (gathered) weights, so any process can load them, and the
optimiser state keyed by parameter name. Kept apart from the loop
(:mod:`xmodlm.train.trainer`) because none of it depends on what a step does.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from xmodlm.config import Config
from xmodlm.errors import UserError
from xmodlm.model import Transformer


@dataclass
class Dist:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def setup_distributed(device_name: str) -> Dist:
    """Join the process group when launched by torchrun (WORLD_SIZE > 1)."""
    world = _env_rank("WORLD_SIZE", "1", low=1)
    if world <= 1:
        for name in ("RANK", "LOCAL_RANK"):  # half a launcher's environment
            if _env_rank(name, "0") != 0:
                raise UserError(
                    f"{name}={os.environ[name].strip()} but WORLD_SIZE is"
                    f" {os.environ.get('WORLD_SIZE', 'not set')}: launch with torchrun, which"
                    f" sets both (or unset {name} to train in one process)"
                )
        return Dist()
    if "RANK" not in os.environ:
        raise UserError(
            f"WORLD_SIZE={world} but RANK is not set: launch with torchrun, which sets both"
            " (or unset WORLD_SIZE to train in one process)"
        )
    rank, local = _env_rank("RANK", "0", high=world - 1), _env_rank("LOCAL_RANK", "0")
    if not dist.is_initialized():
        use_nccl = torch.cuda.is_available() and device_name != "cpu"
        if use_nccl:
            torch.cuda.set_device(local)
        dist.init_process_group(backend="nccl" if use_nccl else "gloo")
    return Dist(rank, world, local)


def _env_rank(name: str, default: str, low: int = 0, high: int | None = None) -> int:
    """An integer the launcher put in the environment, checked (a typo there would
    otherwise surface as a ValueError from deep in the start of training)."""
    text = os.environ.get(name, default).strip()
    if not re.fullmatch(r"\d+", text) or int(text) < low or (high is not None and int(text) > high):
        bound = f"{low}..{high}" if high is not None else f">= {low}"
        raise UserError(f"environment variable {name}={text!r}: must be an integer {bound}")
    return int(text)


def shard(model: Transformer) -> None:
    """FSDP2, in place: each block is one unit (gathered for its forward, resharded
    after), the root holds the embedding, tied head and final norm."""
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)


def wrap(model: Transformer, cfg: Config, ddp: Dist, device: torch.device) -> nn.Module:
    """Apply data parallelism (unless already sharded) and compilation from outside the model."""
    wrapped: nn.Module = model
    if ddp.world_size > 1 and not cfg.train.fsdp:  # FSDP2: sharded by shard already
        from torch.nn.parallel import DistributedDataParallel

        wrapped = DistributedDataParallel(
            model,
            device_ids=[device.index] if device.type == "cuda" else None,
            # MoE experts may receive no token in a step
            find_unused_parameters="E" in model.layout,
        )
    if compiles(cfg, device):
        wrapped = torch.compile(wrapped)
    return wrapped


def unwrap(model: nn.Module) -> nn.Module:
    """The model inside :func:`wrap`'s wrappers (``torch.compile``, then DDP)."""
    from torch.nn.parallel import DistributedDataParallel

    model = getattr(model, "_orig_mod", model)
    return model.module if isinstance(model, DistributedDataParallel) else model


def compiles(cfg: Config, device: torch.device) -> bool:
    """Whether training compiles the model: ``train.compile=on``, or ``auto`` on a GPU."""
    mode = cfg.train.compile
    return mode == "on" or (mode == "auto" and device.type == "cuda")


def sharded_loader(model: nn.Module) -> Callable[[dict[str, torch.Tensor]], Any]:
    """Every rank holds the full weights (read from the file); each keeps its shard."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    def load(weights: dict[str, torch.Tensor]) -> Any:
        return set_model_state_dict(
            model, weights, options=StateDictOptions(full_state_dict=True, strict=True)
        )

    return load


def gather_full_state(model: nn.Module, opt: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """A sharded model's full weights and its optimiser state keyed by parameter name,
    on the CPU (every rank must call it: the gathers are collective). ``opt`` is an
    optimiser or an iterable of them (:class:`xmodlm.train.optim.MuonAdamW`)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=full), get_optimizer_state_dict(
        model, opt, options=full
    )


def load_optimizer(model: nn.Module, opt: Any, saved: dict[str, Any], sharded: bool) -> None:
    """Optimiser state: by parameter index (one process, DDP) or by name (FSDP2, full).

    The two layouts are not interchangeable; a run resumes with the parallelism
    it was saved with.
    """
    by_name = any(isinstance(k, str) for k in saved.get("state", {}))
    if by_name != sharded:
        raise UserError(
            f"optimizer state was saved {'with' if by_name else 'without'} train.fsdp:"
            f" resume with train.fsdp={str(by_name).lower()}"
        )
    if not sharded:
        opt.load_state_dict(saved)
        return
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_optimizer_state_dict,
    )

    set_optimizer_state_dict(
        model, opt, saved, options=StateDictOptions(full_state_dict=True)
    )
