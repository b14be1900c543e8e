"""``fedplug check-plugin NAME`` on installed plugins: one that passes every check, and one
whose components each carry one deliberate defect that its check names.

The plugins are installed as distributions (a module and a ``.dist-info`` with a
``fedplug`` entry point in a folder on ``PYTHONPATH``), and the command runs as a user
runs it, in a subprocess.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from fedplug.plugins import AUTOLOAD_SWITCH

GOOD_PLUGIN = '''
"""A well-behaved plugin: the README's damped average and a sampler with state-free rng use."""
from typing import Literal

import numpy as np
from pydantic import Field

from fedplug.components import Aggregator, ComponentConfig, Sampler, WeightedMean
from fedplug.hookspecs import hookimpl


class DampedAvgConfig(ComponentConfig):
    """FedAvg that moves only part of the way to the clients' mean."""

    name: Literal["damped_avg"] = "damped_avg"
    step: float = Field(0.5, gt=0, le=1)
    """Share of the way to move (1.0 = FedAvg)."""


class DampedAvg(Aggregator):
    def __init__(self, config: DampedAvgConfig, num_clients: int) -> None:
        super().__init__(num_clients)
        self.step = config.step

    def aggregate(self, global_vector, updates):
        mean = WeightedMean()
        for update in updates:
            mean.add(update.vector, update.weight)
        return global_vector + self.step * (mean.mean() - global_vector)


class ReversedConfig(ComponentConfig):
    """Visits a client's samples in a shuffled order, then the same order reversed."""

    name: Literal["shuffle_twice"] = "shuffle_twice"


class ShuffleTwice(Sampler):
    def __init__(self, config: ReversedConfig) -> None:
        pass

    def epoch_indices(self, labels, class_counts, round_index, rng):
        order = rng.permutation(len(labels))
        return np.concatenate([order, order[::-1]])


@hookimpl
def fedplug_register_aggregators(register):
    register("damped_avg", DampedAvgConfig, DampedAvg)


@hookimpl
def fedplug_register_samplers(register):
    register("shuffle_twice", ReversedConfig, ShuffleTwice)
'''

DEFECTIVE_PLUGIN = '''
"""One defect per component."""
from typing import Literal

import numpy as np
from pydantic import ConfigDict, Field

from fedplug.components import Aggregator, ComponentConfig, Sampler, WeightedMean
from fedplug.hookspecs import hookimpl


class ForgetfulConfig(ComponentConfig):
    """Server momentum that forgets its buffer on resume (no state_dict)."""

    name: Literal["forgetful_momentum"] = "forgetful_momentum"
    momentum: float = Field(0.9, ge=0, lt=1)
    """Server momentum."""


class Forgetful(Aggregator):
    def __init__(self, config: ForgetfulConfig, num_clients: int) -> None:
        super().__init__(num_clients)
        self.momentum = config.momentum
        self.buffer = None

    def aggregate(self, global_vector, updates):
        mean = WeightedMean()
        for update in updates:
            mean.add(update.vector, update.weight)
        step = mean.mean() - global_vector
        self.buffer = step if self.buffer is None else self.momentum * self.buffer + step
        return global_vector + self.buffer


class UndocumentedConfig(ComponentConfig):
    """FedAvg with a parameter nobody explained."""

    name: Literal["undocumented_avg"] = "undocumented_avg"
    scale: float = Field(1.0, gt=0)


class Undocumented(Aggregator):
    def __init__(self, config: UndocumentedConfig, num_clients: int) -> None:
        super().__init__(num_clients)

    def aggregate(self, global_vector, updates):
        mean = WeightedMean()
        for update in updates:
            mean.add(update.vector, update.weight)
        return mean.mean()


class LooseConfig(ComponentConfig):
    """Uniform sampling whose config accepts any key."""

    model_config = ConfigDict(extra="allow")
    name: Literal["loose_uniform"] = "loose_uniform"


class ClockSamplerConfig(ComponentConfig):
    """Shuffles with numpy's global generator instead of the rng it is given."""

    name: Literal["global_random"] = "global_random"


class GlobalRandom(Sampler):
    def __init__(self, config) -> None:
        pass

    def epoch_indices(self, labels, class_counts, round_index, rng):
        return np.random.permutation(len(labels))


@hookimpl
def fedplug_register_aggregators(register):
    register("forgetful_momentum", ForgetfulConfig, Forgetful)
    register("undocumented_avg", UndocumentedConfig, Undocumented)


@hookimpl
def fedplug_register_samplers(register):
    register("loose_uniform", LooseConfig, GlobalRandom)
    register("global_random", ClockSamplerConfig, GlobalRandom)
'''


def install(site: Path, distribution: str, entry_point: str, module: str, source: str) -> None:
    """Put ``source`` on ``site`` as module ``module`` of an installed ``distribution``."""
    site.mkdir(parents=True, exist_ok=True)
    (site / f"{module}.py").write_text(textwrap.dedent(source))
    info = site / f"{distribution.replace('-', '_')}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {distribution}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[fedplug]\n{entry_point} = {module}\n")


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("site")
    install(folder, "fedplug-damped-avg", "damped-avg", "fedplug_damped_avg", GOOD_PLUGIN)
    install(folder, "fedplug-defects", "defects", "fedplug_defects", DEFECTIVE_PLUGIN)
    return folder


def check_plugin(site: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), *filter(None, [os.environ.get("PYTHONPATH")])])}
    env.pop(AUTOLOAD_SWITCH, None)
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.run(
        [sys.executable, "-m", "fedplug.cli", "check-plugin", *argv],
        capture_output=True, text=True, env=env, timeout=600, check=False,
    )


def lines_by_check(stdout: str) -> dict[tuple[str, str], str]:
    """``{(subject, check): line}`` of the command's output."""
    found = {}
    for line in stdout.splitlines():
        _verdict, rest = line.split("  ", 1)
        subject, check, _ = rest.split(": ", 2)
        found[(subject, check)] = line
    return found


def test_a_conforming_plugin_passes_every_check(site: Path) -> None:
    # Execute: by the distribution's name, as `pip install` knows it.
    completed = check_plugin(site, "fedplug-damped-avg")
    # Assert
    assert completed.returncode == 0, completed.stdout + completed.stderr
    lines = lines_by_check(completed.stdout)
    checks = ("docs", "config", "simulator", "deterministic", "resume", "engines", "flower")
    for subject in ("aggregator damped_avg", "sampler shuffle_twice"):
        for check in checks:
            assert lines[(subject, check)].startswith("PASS"), lines[(subject, check)]
    assert lines[("plugin damped-avg", "load")].startswith("PASS")
    assert "0 fail" in completed.stderr


def test_each_defect_fails_its_check_with_what_to_fix(site: Path) -> None:
    # Execute: by the entry point's name.
    completed = check_plugin(site, "defects")
    # Assert: exit 1; each component fails the check of its defect, with the fix.
    assert completed.returncode == 1, completed.stdout + completed.stderr
    lines = lines_by_check(completed.stdout)
    resume = lines[("aggregator forgetful_momentum", "resume")]
    assert resume.startswith("FAIL") and "state_dict()" in resume
    assert lines[("aggregator forgetful_momentum", "deterministic")].startswith("PASS")
    docs = lines[("aggregator undocumented_avg", "docs")]
    assert docs.startswith("FAIL") and "scale" in docs and "fedplug list" in docs
    assert lines[("aggregator undocumented_avg", "resume")].startswith("PASS")
    loose = lines[("sampler loose_uniform", "config")]
    assert loose.startswith("FAIL") and "no_such_parameter" in loose
    assert lines[("sampler loose_uniform", "simulator")].startswith("SKIP")
    deterministic = lines[("sampler global_random", "deterministic")]
    assert deterministic.startswith("FAIL") and "rng" in deterministic
    assert lines[("sampler global_random", "resume")].startswith("SKIP")
    # The four defects, and nothing else, fail.
    assert [line for line in completed.stdout.splitlines() if line.startswith("FAIL")] == [
        deterministic, loose, lines[("aggregator forgetful_momentum", "resume")], docs
    ]
    assert completed.stderr.strip().splitlines()[-1].endswith("17 pass, 4 fail, 8 skip")


def test_an_unknown_plugin_is_one_line_listing_the_installed_ones(site: Path) -> None:
    completed = check_plugin(site, "no-such-plugin")
    assert completed.returncode == 2
    assert completed.stdout == ""
    [line] = completed.stderr.strip().splitlines()
    assert "no installed fedplug plugin 'no-such-plugin'" in line
    assert "damped-avg" in line and "defects" in line


def readme_block(first_line: str, language: str) -> str:
    """The README.md block of ``language`` whose first line is ``first_line``."""
    text = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    match = re.search(rf"```{language}\n({re.escape(first_line)}\n.*?)```", text, flags=re.DOTALL)
    assert match, f"README.md has no {language} block starting {first_line!r}"
    return match.group(1)


def test_the_readmes_plugin_installs_and_passes_check_plugin(tmp_path: Path) -> None:
    # Prepare: the README's plugin module and pyproject.toml in a folder that also holds
    # another script (what needs its py-modules line), installed as pip installs it.
    project = tmp_path / "my-plugin"
    project.mkdir()
    (project / "my_plugin.py").write_text(readme_block("# my_plugin.py", "python"))
    (project / "pyproject.toml").write_text(readme_block("# the plugin's pyproject.toml, beside my_plugin.py", "toml"))
    (project / "try_it.py").write_text("print('a script beside the plugin')\n")
    site = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
         "--target", str(site), str(project)],
        check=True, capture_output=True, text=True, timeout=300,
    )
    # Execute: as the README says.
    completed = check_plugin(site, "damped-avg")
    # Assert: only the plugin's module was installed, and every check passes.
    assert not (site / "try_it.py").exists()
    assert completed.returncode == 0, completed.stdout + completed.stderr
    verdicts = [line.split()[0] for line in completed.stdout.splitlines()]
    assert verdicts == ["PASS"] * 8, completed.stdout
