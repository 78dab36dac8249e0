"""A model that leaves the project: ``xmod export`` and :func:`load_pretrained`.

An exported directory is self-contained and holds no pickles::

    model.safetensors       the weights (tied embeddings stored as two tensors), in
                            ``--dtype``; routers and thresholds always fp32
    config.json             the Hugging Face config (``model_type`` xmodlm, the
                            resolved architecture, ``auto_map``), xmod-lm's model
                            config (key ``xmod``) and where it came from (the run's
                            folder name and config hash, never a path)
    tokenizer.json          the run's byte-level BPE tokenizer
    tokenizer_config.json   so ``transformers.AutoTokenizer`` reads it too
    generation_config.json  end-of-text id, greedy, with the cache
    modeling_xmod.py        the model for ``transformers`` (:mod:`xmodlm.hf`): it needs
                            only torch and transformers, so a copy on a hub loads
                            anywhere with ``trust_remote_code=True``
    README.md               the model card (:mod:`xmodlm.model_card`)

Writing never loses data: ``--out`` must be empty, new, or an export of the same
run (``--force`` writes over anything else); every file is written to a new
temporary file and renamed into place, so a crash leaves the old file or the new
one, a symlink in the folder is replaced rather than followed, and files get the
mode a plain ``open`` gives. ``config.json`` is written last: its presence marks a
whole export.

:func:`load_pretrained` reads either an exported directory or a training run
directory, through the same safetensors loader the trainer uses
(:func:`xmodlm.runs.load_model_weights`); nothing on the load path
unpickles.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import os
import tempfile
from importlib import resources
from pathlib import Path
from typing import Any

import torch

from xmodlm.config import Config, ModelConfig
from xmodlm.data.tokenizer import EOT, Tokenizer
from xmodlm.errors import UserError
from xmodlm.model import Transformer
from xmodlm.runs import (
    EXPORT_CONFIG,
    EXPORT_FORMAT,
    is_exported,
    load_model_weights,
    load_run,
    tokenizer_path,
    untie_weights,
)
from xmodlm.typed import load_json
from xmodlm.version import __version__

FORMAT_VERSION = 2  # 2: the standalone modeling file and its config fields
WEIGHTS_FILE = "model.safetensors"
TOKENIZER_FILE = "tokenizer.json"
MODELING_FILE = "modeling_xmod.py"
CARD_FILE = "README.md"
AUTO_MAP = {
    "AutoConfig": "modeling_xmod.XModConfig",
    "AutoModelForCausalLM": "modeling_xmod.XModForCausalLM",
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def modeling_source() -> str:
    """The text of the standalone modeling file an export carries (:mod:`xmodlm.hf`)."""
    return resources.files("xmodlm").joinpath("hf.py").read_text(encoding="utf-8")


def model_type() -> str:
    """The ``model_type`` the modeling file declares (read from its source, so that
    exporting needs no ``transformers``)."""
    for node in ast.parse(modeling_source()).body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "MODEL_TYPE" for t in node.targets
        ):
            return ast.literal_eval(node.value)
    raise AssertionError("xmodlm/hf.py declares no MODEL_TYPE")


def export_config(
    cfg: Config, tokenizer: Tokenizer, source: dict[str, Any], dtype: str = "float32"
) -> dict[str, Any]:
    """The ``config.json`` of an export: the fields :class:`xmodlm.hf.XModConfig`
    reads (the architecture resolved here, so the modeling file derives nothing),
    ``xmod`` (the model config, for :func:`load_pretrained`) and the source."""
    from xmodlm.depth_routers import make_kind

    m = cfg.model
    if "E" in m.block_layout and (m.moe_router != "switch" or m.moe_shared > 0):
        raise UserError(
            f"export restates the switch MoE only: model.moe_router={m.moe_router},"
            f" model.moe_shared={m.moe_shared} has no transformers counterpart yet"
        )
    kind = make_kind(m.causal_router, m.d_model)
    return {
        "model_type": model_type(),
        "architectures": ["XModForCausalLM"],
        "auto_map": dict(AUTO_MAP),
        "format": EXPORT_FORMAT,
        "format_version": FORMAT_VERSION,
        "xmodlm_version": __version__,
        "vocab_size": m.vocab_size,
        "tokenizer_vocab_size": tokenizer.vocab_size,
        "hidden_size": m.d_model,
        "num_hidden_layers": m.num_blocks,
        "num_attention_heads": m.n_heads,
        "num_key_value_heads": m.attn_kv_heads,
        "head_dim": m.attn_head_dim,
        "qk_norm": m.qk_norm,
        "intermediate_size": m.ffn_dim,
        "max_position_embeddings": m.context,
        "layout": m.block_layout,
        "capacity": m.depth.capacity,
        "gating": m.gating,
        "gate_scope": m.gate_scope,
        "token_bias": m.token_bias,
        "token_bias_step": m.token_bias_step,
        "decision": m.causal_router,
        "decision_hidden": getattr(kind, "hidden", 0),
        "threshold_rule": m.causal_threshold,
        "num_experts": m.n_experts,
        "num_experts_per_tok": m.moe_top_k,
        "expert_intermediate_size": m.expert_dim,
        "rope_theta": m.rope_theta,
        "rms_norm_eps": m.norm_eps,
        "initializer_range": m.init_std,
        "eos_token_id": tokenizer.eot_id,
        "bos_token_id": tokenizer.eot_id,
        "pad_token_id": tokenizer.eot_id,
        "tie_word_embeddings": False,  # two tensors in the file; xmodlm re-ties on load
        "use_cache": True,
        "dtype": dtype,
        "xmod": dataclasses.asdict(m),
        "source": source,
    }


def transformers_model(model: Any, tokenizer_vocab_size: int | None = None) -> Any:
    """The ``transformers`` model (:class:`xmodlm.hf.XModForCausalLM`) of a loaded
    :class:`xmodlm.model.Transformer`, with its weights, in eval mode, without
    writing a folder; ``tokenizer_vocab_size``: ids at or above it get -inf logits.
    Needs ``transformers`` (the ``hf`` extra)."""
    from types import SimpleNamespace

    from xmodlm.hf import XModConfig, XModForCausalLM

    tok = SimpleNamespace(vocab_size=tokenizer_vocab_size or model.cfg.vocab_size, eot_id=None)
    source = {"run": "", "run_config_sha256": "", "checkpoint": "", "step": 0, "config_name": ""}
    config = export_config(Config(model=model.cfg), tok, source)
    hf = XModForCausalLM(XModConfig(**config))
    hf.load_state_dict(model.state_dict(), strict=True)
    return hf.eval()


def export_run(
    run_dir: str | Path,
    out: str | Path,
    step: int | None = None,
    dtype: str = "float32",
    force: bool = False,
) -> dict[str, Any]:
    """``xmod export RUN --out DIR``: write a run's newest loadable checkpoint (or
    ``step``) as an exported directory, weights in ``dtype``. Returns the config
    written (``config.json``).

    Refuses (:class:`UserError`) an ``out`` that holds anything but an export of
    this same run, unless ``force``; a full disk or a read-only folder is a
    :class:`UserError` too, and leaves every file there whole.
    """
    from xmodlm.fileio import sha256_file

    run = Path(run_dir)
    if is_exported(run):
        raise UserError(f"{str(run)!r} is already an exported directory: copy it instead")
    if dtype not in DTYPES:
        raise UserError(f"--dtype {dtype!r}: one of {', '.join(DTYPES)}")
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
    source = {"run": run.resolve().name, "run_config_sha256": sha256_file(run / "config.yaml"),
              "checkpoint": ckpt.name, "step": int(ckpt.name.split("_")[1]),
              "config_name": cfg.name}
    _check_destination(dest, source, force)
    config = export_config(cfg, tokenizer, source, dtype)
    weights = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    try:
        dest.mkdir(parents=True, exist_ok=True)
        _write_weights(dest / WEIGHTS_FILE, _in_dtype(weights, DTYPES[dtype]))
        _write(dest / TOKENIZER_FILE, tok_file.read_bytes())
        _write_json(dest / "tokenizer_config.json", {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "eos_token": EOT, "bos_token": EOT, "pad_token": EOT, "unk_token": None,
            "model_max_length": cfg.model.context,
            "clean_up_tokenization_spaces": False,
        })
        _write_json(dest / "generation_config.json", {
            "eos_token_id": tokenizer.eot_id, "bos_token_id": tokenizer.eot_id,
            "pad_token_id": tokenizer.eot_id, "do_sample": False, "use_cache": True,
        })
        _write(dest / MODELING_FILE, modeling_source().encode("utf-8"))
        from xmodlm.model_card import model_card

        _write(dest / CARD_FILE, model_card(run, cfg, model, config).encode("utf-8"))
        _write_json(dest / EXPORT_CONFIG, config)  # last: its presence marks a whole export
    except OSError as err:
        raise UserError(f"cannot write the export to {str(dest)!r}: {err}") from None
    return config


def _check_destination(dest: Path, source: dict[str, Any], force: bool) -> None:
    """``dest`` may be new, empty or an export of the run ``source`` names; with
    ``force``, anything (its files of our names are replaced, others stay)."""
    if dest.is_symlink() and not dest.exists():
        raise UserError(f"--out {str(dest)!r} is a broken symlink")
    if not dest.exists() or force:
        return
    if not dest.is_dir():
        raise UserError(f"--out {str(dest)!r} is a file, not a directory")
    if not any(dest.iterdir()):
        return
    hint = "give a new or empty directory, or --force to write over it"
    if not is_exported(dest):
        raise UserError(f"--out {str(dest)!r} holds files that are not an xmod export: {hint}")
    theirs = json.loads((dest / EXPORT_CONFIG).read_text(encoding="utf-8")).get("source") or {}
    if theirs.get("run_config_sha256") != source["run_config_sha256"]:
        raise UserError(
            f"--out {str(dest)!r} holds an export of another run"
            f" ({theirs.get('run', 'unknown')!r}): {hint}"
        )


def _in_dtype(weights: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Floating weights in ``dtype``, except what routing decides with (router
    weights, decision heads, thresholds): those stay fp32, as the model computes them."""
    return {
        k: v.to(dtype) if v.is_floating_point() and ".router." not in k else v
        for k, v in weights.items()
    }


def _write(path: Path, data: bytes) -> None:
    """Atomically replace ``path`` (a symlink there is replaced, never followed)."""
    from xmodlm.fileio import atomic_open

    with atomic_open(path, "wb") as handle:
        handle.write(data)


def _write_json(path: Path, obj: Any) -> None:
    _write(path, (json.dumps(obj, indent=2) + "\n").encode("utf-8"))


def _write_weights(path: Path, weights: dict[str, torch.Tensor]) -> None:
    """safetensors straight to a new temporary file beside ``path`` (no copy of the
    weights in memory), then the mode ``open`` gives, fsync and rename. safetensors
    reports a full disk as its own error, not an OSError: made one here."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    from xmodlm.fileio import follow_umask, fsync_dir

    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    tmp = Path(name)
    try:
        save_file(untie_weights(weights), str(tmp), metadata={"format": "pt"})
        follow_umask(tmp)
        with open(tmp, "rb") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except SafetensorError as err:
        tmp.unlink(missing_ok=True)
        raise OSError(f"{path}: {err}") from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def _read_export_config(path: Path) -> tuple[dict[str, Any], ModelConfig]:
    file = path / EXPORT_CONFIG
    try:
        text = file.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise UserError(f"{file} is not valid JSON: {err}") from None
    raw = load_json(text, str(file))
    if not isinstance(raw, dict):
        raise UserError(f"{file}: top level must be a JSON object")
    if raw.get("format") != EXPORT_FORMAT or not isinstance(raw.get("xmod"), dict):
        raise UserError(f"{file} is not an xmod-lm export (no 'format: {EXPORT_FORMAT}' / 'xmod')")
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
