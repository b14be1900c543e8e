"""Each study record says what ran (its resolved config) and with which code (commit, dirty
flag), and the runner refuses a grid cell whose runs come from different code unless
``--allow-mixed-commits``, without losing the runs it trained (issue #23, item 6)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
from test_study import BASE, load_runner, tiny_spec_file

from fedplug.errors import ConfigError
from fedplug.study.expansion import expand_study
from fedplug.study.provenance import (
    code_version,
    describe_mixed_commits,
    mixed_commit_cells,
    wall_time,
)
from fedplug.study.records import load_records, run_record
from fedplug.study.run_folders import config_hash
from fedplug.study.spec import parse_study

OLD, NEW = "a" * 40, "b" * 40


def record(run: str, cell: dict[str, str], commit: str | None, dirty: bool | None = False) -> dict[str, Any]:
    return {"run": run, "cell": cell, "algorithm": run.split("__")[1], "draw": 0, "seed": 0, "commit": commit,
            "dirty": dirty}


def test_code_version_tells_dirty_and_unknown_checkouts_apart() -> None:
    assert code_version({"commit": OLD, "dirty": False}) == OLD
    assert code_version({"commit": OLD, "dirty": None}) == OLD  # dirty unknown: the commit is all we know
    assert code_version({"commit": OLD, "dirty": True}) == OLD + "+dirty"
    assert code_version({"commit": None, "dirty": True}) == "unknown"
    assert code_version({}) == "unknown"


def test_only_the_cell_that_mixes_commits_is_named_with_its_runs() -> None:
    # Prepare: cell 0.1_x mixes OLD (fedavg) and NEW (fedprox); cell 1_x is all OLD.
    records = [
        record("0.1_x__fedavg__d0s0", {"alpha": "0.1", "k": "x"}, OLD),
        record("0.1_x__fedprox__d0s0", {"alpha": "0.1", "k": "x"}, NEW),
        record("1_x__fedavg__d0s0", {"alpha": "1", "k": "x"}, OLD),
        record("1_x__fedprox__d0s0", {"alpha": "1", "k": "x"}, OLD),
        record("0.1_x__fedavg__d0s1", {"alpha": "0.1", "k": "x"}, OLD),
    ]

    # Execute
    mixed = mixed_commit_cells(records)
    text = describe_mixed_commits(records)

    # Assert
    assert mixed == {"0.1_x": {OLD: ["0.1_x__fedavg__d0s0", "0.1_x__fedavg__d0s1"], NEW: ["0.1_x__fedprox__d0s0"]}}
    assert text == ("cell 0.1_x mixes 2 code versions: aaaaaaaaaa (runs 0.1_x__fedavg__d0s0, 0.1_x__fedavg__d0s1), "
                    "bbbbbbbbbb (run 0.1_x__fedprox__d0s0)")
    assert describe_mixed_commits(records[2:4]) is None and mixed_commit_cells([]) == {}


def test_a_dirty_checkout_and_a_missing_commit_are_versions_of_their_own() -> None:
    cell = {"alpha": "0.5"}
    records = [record("0.5__fedavg__d0s0", cell, OLD), record("0.5__fedavg__d0s1", cell, OLD, dirty=True),
               record("0.5__fedavg__d0s2", cell, None), record("0.5__fedavg__d0s3", cell, OLD, dirty=True)]

    assert mixed_commit_cells(records) == {"0.5": {OLD: ["0.5__fedavg__d0s0"],
                                                   OLD + "+dirty": ["0.5__fedavg__d0s1", "0.5__fedavg__d0s3"],
                                                   "unknown": ["0.5__fedavg__d0s2"]}}
    assert describe_mixed_commits(records) == (
        "cell 0.5 mixes 3 code versions: aaaaaaaaaa (run 0.5__fedavg__d0s0), aaaaaaaaaa+dirty (runs 0.5__fedavg__d0s1, "
        "0.5__fedavg__d0s3), unknown (run 0.5__fedavg__d0s2)")
    # Two dirty runs of one commit are one version (what the checkout cannot tell apart).
    assert describe_mixed_commits([records[1], records[3]]) is None


def test_long_run_lists_are_cut_after_the_first_ten() -> None:
    cell = {"alpha": "0.5"}
    records = [record(f"0.5__fedavg__d0s{seed}", cell, OLD) for seed in range(13)]
    records.append(record("0.5__fedprox__d0s0", cell, NEW))

    text = describe_mixed_commits(records)

    assert text is not None
    assert "0.5__fedavg__d0s9, ... and 3 more), bbbbbbbbbb (run 0.5__fedprox__d0s0)" in text
    assert "d0s10" not in text and "d0s12" not in text


def test_a_record_carries_the_config_its_hash_was_computed_from() -> None:
    run = expand_study(parse_study({"name": "tiny", "base": copy.deepcopy(BASE), "algorithms": {"fedavg": {}}, "seeds": [1]}))[0]
    metrics = {"history": [{"round": 1, "accuracy": 0.5, "loss": 0.5, "cumulative_bytes": 10}]}

    record = run_record(run, metrics, 0.5, info={"git_commit": OLD, "packages": {"fedplug": "0.1.0"}},
                        provenance={"git_dirty": True})

    assert record["config"] == run.config.model_dump(mode="json")
    assert config_hash(record["config"]) == record["config_hash"]
    assert record["config"]["train"]["seed"] == 1 and record["config"]["data"]["num_clients"] == 4
    assert (record["commit"], record["dirty"], record["fedplug"]) == (OLD, True, "0.1.0")
    assert json.loads(json.dumps(record, separators=(",", ":"))) == record


def test_the_runner_stops_on_a_cell_of_two_commits_and_the_flag_writes_it_without_training(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import fedplug.run_folder

    # Prepare: fedavg trained at commit OLD, then fedavgm (the same cell) at commit NEW.
    spec_path = tiny_spec_file(tmp_path)
    out, results = tmp_path / "out", tmp_path / "results" / "tiny.jsonl"
    runner = load_runner()
    monkeypatch.setattr(runner, "git_dirty", lambda root=None: False)
    command = [str(spec_path), "--no-mlflow", "--out", str(out), "--results", str(results), "--jobs", "1"]
    monkeypatch.setattr(fedplug.run_folder, "git_commit", lambda folder=None: OLD)
    assert runner.main([*command, "--only", "fedavg__"]) == 0
    first, report = results.read_text(), (out / "summary.json").read_text()
    assert [(record["run"], record["commit"]) for record in load_records(results)] == [("0.5__fedavg__d0s0", OLD)]
    monkeypatch.setattr(fedplug.run_folder, "git_commit", lambda folder=None: NEW)

    # Execute / Assert: the second invocation trains fedavgm, then stops before writing.
    with pytest.raises(ConfigError) as stopped:
        runner.main(command)
    message = str(stopped.value)
    assert "\n" not in message
    assert message.startswith("study tiny: cell 0.5 mixes 2 code versions: aaaaaaaaaa (run 0.5__fedavg__d0s0), "
                              "bbbbbbbbbb (run 0.5__fedavgm__d0s0); ")
    assert message.endswith("or pass --allow-mixed-commits to write and report them as they are (the runs trained so "
                            "far stay in their folders and are not trained again)")
    assert results.read_text() == first and (out / "summary.json").read_text() == report  # neither rewritten
    trained = json.loads((out / "0.5__fedavgm__d0s0" / "run_info.json").read_text())
    assert trained["git_commit"] == NEW and (out / "0.5__fedavgm__d0s0" / "metrics.json").is_file()

    # With the flag: the results file is written from the run folders, nothing trains.
    stamps = {path: path.stat().st_mtime_ns for path in out.glob("*/metrics.json")}
    monkeypatch.setattr(runner, "train_one", lambda *args, **kwargs: pytest.fail("nothing should train"))
    capsys.readouterr()
    assert runner.main([*command, "--allow-mixed-commits"]) == 0
    assert "2 runs, 2 done, 0 to train" in capsys.readouterr().out
    records = load_records(results)
    assert [(record["run"], record["commit"]) for record in records] == [("0.5__fedavg__d0s0", OLD),
                                                                         ("0.5__fedavgm__d0s0", NEW)]
    assert {path: path.stat().st_mtime_ns for path in out.glob("*/metrics.json")} == stamps and len(stamps) == 2
    assert all(config_hash(record["config"]) == record["config_hash"] for record in records)
    assert len(results.read_text().splitlines()) == 2  # one compact line per record

    # --report-only checks the same records; records from before `config` existed are reused.
    with pytest.raises(ConfigError, match="cell 0.5 mixes 2 code versions"):
        runner.main([*command, "--report-only"])
    results.write_text("".join(json.dumps({key: value for key, value in record.items() if key != "config"}) + "\n"
                               for record in records))
    fresh = tmp_path / "fresh"
    capsys.readouterr()
    assert runner.main([str(spec_path), "--no-mlflow", "--out", str(fresh), "--results", str(results),
                        "--allow-mixed-commits"]) == 0
    captured = capsys.readouterr()
    assert "2 runs, 2 done (2 from" in captured.out
    assert "WARNING: runs of one cell come from different code (--allow-mixed-commits): cell 0.5 mixes" in captured.err
    assert [record["run"] for record in load_records(results)] == ["0.5__fedavg__d0s0", "0.5__fedavgm__d0s0"]


def test_a_commit_made_while_the_runner_trains_is_not_the_code_its_runs_record(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import fedplug.run_folder

    # Prepare: the runner starts on OLD; after its first run the checkout moves to NEW (a
    # commit made while a long study trains), before the second run trains.
    spec_path = tiny_spec_file(tmp_path)
    out, results = tmp_path / "out", tmp_path / "results" / "tiny.jsonl"
    runner = load_runner()
    monkeypatch.setattr(runner, "git_dirty", lambda root=None: False)
    head = [OLD]
    monkeypatch.setattr(fedplug.run_folder, "git_commit", lambda folder=None: head[0])
    train_one = runner.train_one

    def train_then_commit(*args: Any, **kwargs: Any) -> dict[str, Any]:
        done = train_one(*args, **kwargs)
        head[0] = NEW
        return done

    monkeypatch.setattr(runner, "train_one", train_then_commit)

    # Execute
    assert runner.main([str(spec_path), "--no-mlflow", "--out", str(out), "--results", str(results), "--jobs", "1"]) == 0

    # Assert: both runs record OLD, the code the process imported (run_info.json, written at
    # training time, names NEW for the second: the record prefers the runner's provenance).
    records = load_records(results)
    assert [record["commit"] for record in records] == [OLD, OLD] and len(records) == 2
    assert json.loads((out / records[1]["run"] / "run_info.json").read_text())["git_commit"] == NEW
    assert json.loads((out / records[1]["run"] / "provenance.json").read_text())["git_commit"] == OLD


def clocked(start: str, end: str | None, cores: int | None = 2) -> dict[str, Any]:
    record: dict[str, Any] = {"started_at": f"2026-11-26T{start}+00:00", "host_cores": cores}
    if end is not None:
        record["finished_at"] = f"2026-11-26T{end}+00:00"
    return record


def test_the_wall_time_counts_overlapping_runs_once_and_gaps_not_at_all() -> None:
    """Two runs at once 10:00:00-10:01:00 and 10:00:30-10:02:00 cover 120 s; a third after a
    gap, 10:10:00-10:10:45, adds 45 s: 165 s, at most 2 at once; a run without an end time
    (trained before the runner kept its clock) is counted apart."""
    records = [clocked("10:00:00", "10:01:00"), clocked("10:00:30", "10:02:00"), clocked("10:10:00", "10:10:45", 16),
               clocked("10:20:00", None), {}]

    wall = wall_time(records)

    assert (wall.seconds, wall.most_at_once, wall.cores, wall.timed, wall.untimed) == (165.0, 2, [2, 16], 3, 2)


def test_runs_one_after_another_are_one_at_a_time() -> None:
    """A run that starts the second the previous one ends does not overlap it."""
    wall = wall_time([clocked("10:00:00", "10:01:00"), clocked("10:01:00", "10:01:30")])

    assert (wall.seconds, wall.most_at_once) == (90.0, 1)


def test_the_runner_records_each_runs_clock(tmp_path: Path) -> None:
    """A run trained by the runner keeps when it started and ended and the machine's cores."""
    import os
    from datetime import datetime

    spec_path, out, results = tiny_spec_file(tmp_path), tmp_path / "out", tmp_path / "tiny.jsonl"
    before = datetime.now().astimezone().timestamp()

    assert load_runner().main([str(spec_path), "--no-mlflow", "--jobs", "1", "--out", str(out), "--results", str(results)]) == 0

    after = datetime.now().astimezone().timestamp()
    for record in load_records(results):
        started, finished = (datetime.fromisoformat(record[key]).timestamp() for key in ("started_at", "finished_at"))
        assert int(before) <= started <= finished <= after + 1 and record["host_cores"] == os.cpu_count()


def test_the_studies_stage_allows_mixed_commits_only_where_the_committed_results_mix_them() -> None:
    """``--allow-mixed-commits`` is a per-study flag of the studies' DVC stage: given to
    exactly the studies whose committed results file mixes commits within a cell, so every
    other study (a new one included) is held to one commit per cell."""
    import yaml

    root = Path(__file__).resolve().parents[1]
    stages = yaml.safe_load((root / "pipelines/studies/dvc.yaml").read_text())["stages"]
    stage, tuned = stages["study"], stages["tuned_study"]  # tuned_study: the same, plus the trials file
    entries = {**stage["foreach"], **tuned["foreach"]}
    shipped = {path.stem for path in (root / "pipelines/studies").glob("*.yaml") if path.stem != "dvc"}
    # FEMNIST downloads on a user's machine; the benchmark's entry joins tuned_study with its
    # first records (a stage that never ran would keep `dvc status` of the studies noisy).
    not_yet = {"fedgsp_femnist"} | ({"benchmark"} - {p.stem for p in (root / "pipelines/studies/results").glob("*.jsonl")})
    assert set(entries) == shipped - not_yet
    assert "${item.flags}" in stage["do"]["cmd"] and tuned["do"]["cmd"] == stage["do"]["cmd"]
    for name, entry in entries.items():
        results = root / "pipelines/studies/results" / f"{name}.jsonl"
        mixed = results.is_file() and mixed_commit_cells(load_records(results))
        assert (entry["flags"] == "--allow-mixed-commits") == bool(mixed), name
