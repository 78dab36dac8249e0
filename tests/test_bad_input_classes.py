"""Bad input by class: numbers out of what they count or what a generator takes,
YAML that says a key twice, specs with unknown keys or empty lists, output folders
that belong to another writer, half a launcher's environment, tables that name a
run twice. Each is refused in one line with exit status 2 (or, for a repeated row,
counted once), and a refused command leaves every existing file byte-identical.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
import torch
import yaml

from fuzz_world import build_world, changed, cli, refused_in_one_line, snapshot
from xmodlm.config import SEED_MAX, load_config
from xmodlm.errors import UserError
from xmodlm.model.generate import sample_next


@pytest.fixture(scope="module")
def world(tiny_data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return build_world(tmp_path_factory.mktemp("classes"), tiny_data_dir)


def _refused(world: dict[str, Path], argv: list[str], needle: str) -> str:
    before = snapshot(world["root"])
    code, _, err, _ = cli([a.format(**world) for a in argv])
    assert refused_in_one_line(code, err), (code, err)
    assert needle in err, err
    assert not changed(before, snapshot(world["root"])), "a refused command wrote"
    return err


# --- numbers ---------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [SEED_MAX + 1, 2**64, 2**64 - 1])
def test_seed_beyond_every_generator(seed: int) -> None:
    with pytest.raises(UserError, match=f"train.seed={seed}: must be an integer in 0..{SEED_MAX}"):
        load_config("micro", [f"train.seed={seed}"])
    assert load_config("micro", [f"train.seed={SEED_MAX}"]).train.seed == SEED_MAX


def test_spec_seed_beyond_every_generator(world: dict[str, Path], tmp_path: Path) -> None:
    spec = yaml.safe_load(world["spec"].read_text())
    (tmp_path / "s.yaml").write_text(yaml.safe_dump({**spec, "seeds": [2**40]}))
    _refused(world, ["sweep", str(tmp_path / "s.yaml"), "--dry-run"], "0..4294967295")


@pytest.mark.parametrize("temperature", [1e-300, 5e-324, 1e-30, 1e300])
def test_any_positive_temperature_samples(temperature: float) -> None:
    logits = torch.tensor([[3.0, 1.0, -2.0], [0.0, 0.0, 50.0]])
    tokens = sample_next(logits, temperature=temperature,
                         generator=torch.Generator().manual_seed(0))
    assert tokens.shape == (2,)
    if temperature < 1e-20:  # as good as greedy
        assert tokens.tolist() == [0, 2]


def test_more_validation_batches_than_the_split_holds(world: dict[str, Path]) -> None:
    _refused(world, ["train", "{cfg}", "--out", "{root}/new", "--quiet",
                     "--set", "data.val_batches=100000"], "lower data.val_batches")


@pytest.mark.parametrize(("setting", "needle"), [
    ("train.batch_tokens=1", "less than one sequence"),
    ("model.vocab_size=1", "must be an integer >= 2"),
    ("name=", "name is empty"),
    ("name=null", "name is empty"),
])
def test_values_too_small_to_mean_anything(setting: str, needle: str) -> None:
    with pytest.raises(UserError, match=needle):
        load_config("micro", [setting])


# --- files a user writes ---------------------------------------------------------------


@pytest.mark.parametrize("text", [
    "base: micro\nmodel:\n  d_model: 64\n  d_model: 32\n",
    "base: micro\nmodel: {d_model: 64}\nmodel: {n_layers: 2}\n",
    "base: micro\nbase: xmod-tiny\n",
])
def test_config_duplicate_key_refused(text: str, tmp_path: Path) -> None:
    (tmp_path / "c.yaml").write_text(text)
    with pytest.raises(UserError, match="duplicate key"):
        load_config(tmp_path / "c.yaml")


def test_spec_duplicate_key_refused(world: dict[str, Path], tmp_path: Path) -> None:
    text = world["spec"].read_text() + "seeds: [1]\n"
    (tmp_path / "s.yaml").write_text(text)
    _refused(world, ["sweep", str(tmp_path / "s.yaml"), "--dry-run"], "duplicate key 'seeds'")


@pytest.mark.parametrize(("change", "needle"), [
    ({"dense": [{"width": 32, "n_layers": 2, "heads": 2}]}, "dense: unknown key 'heads'"),
    ({"seeds": []}, "seeds=[]"),
    ({"context": []}, "context=[]"),
    ({"families": [{"family": "xmod", "stride": [], "capacity": 0.5}]}, "stride=[]"),
    ({"batch_tokens": "many"}, "batch_tokens"),
    ({"families": [{"family": "dense", "compute": {64: [2e9]}}],
      "context": [32, 64], "compute": {32: [2e9], 64: [3e9]}}, None),
    ({"eval": {"tasks": "", "splitt": "val"}}, "eval: unknown key 'splitt'"),
])
def test_spec_nested_faults(change: dict, needle: str | None, world: dict[str, Path],
                            tmp_path: Path) -> None:
    spec = {**yaml.safe_load(world["spec"].read_text()), **change}
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(spec))
    if needle is None:  # a family narrowed to one context still runs there
        assert cli(["sweep", str(tmp_path / "s.yaml"), "--dry-run"])[0] == 0
    else:
        _refused(world, ["sweep", str(tmp_path / "s.yaml"), "--dry-run"], needle)


def test_spec_that_expands_to_nothing(world: dict[str, Path], tmp_path: Path) -> None:
    spec = {**yaml.safe_load(world["spec"].read_text()), "context": [32, 64],
            "compute": {32: [2e9], 64: [3e9]},
            "families": [{"family": "dense", "compute": {64: [2e9]}, "seeds": [5]}],
            "seeds": [0]}
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(spec))
    assert cli(["sweep", str(tmp_path / "s.yaml"), "--dry-run"])[0] == 0
    spec["families"] = [{"family": "dense", "compute": {}}]
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(spec))
    _refused(world, ["sweep", str(tmp_path / "s.yaml"), "--dry-run"], "no runs")


# --- paths -----------------------------------------------------------------------------


OTHER_WRITERS = [  # (command writing into a folder, the kind it may find there)
    (["data", "prepare", "--out", "{%s}", "--text", "{cfg}", "--vocab-size", "64"], "corpus"),
    (["train", "{cfg}", "--out", "{%s}", "--quiet"], "run"),
    (["sweep", "{spec}", "--out", "{%s}", "--quiet"], "sweep"),
    (["export", "{run}", "--out", "{%s}"], "export"),
    (["demo", "--out", "{%s}", "--compute", "1e6", "--data", "{corpus}"], None),
    (["report", "{sweep}", "--out", "{%s}"], None),
    (["law", "fit", "{root}/t.csv", "--plots", "{%s}"], None),
]


FOREIGN = [(argv, folder) for argv, own in OTHER_WRITERS  # its own kind: a resume or a
           for folder in ("corpus", "run", "sweep", "export") if folder != own]  # refresh


@pytest.mark.parametrize(("argv", "folder"), FOREIGN,
                         ids=[f"{' '.join(a[:2])} into {f}" for a, f in FOREIGN])
def test_never_writes_into_another_writers_folder(
    argv: list[str], folder: str, world: dict[str, Path]
) -> None:
    argv = [a.replace("{%s}", "{" + folder + "}") for a in argv]
    _refused(world, argv, "must not write into")


@pytest.mark.parametrize(("argv", "needle"), [
    (["results", "{run}"], "not a sweep folder: it holds a training run"),
    (["results", "{corpus}"], "not a sweep folder: it holds a prepared corpus"),
    (["results", "{root}"], "holds no runs/ folder"),
    (["results", "{sweep}", "--out", "{root}/r.xyz"], "writes .csv files"),
    (["law", "fit", "{root}/t.csv", "--out", "{root}/fit.txt"], "writes .json files"),
    (["show-routing", "{run}", "--text", "x", "--out", "{root}/r.txt"], "writes .png, .html"),
    (["lm-eval", "{run}", "--tasks", "xmod_cloze", "--out", "{root}/r.csv"], "writes .json"),
    (["export", "{run}", "--out", "{root}/e", "--step", "999"], "its steps: 2"),
    (["generate", "{run}", "--prompt", "The", "--seed", str(2**64)], "0..4294967295"),
])
def test_paths_of_the_wrong_kind(argv: list[str], needle: str, world: dict[str, Path]) -> None:
    (world["root"] / "t.csv").write_text("params_active,tokens,val_loss\n1e6,1e8,3.0\n")
    _refused(world, argv, needle)


def test_missing_include_path(world: dict[str, Path]) -> None:
    pytest.importorskip("lm_eval")
    _refused(world, ["lm-eval", "{run}", "--tasks", "xmod_cloze", "--limit", "2",
                     "--include-path", "{root}/nowhere"], "--include-path")


# --- environment -----------------------------------------------------------------------


@pytest.mark.parametrize("env", [{"RANK": "1"}, {"LOCAL_RANK": "3"},
                                 {"RANK": "1", "WORLD_SIZE": "1"}])
def test_half_a_launchers_environment(env: dict[str, str], world: dict[str, Path],
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    _refused(world, ["train", "{cfg}", "--out", "{root}/new", "--quiet"], "launch with torchrun")


# --- tables ----------------------------------------------------------------------------


def _table(rows: list[dict]) -> pd.DataFrame:
    base = {"params_active": 1e6, "tokens": 1e8, "val_loss": 3.0, "status": "ok"}
    return pd.DataFrame([{**base, **r} for r in rows])


def test_a_repeated_row_counts_once() -> None:
    from xmodlm.law.table import validate

    rows = [{"run_id": "a", "tokens": 1e8}, {"run_id": "b", "tokens": 2e8}]
    once = validate(_table(rows))
    twice = validate(_table([*rows, rows[0]]))
    assert len(twice.frame) == len(once.frame) == 2
    assert any("counted once" in n for n in twice.notes)


def test_one_run_id_with_two_rows_is_refused() -> None:
    from xmodlm.law.table import validate

    with pytest.raises(UserError, match="run_id 'a' appears twice"):
        validate(_table([{"run_id": "a", "val_loss": 3.0}, {"run_id": "a", "val_loss": 2.0}]))
