"""The experiment config rejects every mistake before work starts, naming its path."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from fedplug.config import apply_override, deep_merge, flatten, load_experiment, validate_experiment, validate_section
from fedplug.errors import ConfigError


def _error(data) -> str:
    with pytest.raises(ConfigError) as caught:
        validate_experiment(data)
    return str(caught.value)


def test_valid_config_fills_default_slots(small_experiment):
    config = validate_experiment(small_experiment)
    assert config.train.aggregator.name == "fedavg"
    assert config.train.sampler.name == "uniform"
    assert config.train.loss_transform.name == "cross_entropy"
    assert config.train.grouper.name == "none"
    assert config.data.partition.alpha == 0.5


def test_typo_in_algorithm_parameter_names_the_exact_path(small_experiment):
    small_experiment["train"]["aggregator"] = {"name": "fedavgm", "momentun": 0.9}
    message = _error(small_experiment)
    assert "train.aggregator.momentun: unknown key" in message


def test_out_of_range_value_names_the_path(small_experiment):
    small_experiment["train"]["aggregator"] = {"name": "fedavgm", "momentum": 1.5}
    message = _error(small_experiment)
    assert "train.aggregator.momentum:" in message and "less than 1" in message


def test_unknown_plugin_name_lists_the_registered_ones(small_experiment):
    small_experiment["train"]["aggregator"] = {"name": "fedavgx"}
    message = _error(small_experiment)
    assert "train.aggregator: unknown aggregator 'fedavgx'" in message
    for known in ("fedavg", "fedavgm", "scaffold", "fednova"):
        assert known in message


def test_unknown_top_level_and_section_keys_are_errors(small_experiment):
    small_experiment["trian"] = {}
    small_experiment["train"]["round"] = 3
    message = _error(small_experiment)
    assert "trian: unknown key" in message
    assert "train.round: unknown key" in message


def test_incompatible_combination_is_rejected_with_a_reason(small_experiment):
    small_experiment["train"]["aggregator"] = {"name": "scaffold"}
    small_experiment["train"]["optimizer"] = {"name": "sgd", "lr": 0.1, "momentum": 0.9}
    message = _error(small_experiment)
    assert "train: incompatible combination" in message and "scaffold" in message


def test_vectorized_engine_rejects_adam(small_experiment):
    small_experiment["train"]["engine"] = "vectorized"
    small_experiment["train"]["optimizer"] = {"name": "adam", "lr": 0.01}
    assert "vectorized" in _error(small_experiment)


def test_algorithm_entries_are_validated_with_their_own_path(small_experiment):
    small_experiment["algorithms"] = {"prox": {"loss_transform": {"name": "fedprox", "mu": -1}}}
    message = _error(small_experiment)
    assert "algorithms.prox.loss_transform.mu:" in message


def test_set_override_switches_and_tunes_components(small_experiment):
    data = apply_override(small_experiment, "train.aggregator=fedavgm")
    data = apply_override(data, "train.aggregator.momentum=0.5")
    data = apply_override(data, "train.rounds=7")
    config = validate_experiment(data)
    assert config.train.aggregator.name == "fedavgm"
    assert config.train.aggregator.momentum == 0.5
    assert config.train.rounds == 7


def test_bad_override_syntax_is_a_config_error():
    with pytest.raises(ConfigError, match="expected dotted.key=value"):
        apply_override({}, "train.rounds")


def test_deep_merge_replaces_a_component_whose_name_changes():
    base = {"aggregator": {"name": "fedavgm", "momentum": 0.9}}
    assert deep_merge(base, {"aggregator": {"name": "fedavg"}}) == {"aggregator": {"name": "fedavg"}}
    assert deep_merge(base, {"aggregator": {"momentum": 0.5}}) == {"aggregator": {"name": "fedavgm", "momentum": 0.5}}


def test_unreadable_yaml_names_file_and_line(tmp_path):
    path = tmp_path / "params.yaml"
    path.write_text("train:\n  rounds: [1, 2\n")
    with pytest.raises(ConfigError, match=r"params.yaml: not valid YAML at line"):
        load_experiment(path)


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_experiment(tmp_path / "nope.yaml")


def test_sections_validate_alone_with_prefixed_paths(small_experiment):
    data = validate_section("data", small_experiment["data"])
    assert data.num_clients == 6
    with pytest.raises(ConfigError, match="data.num_clients: Input should be greater than or equal to 1"):
        validate_section("data", {**small_experiment["data"], "num_clients": 0})


def test_flatten_gives_dotted_params(small_experiment):
    flat = flatten(validate_experiment(small_experiment))
    assert flat["train.aggregator.name"] == "fedavg"
    assert flat["data.partition.alpha"] == 0.5
    assert flat["train.optimizer.lr"] == 0.5


def test_repository_params_yaml_is_a_valid_config():
    config = load_experiment("params.yaml")
    assert config.data.dataset.name == "mnist"
    assert set(config.algorithms) >= {"fedavg", "fedprox", "fedavgm", "iwds", "fedshift", "fedgsp"}


def test_override_that_clashes_only_with_an_entry_not_being_run(small_experiment):
    small_experiment["algorithms"] = {"gsp": {"grouper": {"name": "fedgsp"}}}
    small_experiment["train"]["aggregator"] = {"name": "scaffold"}
    with pytest.raises(ConfigError, match=r"algorithms.gsp: incompatible combination"):
        validate_experiment(small_experiment)
    config = validate_experiment(small_experiment, check_every_algorithm=False)
    assert config.train.aggregator.name == "scaffold"
    small_experiment["algorithms"]["gsp"]["grouper"]["mdoe"] = "naive"
    with pytest.raises(ConfigError, match=r"algorithms.gsp.grouper.mdoe: unknown key"):
        validate_experiment(small_experiment, check_every_algorithm=False)


def test_unknown_key_suggests_the_closest_known_key(small_experiment, tmp_path):
    """A misspelt key names the key it probably meant, at every depth, in the file and in --set."""
    small_experiment["train"]["round"] = 3
    small_experiment["train"]["aggregator"] = {"name": "fedavgm", "momentun": 0.5}
    small_experiment["trian"] = {}
    small_experiment["algorithms"] = {"prox": {"loss_transform": {"name": "fedprox", "muu": 0.1}}}
    message = _error(small_experiment)
    assert "train.round: unknown key; did you mean train.rounds?" in message
    assert "train.aggregator.momentun: unknown key; did you mean train.aggregator.momentum?" in message
    assert "trian: unknown key; did you mean train?" in message
    del small_experiment["train"]["round"], small_experiment["trian"]
    small_experiment["train"]["aggregator"] = "fedavg"
    assert "algorithms.prox.loss_transform.muu: unknown key; did you mean algorithms.prox.loss_transform.mu?" in _error(
        small_experiment
    )
    del small_experiment["algorithms"]
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(small_experiment))
    with pytest.raises(ConfigError, match=r"train\.optimiser: unknown key; did you mean train\.optimizer\?"):
        load_experiment(path, ["train.optimiser.lr=0.1"])
    with pytest.raises(ConfigError, match=r"data\.num_clientz: unknown key; did you mean data\.num_clients\?"):
        validate_section("data", {**small_experiment["data"], "num_clientz": 3})
    # Nothing close: the plain hint stays.
    small_experiment["train"]["zzz"] = 1
    assert "train.zzz: unknown key (check the spelling" in _error(small_experiment)


def test_set_without_a_value_says_how_to_write_it():
    with pytest.raises(ConfigError) as caught:
        apply_override({}, "train.rounds")
    assert "write --set train.rounds=VALUE (or --set train.rounds VALUE)" in str(caught.value)
    assert len(str(caught.value).splitlines()) == 1


def test_relative_data_root_is_read_against_the_config_files_folder(small_experiment, tmp_path, monkeypatch):
    small_experiment["data"]["root"] = "files/raw"
    (tmp_path / "project").mkdir()
    path = tmp_path / "project" / "params.yaml"
    path.write_text(yaml.safe_dump(small_experiment))
    monkeypatch.chdir(tmp_path)
    config = load_experiment("project/params.yaml")
    assert config.data.root_path().resolve() == tmp_path / "project" / "files" / "raw"
    assert config.model_dump(mode="json")["data"]["root"] == "files/raw"  # as written
    assert validate_experiment(small_experiment).data.root_path() == Path("files/raw")  # built in code: the cwd
    small_experiment["data"]["root"] = str(tmp_path / "abs")
    path.write_text(yaml.safe_dump(small_experiment))
    assert load_experiment(path).data.root_path() == tmp_path / "abs"
