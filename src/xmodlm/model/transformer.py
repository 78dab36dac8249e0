"""The transformer, built from a layout string (``D`` dense, ``s`` sparse, ``E`` MoE).

Dense, MoD, X-MoD and MoE are all this one class; only the layout and the
block options differ. Auxiliary losses and routing statistics come back in the
:class:`ModelOutput` of each forward call, never through module state.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from xmodlm.config import ModelConfig
from xmodlm.depth import stages
from xmodlm.flops import active_depth, capacity_tokens
from xmodlm.model import routing
from xmodlm.model.blocks import BlockOutput, DenseBlock, RoutedBlock
from xmodlm.model.layers import RMSNorm, Rotary, cross_entropy_fp32, matmul_dtype
from xmodlm.model.moe import MoEMLP, load_imbalance

ROUTING_MODES = ("topk", "causal", "calibrate")


@dataclass
class ModelOutput:
    logits: torch.Tensor  # (B, T, V); detached when targets were given (train on loss)
    loss: torch.Tensor | None = None  # LM cross-entropy (mean over tokens)
    aux_loss: torch.Tensor | None = None  # weighted sum of auxiliary losses
    aux: dict[str, torch.Tensor] = field(default_factory=dict)  # unweighted components
    stats: dict[str, object] = field(default_factory=dict)  # routing statistics

    @property
    def total_loss(self) -> torch.Tensor:
        assert self.loss is not None, "no targets were given"
        return self.loss if self.aux_loss is None else self.loss + self.aux_loss


class Transformer(nn.Module):
    """Pre-norm decoder with rotary positions, SwiGLU (or MoE) and causal SDPA."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.layout = cfg.block_layout
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(self._make_block(letter) for letter in self.layout)
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.head.weight = self.embed.weight
        self.rope = Rotary(cfg.attn_head_dim, cfg.context, cfg.rope_theta)
        self.windows = stages(self.layout)  # the sparse blocks of each stage
        # every auxiliary loss's weight, as declared by the blocks that return it;
        # depth-wise balancing spans a window of blocks, so the stack declares it
        self.aux_weights = {"balance": cfg.cv_coef}
        for block in self.blocks:
            self.aux_weights.update(block.aux_weights)
        self.reset_parameters()

    def _make_block(self, letter: str) -> nn.Module:
        if letter == "s":
            return RoutedBlock(self.cfg)
        return DenseBlock(self.cfg, moe=letter == "E")

    def reset_parameters(self) -> None:
        """Normal(0, init_std) weight matrices, routers included (so top-k is not tied
        at step 0); residual output projections scaled down by sqrt(2 * active-equivalent
        depth); vectors keep their own init (norm gains 1, the predictor's biases 0);
        then the variance-scaled gates are calibrated (:meth:`init_gates_`)."""
        std = self.cfg.init_std
        out_std = std / math.sqrt(2 * max(1.0, active_depth(self.cfg)))
        for name, p in self.named_parameters():
            if p.dim() < 2:
                continue  # norms, gammas, biases keep their own init
            if name.endswith(("attn.proj.weight", "down.weight")):
                nn.init.normal_(p, 0.0, out_std)
            else:
                nn.init.normal_(p, 0.0, std)
        self.init_gates_()

    @torch.no_grad()
    def init_gates_(self, seed: int = 0) -> list[float]:
        """Set the variance-scaled gates' initial gamma; returns the gammas set.

        The rule (docs/architecture.md): at initialisation the residual variance
        the blocks add, averaged over tokens, equals that of a dense model of the
        same active-equivalent depth L_ae. Scaling output projections by L_ae
        alone does not get there: a sparse block's attention averages over k = cT
        keys instead of T, so its branch is larger per processed token, and by how
        much depends on c, T, width and depth. The rule therefore measures, on a
        fixed batch of random tokens, (a) the dense reference: this stack's first
        floor(L_ae) and ceil(L_ae) blocks run on every token with the branch scale
        of a dense model of that depth, interpolated at L_ae; and (b) the stack
        itself as a function of one common gamma, solved for by secant
        (:func:`routing.solve_gamma`). Deterministic given the weights (no global
        RNG is used); a few forward passes. Where every sparse block takes every
        token (k = T) the gate is neutral (gamma = 2, g = 1): exactly dense.
        """
        routed = [b for b in self.blocks if isinstance(b, RoutedBlock) and b.gamma is not None]
        if not routed:
            return []
        T = self.cfg.context
        if capacity_tokens(self.cfg.depth.capacity, T) == T:
            gamma = routing.NEUTRAL_GAMMA
        else:
            param = next(self.parameters())
            batch = max(1, min(8, -(-2048 // T)))
            gen = torch.Generator().manual_seed(seed)
            idx_BT = torch.randint(0, self.cfg.vocab_size, (batch, T), generator=gen)
            with torch.autocast(device_type=param.device.type, enabled=False):
                gamma = self._solve_gate_scale(idx_BT.to(param.device), routed)
        for block in routed:
            block.gamma.fill_(gamma)
        return [gamma] * len(routed)

    def _solve_gate_scale(self, idx_BT: torch.Tensor, routed: list[RoutedBlock]) -> float:
        T = idx_BT.shape[1]
        pos_T = torch.arange(T, device=idx_BT.device)
        cos, sin = self.rope(pos_T)
        x0_BTD = self.embed(idx_BT).float()
        l_ae = active_depth(self.cfg)

        def dense_variance(n: int) -> float:
            # a dense stack of n blocks: out-projection std init_std / sqrt(2 n),
            # i.e. this stack's blocks (scaled for L_ae) times sqrt(L_ae / n)
            x_BTD = x0_BTD
            for block in list(self.blocks)[:n]:
                f_BTD, _ = block.block.branch(x_BTD, cos, sin)
                x_BTD = x_BTD + math.sqrt(l_ae / n) * f_BTD
            return float((x_BTD - x0_BTD).pow(2).mean())

        def stack_variance(gamma: float) -> float:
            for block in routed:
                block.gamma.fill_(gamma)
            x_BTD, _ = self.run_blocks(x0_BTD, pos_T, "topk", (cos, sin))
            return float((x_BTD - x0_BTD).pow(2).mean())

        n_hi = min(len(self.blocks), math.ceil(l_ae))
        lo = max(0, n_hi - 1)
        by_depth = [0.0] * (n_hi + 1)
        for n in {lo, n_hi} - {0}:
            by_depth[n] = dense_variance(n)
        target = routing.interpolate_depth(by_depth, min(l_ae, n_hi))
        return routing.solve_gamma(stack_variance, target)

    def run_blocks(
        self,
        x_BTD: torch.Tensor,
        pos_T: torch.Tensor,
        mode: str,
        rot: tuple[torch.Tensor, torch.Tensor],
        each: Callable[[torch.Tensor], None] | None = None,
    ) -> tuple[torch.Tensor, list[BlockOutput]]:
        """Every block in turn on the stream: returns the stream after the last and
        each block's output, calling ``each`` on the stream after every block. Carries
        the token-choice bias through each stage (:class:`routing.TokenBias`): the one
        loop every full-sequence pass runs. A plain loop, not a generator, so that
        ``torch.compile`` can resume it after a block's graph break (MoE dispatch)."""
        bias = routing.TokenBias(self.cfg.token_bias, self.cfg.token_bias_step)
        outs: list[BlockOutput] = []
        for block in self.blocks:
            if isinstance(block, RoutedBlock):
                x_BTD, out = block(x_BTD, self.rope, pos_T, mode, rot, bias.shift())
                bias.selected(out.processed_BT)
            else:
                x_BTD, out = block(x_BTD, self.rope, pos_T, mode, rot)
                bias.reset()
            outs.append(out)
            if each is not None:
                each(x_BTD)
        return x_BTD, outs

    def routed_blocks(self) -> list[RoutedBlock]:
        return [b for b in self.blocks if isinstance(b, RoutedBlock)]

    @torch.no_grad()
    def calibrate_thresholds_(self, idx_NT: torch.Tensor) -> list[float]:
        """Set every sparse block's causal threshold to route the fraction k / T it
        was trained at, on the windows ``idx_NT``; returns the thresholds.

        One forward pass in ``calibrate`` mode: block by block in depth order, each
        sparse block fits its threshold to its decision logits over all the
        windows, then routes by it (on its routed tokens only,
        :meth:`RoutedBlock.ragged_forward`), so each threshold is fitted to the
        stream that block meets at inference, behind the calibrated blocks before
        it. Through ``forward``, so a sharded model gathers as usual.
        """
        self(idx_NT, routing_mode="calibrate")
        return [float(b.router.threshold) for b in self.routed_blocks()]

    def threshold_rule(self) -> str:
        """The causal threshold rule in effect: ``calibrated``, ``half``, or
        ``half (not calibrated)`` for a calibrated-rule model whose thresholds were
        never set (an earlier checkpoint, or calibration has not run yet)."""
        if self.cfg.causal_threshold == "half":
            return "half"
        routed = self.routed_blocks()
        if routed and not all(b.router.is_calibrated() for b in routed):
            return "half (not calibrated)"
        return "calibrated"

    @contextlib.contextmanager
    def using_threshold_rule(self, rule: str) -> Iterator[None]:
        """Route causally under ``rule`` (``half`` or ``calibrated``) for a while, as
        evaluation does to report both."""
        routed = self.routed_blocks()
        before = [b.router.rule for b in routed]
        for b in routed:
            b.router.rule = rule
        try:
            yield
        finally:
            for b, rule_before in zip(routed, before, strict=True):
                b.router.rule = rule_before

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(
        self,
        idx_BT: torch.Tensor,
        targets_BT: torch.Tensor | None = None,
        routing_mode: str = "topk",
        return_stats: bool = False,
    ) -> ModelOutput:
        """Run the stack. ``routing_mode``: ``topk`` (training), ``causal`` (inference),
        or ``calibrate`` (:meth:`calibrate_thresholds_`; no logits are computed)."""
        assert routing_mode in ROUTING_MODES, routing_mode
        T = idx_BT.shape[1]
        assert T <= self.cfg.context, f"sequence length {T} exceeds context {self.cfg.context}"
        pos_T = torch.arange(T, device=idx_BT.device)
        x_BTD = self.embed(idx_BT)
        # rotary tables once per forward, already in the dtype attention runs in
        rot = self.rope(pos_T, matmul_dtype(x_BTD))
        rms: list[float] = []

        def residual_rms(x_BTD: torch.Tensor) -> None:
            rms.append(float(x_BTD.detach().float().pow(2).mean(-1).sqrt().mean()))

        x_BTD, outs = self.run_blocks(x_BTD, pos_T, routing_mode, rot,
                                      residual_rms if return_stats else None)
        if routing_mode == "calibrate":  # the thresholds are set: no (N, T, V) logits
            return ModelOutput(logits=x_BTD.new_empty(0))
        logits = self.head(self.norm(x_BTD, matmul_dtype(x_BTD)))
        result = ModelOutput(logits=logits)
        if targets_BT is not None:
            result.loss = cross_entropy_fp32(
                logits.view(-1, logits.shape[-1]), targets_BT.reshape(-1)
            )
            # with targets the loss is the path to train on; logits handed back beside
            # it carry no graph, or a compiled step zero-fills a (B, T, V) gradient for
            # them every step (AOTAutograd's tangent of an output nobody backpropagates)
            result.logits = logits.detach()
            result.aux, result.aux_loss = self._aux_losses(outs)
        if return_stats:
            result.stats = {"residual_rms": rms, **self._stats(outs)}
        return result

    def _aux_losses(
        self, outs: list[BlockOutput]
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
        cfg = self.cfg
        grouped: dict[str, list[torch.Tensor]] = {}
        for out in outs:
            for key, value in out.aux.items():
                grouped.setdefault(key, []).append(value)
        aux = {key: torch.stack(vals).mean() for key, vals in grouped.items()}
        sparse = [o for o in outs if o.r_BT is not None]
        if cfg.cv_coef > 0 and sparse and self.windows:
            probs = [torch.sigmoid(o.r_BT) for o in sparse]
            aux["balance"] = routing.balance_loss(
                [torch.stack([probs[i] for i in w], dim=-1) for w in self.windows]
            )
        undeclared = set(aux) - set(self.aux_weights)
        assert not undeclared, f"auxiliary losses without a declared weight: {undeclared}"
        terms = [self.aux_weights[k] * v for k, v in aux.items() if self.aux_weights[k] > 0]
        total = torch.stack(terms).sum() if terms else None
        return {k: v.detach() for k, v in aux.items()}, total

    def _stats(self, outs: list[BlockOutput]) -> dict[str, object]:
        stats: dict[str, object] = {}
        loads = [o.expert_load_E for o in outs if o.expert_load_E is not None]
        if loads:  # per MoE layer, in depth order
            stats["expert_load_max_over_mean"] = [load_imbalance(c) for c in loads]
        sparse = [o for o in outs if o.r_BT is not None]
        if not sparse:
            return stats
        topk = [o.topk_BT for o in sparse]
        return stats | routing.routing_stats(
            selections=[o.processed_BT for o in sparse],
            windows=self.windows,
            causal=[o.causal_BT for o in sparse],
            topk=topk if all(t is not None for t in topk) else None,
        )

    @torch.no_grad()
    def after_optimizer_step(self) -> None:
        """What the model does once per optimiser step, after it: each MoE layer's
        loss-free balancing step (:meth:`MoEMLP.after_optimizer_step`)."""
        for module in self.modules():
            if isinstance(module, MoEMLP):
                module.after_optimizer_step()
