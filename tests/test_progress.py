"""Progress of long work on stderr: plain lines when piped, nothing under --quiet."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from xmodlm import progress
from xmodlm.cli import main
from xmodlm.law.synthetic import synthetic_runs


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_plain_lines_at_most_every_interval_plus_the_last(monkeypatch: pytest.MonkeyPatch) -> None:
    err = io.StringIO()  # not a terminal
    clock = _Clock()
    monkeypatch.setattr("sys.stderr", err)
    monkeypatch.setattr(progress.time, "monotonic", clock)
    with progress.Progress(10, "stage", unit="batch", enabled=True) as bar:
        for _ in range(10):
            clock.now += 10.0  # 10 s per batch: a line every third batch (30 s), and the last
            bar.update(1)
    lines = err.getvalue().splitlines()
    assert lines == [
        "stage: 3/10 batch, 30s elapsed, ETA 1m10s",
        "stage: 6/10 batch, 1m00s elapsed, ETA 40s",
        "stage: 9/10 batch, 1m30s elapsed, ETA 10s",
        "stage: 10/10 batch, 1m40s elapsed",
    ]


def test_off_prints_nothing_and_a_failed_phase_no_last_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    err = io.StringIO()
    monkeypatch.setattr("sys.stderr", err)
    for item in progress.track(range(5), "quiet", enabled=False):
        assert item < 5
    with pytest.raises(ValueError), progress.Progress(3, "broken", enabled=True) as bar:
        bar.update(1)
        raise ValueError
    assert err.getvalue() == ""


@pytest.fixture(scope="module")
def runs_csv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("law") / "runs.csv"
    synthetic_runs(30, sigma=0.01, seed=1, contexts=(256,)).to_csv(path, index=False)
    return path


def test_law_fit_shows_stages_when_piped_and_nothing_when_quiet(
    runs_csv: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["law", "fit", str(runs_csv), "--form", "base", "--n-boot", "100", "--json",
            "--min-steps", "0"]
    assert main(args) == 0  # capsys's stderr is not a terminal: plain lines
    out, err = capsys.readouterr()
    json.loads(out)  # stdout stays one clean JSON object
    lines = err.splitlines()
    for stage in ("law fit: dense runs at context 256: 1/1 fit",
                  "law fit: bootstrap of the dense runs at context 256: 100/100 replicate",
                  "law fit: delta form base: 1/1 fit",
                  "law fit: bootstrap of delta form base: 100/100 replicate",
                  "law fit: held-out"):
        assert any(line.startswith(stage) for line in lines), (stage, err)
    assert main([*args, "--quiet"]) == 0
    out, err = capsys.readouterr()
    json.loads(out)
    assert err == ""
    assert progress.enabled()  # --quiet was for that command only
