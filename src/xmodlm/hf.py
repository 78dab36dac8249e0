"""Hugging Face ``transformers`` wrapper of an exported X-MoD model (the ``hf`` extra).

``xmod export RUN --out DIR`` copies this file into DIR as ``modeling_xmod.py`` and
names its classes in ``config.json`` (``auto_map``), so that, offline::

    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)
    tok = AutoTokenizer.from_pretrained(DIR)
    out = model.generate(**tok("The whale", return_tensors="pt"), max_new_tokens=20,
                         do_sample=False)

The copy imports ``xmodlm`` (``pip install 'xmod-lm[hf]'``): the network is
X-MoD's own :class:`xmodlm.model.Transformer`, loaded by
:func:`xmodlm.load_pretrained` from ``model.safetensors`` (no pickles).

**Routing.** The wrapper runs X-MoD's *causal* routing (``routing_mode="causal"``),
the decision decoding uses: a sparse block processes a token iff its router says
so from that token alone (its decision logit above the block's calibrated
threshold, :mod:`xmodlm.model.depth_router`), never by top-k over the sequence, which would look at future tokens. Logits at position
t therefore depend only on tokens up to t, and greedy ``generate`` gives the
tokens ``xmod generate --temperature 0`` gives. Set ``config.routing_mode =
"topk"`` to score whole sequences with training-time routing instead (not causal:
do not generate with it).

Limits: no KV cache here (each generation step reruns the prefix; use
``xmod generate`` or :func:`xmodlm.model.generate.generate` for the sparse KV
cache), no padding (``attention_mask`` must be all ones: one prompt per call, or
prompts of one length), at most ``max_position_embeddings`` tokens. Logits of ids
past the tokenizer's vocabulary (a model vocabulary padded beyond it) are -inf, as
``xmod generate`` never samples them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from transformers import GenerationConfig, GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

import xmodlm
from xmodlm.config import Config
from xmodlm.model import Transformer


class XModConfig(PretrainedConfig):
    """``config.json`` of an export: ``xmod`` holds the resolved X-MoD model config."""

    model_type = "xmod"

    def __init__(
        self,
        xmod: dict[str, Any] | None = None,
        routing_mode: str = "causal",
        tokenizer_vocab_size: int | None = None,
        **kwargs: Any,
    ) -> None:
        self.xmod = dict(xmod or {})
        self.routing_mode = routing_mode
        self.tokenizer_vocab_size = tokenizer_vocab_size
        kwargs.setdefault("use_cache", False)
        super().__init__(**kwargs)

    def model_config(self) -> Any:
        """The :class:`xmodlm.config.ModelConfig` (validated)."""
        return Config.from_dict({"model": self.xmod}, where="").validate().model


class XModForCausalLM(PreTrainedModel, GenerationMixin):
    """An X-MoD :class:`~xmodlm.model.Transformer` behind the ``transformers`` causal-LM API.

    Runs X-MoD's causal routing (see the module docstring); ``forward`` returns
    ``logits`` (B, T, V) and, with ``labels``, the next-token cross-entropy
    (labels are shifted inside, -100 ignored).
    """

    config_class = XModConfig
    base_model_prefix = "xmod"
    main_input_name = "input_ids"
    supports_gradient_checkpointing = False
    _no_split_modules: list[str] = []

    def __init__(self, config: XModConfig) -> None:
        super().__init__(config)
        self.xmod = Transformer(config.model_config())
        self.post_init()

    def _init_weights(self, module: torch.nn.Module) -> None:
        """The X-MoD model initialises itself; loading replaces the weights anyway."""

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.xmod.embed

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.xmod.head

    @classmethod
    def from_pretrained(
        cls, pretrained_model_name_or_path: str | Path, *args: Any, **kwargs: Any
    ) -> XModForCausalLM:
        """Load an ``xmod export`` directory (or a training run directory) through
        :func:`xmodlm.load_pretrained`; ``dtype``/``torch_dtype`` and a one-device
        ``device_map`` are honoured, other loading options do not apply."""
        path = Path(pretrained_model_name_or_path)
        config = kwargs.get("config")
        if not isinstance(config, PretrainedConfig):
            config = cls.config_class.from_pretrained(path)
        net, _ = xmodlm.load_pretrained(path)
        model = cls(config)
        model.xmod = net  # after post_init: nothing re-initialises the loaded weights
        gen_file = path / "generation_config.json"
        if gen_file.is_file():
            model.generation_config = GenerationConfig.from_pretrained(path)
        dtype = kwargs.get("dtype", kwargs.get("torch_dtype"))
        if isinstance(dtype, str) and dtype != "auto":
            dtype = getattr(torch, dtype)
        if isinstance(dtype, torch.dtype):
            model = model.to(dtype)
        device = kwargs.get("device_map")
        if isinstance(device, (str, torch.device)) and str(device) != "auto":
            model = model.to(device)
        return model.eval()

    def forward(
        self,
        input_ids: torch.LongTensor,
        attention_mask: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        **kwargs: Any,
    ) -> CausalLMOutputWithPast:
        if attention_mask is not None and not bool(attention_mask.bool().all()):
            raise ValueError(
                "XModForCausalLM does not support padding (attention_mask has zeros):"
                " pass one prompt at a time, or prompts of one length"
            )
        context = self.xmod.cfg.context
        if input_ids.shape[1] > context:
            raise ValueError(
                f"{input_ids.shape[1]} tokens exceed the model's context of {context}"
                " (max_position_embeddings): shorten the prompt or max_new_tokens"
            )
        out = self.xmod(input_ids, routing_mode=self.config.routing_mode)
        logits = out.logits.float()
        limit = self.config.tokenizer_vocab_size
        if limit is not None and limit < logits.shape[-1]:
            logits[..., limit:] = float("-inf")
        loss = None
        if labels is not None:
            loss = F.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]).clamp_min(-1e4),
                labels[:, 1:].reshape(-1),
                ignore_index=-100,
            )
        return CausalLMOutputWithPast(loss=loss, logits=logits)

    def prepare_inputs_for_generation(
        self, input_ids: torch.LongTensor, attention_mask: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> dict[str, Any]:
        """No cache: every step feeds the whole sequence (causal routing makes that exact)."""
        return {"input_ids": input_ids, "attention_mask": attention_mask}
