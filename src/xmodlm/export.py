"""A model that leaves the project: ``xmod export`` and :func:`load_pretrained`.

An exported directory is self-contained and holds no pickles::

    model.safetensors       the weights (tied embeddings stored as two tensors)
    config.json             the resolved model config (key ``xmod``), what a loader
                            needs (tokenizer vocabulary, end-of-text id, context) and
                            the Hugging Face fields (``model_type``, ``auto_map``)
    tokenizer.json          the run's byte-level BPE tokenizer
    tokenizer_config.json   so ``transformers.AutoTokenizer`` reads it too
    generation_config.json  end-of-text id, greedy, no cache
    modeling_xmod.py        the ``transformers`` wrapper (a copy of :mod:`xmodlm.hf`),
                            for ``AutoModelForCausalLM.from_pretrained(DIR,
                            trust_remote_code=True)``; it imports ``xmodlm``

:func:`load_pretrained` reads either an exported directory or a training run
directory, through the same safetensors loader the trainer uses
(:func:`xmodlm.train.checkpoint.load_model_weights`); nothing on the load path
unpickles.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from importlib import resources
from pathlib import Path
from typing import Any

import torch

from xmodlm.config import Config, ModelConfig
from xmodlm.data.tokenizer import EOT, Tokenizer
from xmodlm.errors import UserError

FORMAT = "xmodlm-export"
FORMAT_VERSION = 1
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
TOKENIZER_FILE = "tokenizer.json"
MODELING_FILE = "modeling_xmod.py"
AUTO_MAP = {
    "AutoConfig": "modeling_xmod.XModConfig",
    "AutoModelForCausalLM": "modeling_xmod.XModForCausalLM",
}


def is_exported(path: str | Path) -> bool:
    """True for a directory written by :func:`export_run` (config.json of our format)."""
    cfg = Path(path) / CONFIG_FILE
    if not cfg.is_file():
        return False
    try:
        return json.loads(cfg.read_text(encoding="utf-8")).get("format") == FORMAT
    except (ValueError, UnicodeDecodeError, AttributeError):
        return False


def export_config(cfg: Config, tokenizer: Tokenizer, source: dict[str, Any]) -> dict[str, Any]:
    """The ``config.json`` of an export: Hugging Face fields plus ``xmod`` (the model config)."""
    from xmodlm import __version__

    m = cfg.model
    return {
        "model_type": "xmod",
        "architectures": ["XModForCausalLM"],
        "auto_map": dict(AUTO_MAP),
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "xmodlm_version": __version__,
        "xmod": dataclasses.asdict(m),
        "routing_mode": "causal",
        "vocab_size": m.vocab_size,
        "tokenizer_vocab_size": tokenizer.vocab_size,
        "hidden_size": m.d_model,
        "num_hidden_layers": m.n_layers,
        "num_attention_heads": m.n_heads,
        "max_position_embeddings": m.context,
        "layout": m.block_layout,
        "eos_token_id": tokenizer.eot_id,
        "bos_token_id": tokenizer.eot_id,
        "pad_token_id": tokenizer.eot_id,
        "tie_word_embeddings": False,  # two tensors in the file; xmodlm re-ties on load
        "use_cache": False,
        "torch_dtype": "float32",
        "source": source,
    }


def export_run(
    run_dir: str | Path, out: str | Path, step: int | None = None
) -> dict[str, Any]:
    """``xmod export RUN --out DIR``: write a run's newest loadable checkpoint (or ``step``)
    as an exported directory. Returns the config written (``config.json``)."""
    from safetensors.torch import save_file

    from xmodlm.fileio import atomic_write_json
    from xmodlm.train.checkpoint import _untie, load_run, tokenizer_path

    run = Path(run_dir)
    if is_exported(run):
        raise UserError(f"{str(run)!r} is already an exported directory: copy it instead")
    cfg, model, ckpt = load_run(run, "cpu", step=step)
    tok_file = tokenizer_path(run)
    tokenizer = Tokenizer.load(tok_file)
    if tokenizer.vocab_size > cfg.model.vocab_size:
        raise UserError(
            f"run {str(run)!r}: tokenizer has {tokenizer.vocab_size} tokens, the model only"
            f" {cfg.model.vocab_size}: they do not belong together"
        )
    dest = Path(out)
    if dest.resolve() == run.resolve():
        raise UserError(f"--out {str(dest)!r} is the run directory: give a new directory")
    dest.mkdir(parents=True, exist_ok=True)
    weights = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    tmp = dest / f".{WEIGHTS_FILE}.tmp"
    save_file(_untie(weights), str(tmp), metadata={"format": "pt"})
    tmp.replace(dest / WEIGHTS_FILE)
    shutil.copyfile(tok_file, dest / TOKENIZER_FILE)
    atomic_write_json(dest / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOT, "bos_token": EOT, "pad_token": EOT, "unk_token": None,
        "model_max_length": cfg.model.context,
        "clean_up_tokenization_spaces": False,
    })
    atomic_write_json(dest / "generation_config.json", {
        "eos_token_id": tokenizer.eot_id, "bos_token_id": tokenizer.eot_id,
        "pad_token_id": tokenizer.eot_id, "do_sample": False, "use_cache": False,
    })
    modeling = resources.files("xmodlm").joinpath("hf.py").read_text(encoding="utf-8")
    (dest / MODELING_FILE).write_text(modeling, encoding="utf-8")
    source = {"run_dir": str(run), "checkpoint": ckpt.name, "step": int(ckpt.name.split("_")[1]),
              "config_name": cfg.name}
    config = export_config(cfg, tokenizer, source)
    atomic_write_json(dest / CONFIG_FILE, config)  # last: its presence marks a whole export
    return config


def _read_export_config(path: Path) -> tuple[dict[str, Any], ModelConfig]:
    file = path / CONFIG_FILE
    try:
        raw = json.loads(file.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as err:
        raise UserError(f"{file} is not valid JSON: {err}") from None
    if raw.get("format") != FORMAT or not isinstance(raw.get("xmod"), dict):
        raise UserError(f"{file} is not an xmod-lm export (no 'format: {FORMAT}' / 'xmod')")
    if int(raw.get("format_version", 0)) > FORMAT_VERSION:
        raise UserError(
            f"{file} has export format {raw['format_version']}; this xmod-lm reads up to"
            f" {FORMAT_VERSION}: upgrade xmod-lm"
        )
    model_cfg = Config.from_dict({"model": raw["xmod"]}, where="").validate().model
    return raw, model_cfg


def load_pretrained(
    path: str | Path, device: str | torch.device = "cpu", step: int | None = None
) -> tuple[Any, Tokenizer]:
    """``(model, tokenizer)`` from an exported directory or a training run directory.

    The model is a :class:`xmodlm.model.Transformer` in eval mode on ``device``;
    decode with causal routing (``model(idx, routing_mode="causal")`` or
    :func:`xmodlm.model.generate.generate_text`). ``step`` picks a checkpoint of a
    run directory (default: the newest that loads). Weights are read from
    safetensors only; nothing is unpickled.
    """
    from xmodlm.model import Transformer
    from xmodlm.train.checkpoint import load_model_weights, load_run, tokenizer_path

    where = Path(path)
    if is_exported(where):
        if step is not None:
            raise UserError(f"{str(where)!r} is an export of one checkpoint: step does not apply")
        _, model_cfg = _read_export_config(where)
        model = Transformer(model_cfg)
        load_model_weights(where, model)
        model = model.to(device).eval()
        tokenizer = Tokenizer.load(where / TOKENIZER_FILE)
    elif (where / "config.yaml").is_file():
        _, model, _ = load_run(where, str(device), step=step)
        tokenizer = Tokenizer.load(tokenizer_path(where))
    else:
        raise UserError(
            f"{str(where)!r} is neither an exported model (config.json of `xmod export`)"
            " nor a run directory (config.yaml)"
        )
    return model, tokenizer


def generate_from_run(
    path: str | Path,
    prompts: list[str] | tuple[str, ...],
    max_new_tokens: int = 64,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    device: str = "cpu",
) -> list[str]:
    """``xmod generate PATH --prompt TEXT``: continue prompts with a run's newest
    checkpoint or an exported model (:func:`load_pretrained`), causal routing.

    Raises :class:`UserError` for a missing directory, a run without a complete
    checkpoint or tokenizer, a checkpoint of another configuration, an empty
    prompt, or a prompt longer than the context.
    """
    from xmodlm.model.generate import generate_text

    if not Path(path).is_dir():
        raise UserError(f"run directory {str(path)!r} not found")
    model, tokenizer = load_pretrained(path, device)
    return generate_text(
        model, tokenizer, prompts, max_new_tokens=max_new_tokens, temperature=temperature,
        top_k=top_k, top_p=top_p, seed=seed,
    )
