"""Property-based bad input: every generated value either works or is refused in one
line with exit status 2; never a traceback (exit 1), never exit 0 with nothing done,
never a write outside the named output, never longer than a time limit.

Generated: config values and ``--set`` strings, whole config files (unknown and
duplicate keys at every level), sweep specs (any key of any nested section replaced,
removed or emptied), law tables (missing columns, NaN, strings in number columns,
repeated rows), the options of every command, sampling numbers and prompts, and a
launcher's environment. ``make test`` runs the fixed-seed ``fast`` profile (a few
examples each); ``make fuzz`` the ``long`` one (HYPOTHESIS_PROFILE=long).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fuzz_world import GOOD_SPEC, build_world, changed, cli, refused_in_one_line, snapshot
from xmodlm.cli import build_parser
from xmodlm.config import Config, load_config
from xmodlm.errors import UserError

_COMMON = dict(deadline=None, database=None, suppress_health_check=list(HealthCheck))
settings.register_profile("fast", max_examples=10, derandomize=True, **_COMMON)
settings.register_profile("long", max_examples=400, **_COMMON)
PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "fast")
settings.load_profile(PROFILE)
LIMIT_S = 60.0  # no single command may take longer on any input


def examples(fast: int) -> settings:
    """``fast`` examples in the fast profile; the long profile's count scaled alike."""
    return settings(max_examples=fast if PROFILE == "fast" else fast * 40)


@pytest.fixture(scope="module")
def world(tiny_data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return build_world(tmp_path_factory.mktemp("fuzz"), tiny_data_dir)


# --- strategies ------------------------------------------------------------------------

SPECIAL = ["1e-3", "on", "off", "yes", ".nan", "-.inf", ".inf", "0x10", "~", "null", "[]",
           "{}", "1e400", "-0", "2.5", "true", "'5'", "[1, 2]", "{a: 1}", "cuda:0", "bf16",
           "18446744073709551616", "4294967296", "-1", "0", "1", "8", "\u00e9", ""]
scalars = st.one_of(
    st.none(), st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(min_value=-3, max_value=300),
    st.sampled_from(SPECIAL),
    st.text(max_size=8),
)
values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)),
    max_leaves=6)
CONFIG_KEYS = sorted(
    [f"{section}.{name}" for section, fields in Config().to_dict().items()
     if isinstance(fields, dict) for name in fields] + ["name"])
keys = st.one_of(st.sampled_from(CONFIG_KEYS), st.sampled_from(["model", "train.", "model.x.y",
                 "", ".", "data.dir.sub", "Model.d_model"]), st.text(max_size=10))


def _as_text(value: object) -> str:
    """A value as the text a user would type after ``=`` (YAML flow style)."""
    if isinstance(value, str):
        return value
    return yaml.safe_dump(value, default_flow_style=True, width=10_000).strip().removesuffix(
        "\n...").strip()


set_strings = st.one_of(
    st.builds(lambda k, v: f"{k}={_as_text(v)}", keys, values),
    st.builds(lambda k, v: f"{k}={v}", st.sampled_from(CONFIG_KEYS), st.sampled_from(SPECIAL)),
    st.text(max_size=20),
)


def _one_line_error(call: object) -> object | None:
    """The result of ``call()``, or None when it raised a one-line UserError."""
    try:
        return call()  # type: ignore[operator]
    except UserError as err:
        assert "\n" not in str(err) and str(err).strip(), repr(err)
        return None


# --- config values and --set strings ----------------------------------------------------


@given(overrides=st.lists(set_strings, min_size=1, max_size=3))
@examples(60)
def test_set_strings_work_or_name_the_fault(overrides: list[str]) -> None:
    cfg = _one_line_error(lambda: load_config("micro", overrides))
    if cfg is not None:  # accepted: what it holds passes its own validation again
        Config.from_dict(cfg.to_dict(), where="").validate()


@given(setting=set_strings)
@examples(8)
def test_info_with_a_generated_set(setting: str, world: dict[str, Path]) -> None:
    _check(world, ["info", "micro", "--set", setting, "--json"], out=None)


def _sections(draw_keys: st.SearchStrategy) -> st.SearchStrategy:
    return st.dictionaries(draw_keys, values, max_size=4)


config_files = st.fixed_dictionaries(
    {"base": st.sampled_from(["micro", "xmod-tiny"])},
    optional={"name": st.one_of(st.text(max_size=6), scalars),
              "model": _sections(st.sampled_from(sorted(Config().to_dict()["model"]))
                                 | st.text(max_size=6)),
              "train": _sections(st.sampled_from(sorted(Config().to_dict()["train"]))
                                 | st.text(max_size=6)),
              "data": _sections(st.sampled_from(["dir", "val_batches", "extra"])),
              "extra": values})


@given(raw=config_files, tail=st.sampled_from(["", "model:\n  d_model: 64\n", "train: {lr: 1}\n",
                                                "name: a\n", "\tbad: [\n"]))
@examples(25)
def test_config_files_work_or_name_the_fault(raw: dict, tail: str, tmp_path_factory) -> None:
    path = tmp_path_factory.mktemp("cfg") / "c.yaml"
    text = yaml.safe_dump(raw) + tail  # a tail may repeat a section: a duplicate key
    path.write_text(text)
    cfg = _one_line_error(lambda: load_config(path))
    if cfg is not None:
        assert not any(f"\n{k}:" in f"\n{yaml.safe_dump(raw)}" for k in
                       (line.split(":")[0] for line in tail.splitlines() if ":" in line)
                       if not k.startswith((" ", "\t"))), "a duplicate key was accepted"


# --- the CLI's own contract -------------------------------------------------------------


def _check(world: dict[str, Path], argv: list[str], out: Path | None) -> tuple[int, str]:
    """Run ``xmod ARGV``: works or refuses in one line, in time, writing only ``out``."""
    before = snapshot(world["root"])
    code, stdout, err, seconds = cli([str(a) for a in argv])
    after = snapshot(world["root"])
    assert seconds < LIMIT_S, (argv, seconds)
    assert "Traceback" not in err and "internal error" not in err, (argv, err)
    if code == 2:
        assert refused_in_one_line(code, err), (argv, err)
        assert not changed(before, after), (argv, changed(before, after))
    else:
        assert code == 0, (argv, code, err)
        assert stdout.strip() or changed(before, after), ("exit 0 with nothing done", argv)
        written = changed(before, after)
        inside = str(out.relative_to(world["root"])) if out is not None else None
        assert all(inside and (p == inside or p.startswith(inside + os.sep)) for p in written), (
            argv, written)
    return code, err


# --- sweep specs, nested sections included ----------------------------------------------

SPEC_PATHS = [(k,) for k in GOOD_SPEC] + [
    ("families", 0, "family"), ("families", 1, "stride"), ("families", 1, "capacity"),
    ("families", 1, "gating"), ("families", 1, "seeds"), ("families", 1, "compute"),
    ("families", 1, "lr"), ("families", 1, "bogus"), ("dense", 0, "width"),
    ("dense", 0, "n_layers"), ("dense", 0, "n_heads"), ("dense", 0, "bogus"),
    ("eval", "tasks"), ("eval", "split"), ("eval", "max_items"), ("eval", "batches"),
    ("eval", "bogus"),
    ("require", "min_steps"), ("require", "max_epochs"), ("require", "bogus"),
    ("lr_rule", "lr"), ("lr_rule", "width"), ("lr_rule", "power"), ("batch_tokens",),
    ("bogus",), ("compute", 0), ("seeds", 0), ("context", 0),
]
mutations = st.lists(st.tuples(st.sampled_from(SPEC_PATHS),
                               st.one_of(values, st.just([]), st.just("<delete>"))),
                     min_size=1, max_size=3)


def _mutate(spec: dict, path: tuple, value: object) -> None:
    node: object = spec
    for part in path[:-1]:
        if isinstance(node, dict):
            node = node.setdefault(part, {} if part in ("eval", "require", "lr_rule") else [])
        elif isinstance(node, list) and isinstance(part, int) and part < len(node):
            node = node[part]
        else:
            return
    last = path[-1]
    if isinstance(node, dict):
        if value == "<delete>":
            node.pop(last, None)
        else:
            node[last] = value
    elif isinstance(node, list) and isinstance(last, int) and last < len(node):
        if value != "<delete>":
            node[last] = value


@given(changes=mutations)
@examples(10)
def test_sweep_specs_work_or_name_the_fault(changes: list, world: dict[str, Path]) -> None:
    spec = yaml.safe_load(world["spec"].read_text())
    spec["eval"], spec["require"] = {"tasks": ""}, {}
    for path, value in changes:
        _mutate(spec, path, value)
    path = world["root"].parent / f"{world['root'].name}-spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    _check(world, ["sweep", path, "--dry-run"], out=None)


# --- law tables --------------------------------------------------------------------------

TABLE_COLUMNS = ["params_active", "tokens", "val_loss", "val_loss_causal", "status", "run_id",
                 "context", "stride", "capacity", "family", "steps", "layout"]
cells = st.one_of(st.floats(min_value=1e-3, max_value=1e12), st.floats(allow_nan=True),
                  st.integers(-5, 5000), st.sampled_from(["ok", "failed", "n/a", "", "xmod",
                                                           "dense", "moe", "DsDs", "a", "b"]))
rows = st.lists(st.dictionaries(st.sampled_from(TABLE_COLUMNS), cells, max_size=12),
                min_size=0, max_size=6)


@given(table=rows, repeats=st.lists(st.integers(0, 5), max_size=3),
       command=st.sampled_from(["fit", "predict"]))
@examples(10)
def test_law_tables_work_or_name_the_fault(
    table: list[dict], repeats: list[int], command: str, world: dict[str, Path]
) -> None:
    import pandas as pd

    table = table + [table[i] for i in repeats if i < len(table)]  # rows named twice
    path = world["root"].parent / f"{world['root'].name}-table.csv"
    pd.DataFrame(table, columns=TABLE_COLUMNS if not table else None).to_csv(path, index=False)
    if command == "fit":
        _check(world, ["law", "fit", path, "--min-steps", "0", "--n-boot", "2", "--quiet"],
               out=None)
    else:
        _check(world, ["law", "predict", _shipped_fit(), "--input", path], out=None)


def _shipped_fit() -> str:
    from importlib import resources

    return str(resources.files("xmodlm") / "law" / "default_fit.json")


# --- every command's options -------------------------------------------------------------


def _commands() -> dict[str, argparse.ArgumentParser]:
    """Each command's parser by its argv prefix (``law fit``, ``data prepare``, ``info``)."""
    found: dict[str, argparse.ArgumentParser] = {}

    def walk(parser: argparse.ArgumentParser, prefix: list[str]) -> None:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs:
            found[" ".join(prefix)] = parser
        for sub in subs:
            for name, child in sub.choices.items():
                walk(child, [*prefix, name])

    walk(build_parser(), [])
    return found


COMMANDS = _commands()
option_values = st.one_of(st.sampled_from(SPECIAL), st.text(max_size=8),
                          st.integers(-(2**66), 2**66).map(str),
                          st.floats(allow_nan=True, allow_infinity=True).map(str))


@pytest.mark.parametrize("command", sorted(COMMANDS))
@given(data=st.data())
@examples(6)
def test_every_commands_options_parse_or_refuse(command: str, data: st.DataObject) -> None:
    parser = COMMANDS[command]
    options = [a for a in parser._actions if a.option_strings and a.nargs != 0
               and a.dest != "help"]
    argv = command.split() + ["POSITIONAL"] * sum(
        1 for a in parser._actions if not a.option_strings and a.nargs in (None, "+"))
    for action in data.draw(st.lists(st.sampled_from(options), max_size=3)) if options else []:
        argv += [action.option_strings[-1], data.draw(option_values)]
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            build_parser().parse_args(argv)
            code = 0
        except SystemExit as exit_:
            code = exit_.code
    assert code in (0, 2), (argv, code)
    if code == 2:
        assert refused_in_one_line(code, err.getvalue()), (argv, err.getvalue())


# --- numbers and text: sampling ----------------------------------------------------------

BAD_UTF8 = b"\xff\xfe caf\xc3".decode("utf-8", "surrogateescape")
sampling = st.fixed_dictionaries({}, optional={
    "--temperature": st.one_of(st.floats(allow_nan=True, allow_infinity=True),
                               st.sampled_from(["1e-300", "5e-324", "0", "1e308"])).map(str),
    "--seed": st.one_of(st.integers(-5, 2**66), st.sampled_from([2**32 - 1, 2**32])).map(str),
    "--top-k": st.integers(-2, 400).map(str),
    "--top-p": st.floats(allow_nan=True, allow_infinity=True).map(str),
    "--max-new-tokens": st.integers(-2, 4).map(str),
    "--prompt": st.one_of(st.text(max_size=12), st.just(BAD_UTF8)),
})


@given(options=sampling)
@examples(8)
def test_generate_numbers_and_text(options: dict[str, str], world: dict[str, Path]) -> None:
    argv = ["generate", world["run"], "--device", "cpu"]
    argv += [x for flag, value in {"--prompt": "The", **options}.items() for x in (flag, value)]
    _check(world, argv, out=None)


# --- a launcher's environment ------------------------------------------------------------

env_values = st.one_of(st.none(), st.sampled_from(["0", "1", "2", "", " ", "-1", "x", "01"]),
                       st.text(max_size=4))


@given(rank=env_values, local=env_values, world_size=env_values)
@examples(30)
def test_launcher_environment_whole_or_refused(rank, local, world_size) -> None:
    from xmodlm.train.distributed import setup_distributed

    env = {"RANK": rank, "LOCAL_RANK": local, "WORLD_SIZE": world_size}
    saved = {k: os.environ.get(k) for k in env}
    try:
        for name, value in env.items():
            if value is None or "\x00" in value:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        if (world_size or "1").strip() not in ("", "0", "1") and \
                (world_size or "").strip().isdigit():
            return  # a whole multi-process launch would join a process group
        dist = _one_line_error(lambda: setup_distributed("cpu"))
        if dist is not None:
            assert dist.world_size == 1 and dist.rank == 0
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
