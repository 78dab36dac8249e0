"""The training loop: one process or many (``torchrun``), CPU or GPU, resumable.

``train(cfg, run_dir)`` is the whole contract of ``xmod train``: it writes the
resolved config, an environment record, ``metrics.jsonl``, atomic checkpoints
and, on success, ``summary.json``. Calling it again on the same directory
resumes from the newest checkpoint that loads. Batches are a pure function of
(seed, step), so a resumed run continues exactly as an uninterrupted one would.

Distributed (``torchrun``): each rank reads its slice of the global batch; only
rank 0 writes; the wrapping (DDP, FSDP2, compilation) and the sharded checkpoint
state live in :mod:`xmodlm.train.distributed`.

The loop, its training step (which the bench times too) and the run-directory,
restore and checkpoint helpers only the loop calls share the run's state (ranks,
the wrapped model, the optimiser); reading a finished run lives in
:mod:`xmodlm.runs`.
"""

from __future__ import annotations

import contextlib
import math
import shutil
import signal
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from xmodlm import flops, runs
from xmodlm.budget import Budget, resolve_budget
from xmodlm.config import RESUME_FREE, Config, load_config
from xmodlm.data.batches import (
    check_tokenizer,
    get_batch,
    load_manifest,
    load_split,
    val_batches,
)
from xmodlm.errors import UserError
from xmodlm.eval.calibrate import calibration_windows
from xmodlm.eval.loss import evaluate
from xmodlm.fileio import atomic_write_json, atomic_write_text
from xmodlm.hardware import (
    autocast_context,
    environment_record,
    matmul_peak_gflops,
    resolve_device,
    resolve_dtype,
    retain_freed_memory,
)
from xmodlm.info import check_memory
from xmodlm.model import Transformer
from xmodlm.record import config_row
from xmodlm.train import checkpoint as ckpt_io
from xmodlm.train.distributed import (
    Dist,
    compiles,
    gather_full_state,
    load_optimizer,
    setup_distributed,
    shard,
    sharded_loader,
    unwrap,
    wrap,
)
from xmodlm.train.lock import run_lock
from xmodlm.train.loggers import MetricLogger, check_trackers
from xmodlm.train.optim import MuonAdamW, build_optimizer, clip_and_step, set_lr


@dataclass
class TrainState:
    step: int = 0  # optimiser steps completed
    tokens: int = 0
    bad_steps: int = 0  # consecutive non-finite losses
    skipped_steps: int = 0  # all non-finite losses
    wall_s: float = 0.0  # across resumes
    last_eval: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


class _StopFlag:
    """SIGINT/SIGTERM set a flag; the loop checkpoints and exits at the next step."""

    def __init__(self) -> None:
        self.signum: int | None = None

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        import threading

        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}

        def handler(signum: int, frame: Any) -> None:
            self.signum = signum

        for s in previous:
            signal.signal(s, handler)
        try:
            yield
        finally:
            for s, h in previous.items():
                signal.signal(s, h)


def _changed_train_settings(old: Config, new: Config) -> list[str]:
    """``key: old -> new`` for each train setting (outside RESUME_FREE) that differs."""
    out = []
    for key, value in new.train.__dict__.items():
        before = getattr(old.train, key, None)
        if key not in RESUME_FREE and before != value:
            out.append(f"train.{key}: {before!r} -> {value!r}")
    return out


def _prepare_run_dir(
    cfg: Config, run: Path, is_main: bool, force: bool = False, restart: bool = False
) -> None:
    """Write (or check) the resolved config; a run directory belongs to one model.

    Resuming with other train settings (budget, schedule, batch, seed...) would
    silently train something else than either config says: refused unless ``force``
    (or ``restart``, which starts over).
    """
    path = run / "config.yaml"
    if path.is_file():
        old = load_config(path)
        if old.model != cfg.model or old.data != cfg.data:
            raise UserError(
                f"run directory {str(run)!r} holds a run with a different model or data config:"
                " resume with the same config or choose a new --out"
            )
        changed = _changed_train_settings(old, cfg)
        if changed and not (force or restart) and runs.checkpoint_dirs(run):
            raise UserError(
                f"run directory {str(run)!r} was trained with other train settings"
                f" ({'; '.join(changed)}): resume with the same settings, or pass --force"
                " to continue with the new ones (--restart to start over)"
            )
    if is_main:
        run.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, cfg.to_yaml())


def _check_vocab(cfg: Config, manifest: dict[str, Any]) -> None:
    """The model's vocabulary is the corpus's, and the corpus's tokenizer is the one its
    tokens were made with. A larger model vocabulary would train rows no token ever
    selects and a run that no longer matches its tokenizer; a smaller one fails on the
    first token beyond it. (``xmod train`` takes the corpus's when the config leaves it
    unset: :func:`xmodlm.config.load_config`.)"""
    data_dir = Path(cfg.data.dir)
    vocab = manifest["vocab_size"]
    if vocab != cfg.model.vocab_size:
        raise UserError(
            f"model.vocab_size={cfg.model.vocab_size} is not the vocabulary of {vocab} tokens"
            f" of the corpus {str(data_dir)!r} (its tokenizer): set model.vocab_size={vocab},"
            " or leave it unset in the config to take the corpus's"
        )
    check_tokenizer(data_dir / "tokenizer.json", manifest, data_dir)


def _writer_lock(run: Path, is_main: bool) -> contextlib.AbstractContextManager[Any]:
    """Rank 0 holds the run directory's lock; other ranks write nothing."""
    if not is_main:
        return contextlib.nullcontext()
    return run_lock(run, note=lambda msg: print(msg, file=sys.stderr))


def _clear_run(run: Path, restart: bool) -> None:
    """Under the lock: remove checkpoints abandoned by a killed writer; on ``restart``,
    everything a previous attempt left (checkpoints, metrics, summary)."""
    for tmp in ckpt_io.clean_abandoned(run):
        print(f"removed {tmp}, a checkpoint whose writer was stopped mid-write", file=sys.stderr)
    if restart:
        shutil.rmtree(run / runs.CKPT_DIR, ignore_errors=True)
        for name in ("metrics.jsonl", "summary.json"):
            (run / name).unlink(missing_ok=True)


def _restore(
    run: Path,
    model: nn.Module,
    opt: torch.optim.Optimizer | MuonAdamW,
    log: Callable[[str], None],
    sharded: bool = False,
    restart: bool = False,
) -> TrainState | None:
    """Load the newest checkpoint that loads; name and skip any that do not.

    None when the run has no checkpoint. When it has some and none loads, training
    from step 0 would silently throw the run away: that is a UserError unless
    ``restart``.
    """
    ckpts = runs.checkpoint_dirs(run)
    first_error = None
    for left, ckpt in reversed(list(enumerate(ckpts))):
        try:
            runs.load_model_weights(
                ckpt, model, load=sharded_loader(model) if sharded else None
            )
            state = ckpt_io.load_state(ckpt)
            load_optimizer(model, opt, state["optimizer"], sharded)
        except (UserError, KeyError, ValueError) as err:
            if left:  # the last failure is the error below, not a note
                log(f"checkpoint {ckpt} is unusable ({err}); trying the previous one")
            first_error = first_error or f"{ckpt.name}: {err}"
            continue
        torch.set_rng_state(state["rng_cpu"])
        if torch.cuda.is_available() and state.get("rng_cuda") is not None:
            torch.cuda.set_rng_state_all(state["rng_cuda"])
        log(f"resumed from {ckpt}")
        return TrainState(**state["train_state"])
    if ckpts and not restart:
        raise UserError(
            f"run directory {str(run)!r}: none of its {len(ckpts)} checkpoint(s) loads"
            f" ({first_error}): rerun with --restart to train it from step 0"
        )
    return None


def train(
    cfg: Config,
    run_dir: str | Path,
    progress: bool = True,
    on_step: Callable[[int, dict[str, Any]], None] | None = None,
    restart: bool = False,
    force: bool = False,
) -> dict[str, Any]:
    """Train ``cfg`` into ``run_dir`` (resuming if it holds checkpoints).

    Returns the summary (``status`` is ``ok``, ``diverged`` or ``interrupted``).
    ``on_step(step, record)`` is called after every optimiser step. The run
    directory is locked for the whole run (one writer; see :mod:`xmodlm.train.lock`).
    If the run has checkpoints and none of them loads, this stops with a
    :class:`UserError` unless ``restart``; ``restart`` discards the run's
    checkpoints, metrics and summary and trains from step 0. Resuming with changed
    train settings (say ``max_steps``) is refused unless ``force``. With ``progress``
    one line on stderr echoes the configuration before the first step.

    Long on purpose: it is the run in order (checks, run directory, restore, the
    model's wrapping, the step loop with its logging, evaluation, checkpoints and
    stop signal, the summary), and the loop reads a dozen values the setup made;
    cut apart, they would travel as one large state object.
    """
    cfg.validate()
    check_trackers(cfg)
    run = Path(run_dir)
    t = cfg.train
    device = resolve_device(t.device)
    ddp = setup_distributed(t.device)
    if device.type == "cuda":
        device = torch.device("cuda", ddp.local_rank)
    check_memory(cfg.model, device, "train")  # a mistyped size: refused before allocation
    # on CPU, keep freed activations for the next step instead of page-faulting them in
    allocator = retain_freed_memory() if device.type == "cpu" else "CUDA caching allocator"
    budget = resolve_budget(cfg, ddp.world_size)
    manifest = load_manifest(cfg.data.dir)
    _check_vocab(cfg, manifest)
    train_data = load_split(cfg.data.dir, "train")
    val_data = load_split(cfg.data.dir, "val")
    train_data.check_context(cfg.model.context)
    fixed_val = val_batches(val_data, cfg.data.val_batches, t.batch_size, cfg.model.context)
    # every evaluation first calibrates the causal thresholds on training text
    calibration = None
    if "s" in cfg.model.block_layout and cfg.model.causal_threshold == "calibrated":
        calibration = calibration_windows(train_data, cfg.model.context)

    # one writer per run directory: a second `xmod train` on it is refused
    with _writer_lock(run, ddp.is_main):
        _prepare_run_dir(cfg, run, ddp.is_main, force=force, restart=restart)
        if not restart:
            ckpt_io.check_finished_run_resumable(run)
        if ddp.is_main:
            _clear_run(run, restart)
        env = environment_record()  # the code this start runs (a sweep may outlive a commit)
        logger = MetricLogger(run, cfg, enabled=ddp.is_main, progress=progress)
        if ddp.is_main:
            tok = Path(cfg.data.dir) / "tokenizer.json"
            if not restart:  # a resumed run goes on with the tokenizer it began with
                check_tokenizer(run / "tokenizer.json", manifest, cfg.data.dir)
            if tok.is_file():
                shutil.copyfile(tok, run / "tokenizer.json")
            atomic_write_json(run / "env.json", {**env, "allocator": allocator})

        torch.manual_seed(t.seed)
        model = Transformer(cfg.model).to(device)
        sharded = ddp.world_size > 1 and t.fsdp
        if sharded:
            shard(model)  # before the optimiser: FSDP2 replaces the parameters
        dtype = resolve_dtype(t.dtype, device)
        # Muon's Newton-Schulz in the run's precision: bf16 runs fast, fp32 runs exact
        opt = build_optimizer(model, t, torch.float32 if dtype == "fp32" else torch.bfloat16)
        state = _restore(run, model, opt, logger.note, sharded, restart) or TrainState()
        logger.truncate_after(state.step)
        wrapped = wrap(model, cfg, ddp, device)
        counts = flops.count(cfg.model)
        peak = matmul_peak_gflops(dtype, device.type) * 1e9 * ddp.world_size
        if progress:
            logger.note(_echo(cfg, counts, budget, device, dtype, ddp, state.step, run))
        stop = _StopFlag()
        logger.start(budget.total_steps, state.step)
        if state.step == 0 and (ddp.is_main or sharded):
            # the model as initialised, measured like every later evaluation: its
            # loss (about ln V), the residual stream per block and the routing, under
            # the code this run trains with (a report rebuilding the initial model
            # later would use the code checked out then). No RNG is drawn.
            logger.log({"step": 0, "tokens": 0, "kind": "eval",
                        **evaluate(model, fixed_val, device, dtype, manifest,
                                   calibration=calibration)})
        status = "ok"
        t_run = time.perf_counter() - state.wall_s
        with stop.installed():
            while state.step < budget.total_steps:
                t0 = time.perf_counter()
                lr = set_lr(opt, state.step, budget.total_steps, t)
                record = _train_step(wrapped, opt, train_data, cfg, budget, state.step, ddp, device)
                finite = math.isfinite(record["loss"])
                if finite:
                    state.bad_steps = 0
                else:
                    state.bad_steps += 1
                    state.skipped_steps += 1
                    logger.note(f"step {state.step}: non-finite loss, step skipped")
                    if state.bad_steps >= t.max_bad_steps:
                        status = "diverged"
                        break
                state.step += 1
                state.tokens += budget.tokens_per_step
                dt = time.perf_counter() - t0
                state.wall_s = time.perf_counter() - t_run
                record.update(
                    step=state.step,
                    tokens=state.tokens,
                    lr=lr,
                    step_s=dt,
                    tokens_per_s=budget.tokens_per_step / dt,
                    mfu=counts.flops_train * budget.tokens_per_step / dt / peak,
                )
                last = state.step == budget.total_steps
                if state.step % t.log_every == 0 or last or not finite:
                    logger.log(record)
                logger.advance(record)
                # a sharded forward is collective: every rank evaluates, rank 0 logs
                if (ddp.is_main or sharded) and (state.step % t.eval_every == 0 or last):
                    state.last_eval = evaluate(
                        model, fixed_val, device, dtype, manifest, calibration=calibration
                    )
                    logger.log({"step": state.step, "tokens": state.tokens, "kind": "eval",
                                **state.last_eval})
                if on_step is not None:
                    on_step(state.step, record)
                if stop.signum is not None:
                    status = "interrupted"
                    break
                if state.step % t.ckpt_every == 0 or last:
                    _save(run, model, opt, state, cfg, ddp, sharded)
        state.wall_s = time.perf_counter() - t_run
        final_loss = state.last_eval.get("val_loss_topk")
        if status == "ok" and final_loss is not None and not math.isfinite(final_loss):
            status = "diverged"  # every step was finite, yet the model no longer is
            logger.note(f"step {state.step}: validation loss is {final_loss}: run diverged")
        if status == "interrupted":
            _save(run, model, opt, state, cfg, ddp, sharded)
            logger.note(f"interrupted at step {state.step}: checkpoint written, rerun to resume")
        logger.close()
        summary = _summary(
            cfg, state, counts, status, budget, len(train_data), env["git_commit"],
            dtype,
        )
        summary.update(cpu_kind=env["cpu_kind"] if device.type == "cpu" else
                       (env.get("cuda") or {}).get("device"),
                       compile="on" if compiles(cfg, device) else "off")
        if ddp.is_main and status != "interrupted":
            atomic_write_json(run / "summary.json", summary)
        return summary


def _echo(
    cfg: Config, counts: flops.Counts, budget: Budget, device: torch.device, dtype: str,
    ddp: Dist, step: int, run: Path,
) -> str:
    """The one-line configuration echo at the start (or resume) of a run."""
    m, t = cfg.model, cfg.train
    start = f"resuming at step {step}" if step else "starting"
    compile_ = t.compile if t.compile != "auto" else f"auto ({'on' if device.type == 'cuda' else 'off'})"
    return (
        f"{cfg.name}: {start} -> {budget.total_steps} steps ({budget.source}),"
        f" layout {m.block_layout} (d {m.d_model}, K {m.depth.sparsity:g}, A {m.depth.anchor_stride:g}, T {m.context}),"
        f" {counts.params_total / 1e6:.3g}M params ({counts.params_active / 1e6:.3g}M active),"
        f" {budget.tokens_per_step} tokens/step, {t.optimizer} lr {t.lr:g} {t.schedule}, seed {t.seed},"
        f" {device} x{ddp.world_size} {dtype}, compile {compile_}, run {run}"
    )


def _train_step(
    model: nn.Module,
    opt: torch.optim.Optimizer | MuonAdamW,
    data: Any,
    cfg: Config,
    budget: Budget,
    step: int,
    ddp: Dist,
    device: torch.device,
) -> dict[str, Any]:
    """One optimiser step of the run (its batch: ``budget``'s): its micro-batches are a
    pure function of (seed, step)."""
    t = cfg.train

    def micro_batch(micro: int) -> tuple[torch.Tensor, torch.Tensor]:
        return get_batch(
            data, budget.batch_size, cfg.model.context, t.seed, step, ddp.rank, ddp.world_size,
            micro, budget.grad_accum,
        )

    return train_step(
        model, opt, micro_batch, budget.grad_accum, dtype=resolve_dtype(t.dtype, device),
        grad_clip=t.grad_clip, device=device, world_size=ddp.world_size,
    )


def train_step(
    model: nn.Module,
    opt: torch.optim.Optimizer | MuonAdamW,
    micro_batch: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
    grad_accum: int,
    *,
    dtype: str,
    grad_clip: float,
    device: torch.device,
    world_size: int = 1,
) -> dict[str, Any]:
    """One optimiser step over ``grad_accum`` micro-batches; returns what to log.

    Public so that ``xmod bench`` times exactly the step training runs.
    ``micro_batch(i)`` gives micro-batch ``i``'s (inputs, targets), fetched when
    needed so that only one is held at a time. ``model(x, y)`` returns a
    :class:`~xmodlm.model.transformer.ModelOutput` (or anything with ``loss``,
    ``total_loss`` and ``aux``); ``dtype`` is a resolved dtype name (``fp32``,
    ``bf16``, ...). With ``world_size > 1`` the logged loss is averaged over ranks.
    """
    loss_sum = torch.zeros((), device=device)
    aux_sums: dict[str, torch.Tensor] = {}
    for micro in range(grad_accum):
        x, y = micro_batch(micro)
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        sync = micro == grad_accum - 1 or not hasattr(model, "no_sync")
        ctx = contextlib.nullcontext() if sync else model.no_sync()
        with ctx:
            with autocast_context(device, dtype):
                out = model(x, y)
            (out.total_loss / grad_accum).backward()
        loss_sum += out.loss.detach() / grad_accum
        for k, v in out.aux.items():
            aux_sums[k] = aux_sums.get(k, 0.0) + v / grad_accum
    if world_size > 1:
        dist.all_reduce(loss_sum, op=dist.ReduceOp.AVG)
    loss = float(loss_sum)
    record: dict[str, Any] = {"loss": loss, **{k: float(v) for k, v in aux_sums.items()}}
    if math.isfinite(loss):
        grad_norm = clip_and_step(opt, list(model.parameters()), grad_clip)
        record["grad_norm"] = grad_norm
        if math.isfinite(grad_norm):
            after_optimizer_step(model)
        else:  # overflowing gradients: skipped like a NaN loss
            record["loss"] = float("nan")
    opt.zero_grad(set_to_none=True)
    return record


def after_optimizer_step(model: nn.Module) -> None:
    """Call the unwrapped model's ``after_optimizer_step()``, if it has one, once after
    every optimiser step that was taken (not after a skipped one).

    The one place where the model may adjust state that is not trained by gradients
    (an MoE's loss-free per-expert bias nudged by the step's expert loads, say) in
    step with the weights. The trainer knows no such state: the model's method
    does the work, on every rank alike.
    """
    hook = getattr(unwrap(model), "after_optimizer_step", None)
    if callable(hook):
        hook()


def _save(
    run: Path,
    model: nn.Module,
    opt: torch.optim.Optimizer | MuonAdamW,
    state: TrainState,
    cfg: Config,
    ddp: Dist,
    sharded: bool = False,
) -> None:
    """Rank 0 writes; a sharded model and optimiser are first gathered by every rank."""
    weights: nn.Module | dict[str, torch.Tensor] = model
    optimizer: dict[str, Any] | None = None
    if sharded:
        weights, optimizer = gather_full_state(model, opt)
    if not ddp.is_main:
        return
    payload = {
        "optimizer": opt.state_dict() if optimizer is None else optimizer,
        "train_state": state.as_dict(),
        "rng_cpu": torch.get_rng_state(),
        "rng_cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }
    meta = {"tokens": state.tokens, "config_name": cfg.name}
    ckpt_io.save_checkpoint(run, state.step, weights, payload, meta, cfg.train.keep_last)


def _summary(
    cfg: Config,
    state: TrainState,
    counts: flops.Counts,
    status: str,
    budget: Budget,
    train_tokens: int,
    commit: str | None,
    dtype: str,
) -> dict[str, Any]:
    ev = state.last_eval
    m, t = cfg.model, cfg.train
    return {
        "status": status,
        "name": cfg.name,
        **config_row(m, counts),
        "final_val_loss": ev.get("val_loss_topk"),
        "final_val_loss_causal": ev.get("val_loss_causal"),
        "val_bpb": ev.get("val_bpb"),
        "val_bpb_causal": ev.get("val_bpb_causal"),
        "routing_agreement": ev.get("routing_agreement"),
        "steps": state.step,
        "tokens": state.tokens,
        "flops": counts.flops_train * state.tokens,
        "seed": t.seed,
        "optimizer": t.optimizer,
        "lr": t.lr,
        "warmup_steps": t.warmup(budget.total_steps),
        "batch_tokens": budget.tokens_per_step,
        "dtype": dtype,
        "epochs": state.tokens / train_tokens,
        "commit": commit,
        "skipped_steps": state.skipped_steps,
        "budget_source": budget.source,
        "wall_s": state.wall_s,
    }
