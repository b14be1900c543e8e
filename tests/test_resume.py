"""Resume for every stateful part: a run killed at a random round and started again with
the same command ends bit-identical to a run that was never interrupted.

**Which components keep state.** The cases are generated from the registry: every
aggregator, loss transform, sampler and grouper registered by fedplug's built-ins, by any
installed plugin, and by the test-only plugins of ``conformance_plugins`` (installed here
as a third-party distribution with a ``fedplug`` entry point, so the CLI loads them as it
loads any package). Each component, built from its config, is asked about itself:

- ``client_needs().client_state`` is set: it keeps state on each client across rounds
  (SCAFFOLD's c_k), which the simulator checkpoints as ``client_states``;
- or its class implements ``state_dict`` (the interfaces' own returns ``{}``; the sampler
  interface has none, so a sampler keeps state only when it defines one): server-side
  state that the checkpoint must carry (momentum buffers, moments, a global label prior,
  FedDisk's sample weights, a Flower strategy's round count).

A case also checks that the checkpoint the killed run left really holds that state,
non-empty, so a component that claims state but checkpoints nothing fails as well.
Components that keep no state (FedGSP regroups every round from the round's generator,
IWDS draws from ``(seed, round, client)``) have nothing to lose and are not cases.

**Each case** (component x engine): ``fedplug run config.yaml --out OUT --quiet`` is run
and killed with SIGKILL right after the checkpoint of round r is written, r drawn from
``random.Random(seed)`` with ``seed = crc32(case id)`` (printed, so a failure can be
replayed); then the same command runs again and resumes. Its ``metrics.json`` history
(all but the wall-clock ``seconds``), ``model.pt`` and final ``checkpoint.pt`` (global
model, aggregator, loss transform, grouper, client states) must equal, bit for bit, those
of an uninterrupted run: the sequential engine's for the sequential and parallel engines
(which are bit-identical to each other), the vectorized engine's own for the vectorized
engine.

**How the runs are started.** Importing torch and fedplug takes seconds, so one helper
process per module imports them once and forks a fresh child for every command: the
child runs ``fedplug.cli.main(argv)``, the very function ``fedplug run`` calls, with its
own output in a log file. For a killed run the child first wraps
``fedplug.experiment.prepare_experiment`` so that the simulator gets one more round
observer (the simulator calls observers after it has written the round's checkpoint),
which sends SIGKILL to its own process at round r: no hook in fedplug's code.

Also here: ``--no-resume`` (the run starts over at round 1 and overwrites the old
checkpoint) and Ctrl-C: SIGINT to the process group of a real ``python -m fedplug.cli
run`` subprocess (what a terminal sends), exit code 130 with the one line telling to run
the same command again, which then resumes to the uninterrupted result.
"""

from __future__ import annotations

import json
import os
import random
import select
import signal
import subprocess
import sys
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml
from conformance_plugins import make_plugin
from conftest import SMALL_EXPERIMENT

from fedplug.components import Aggregator, Grouper, LossTransform, Sampler
from fedplug.plugins import AUTOLOAD_SWITCH, collect_registry, new_plugin_manager
from fedplug.run.results import RoundRecord

TESTS = Path(__file__).resolve().parent
ROUNDS = 3
ENGINES = ("sequential", "vectorized", "parallel")
REFERENCE_ENGINE = {"sequential": "sequential", "parallel": "sequential", "vectorized": "vectorized"}
"""Whose uninterrupted run each engine's resumed run must equal."""
VOLATILE = {"seconds"}
"""Fields of a round record that measure wall-clock time."""
RUN_TIMEOUT = 300.0

SLOTS = {
    "aggregators": "aggregator",
    "loss_transforms": "loss_transform",
    "samplers": "sampler",
    "groupers": "grouper",
}
INTERFACES = {"aggregators": Aggregator, "loss_transforms": LossTransform, "samplers": Sampler, "groupers": Grouper}
CHECKPOINT_KEYS = {"aggregators": "aggregator", "loss_transforms": "loss_transform", "groupers": "grouper"}
"""Where the simulator's checkpoint keeps each kind's ``state_dict``."""

SETTINGS: dict[str, dict[str, Any]] = {
    "fedavgm": {"momentum": 0.9},
    # Noise seeded by the round count the aggregator keeps: a lost count changes the model.
    "flower": {
        "strategy": "DifferentialPrivacyServerSideFixedClipping",
        "noise_multiplier": 0.1,
        "clipping_norm": 5.0,
        "noise_seed": 7,
    },
    "feddisk": {
        "made_hidden": 8,
        "made_max_epochs": 1,
        "global_rounds": 1,
        "classifier_hidden": 8,
        "classifier_epochs": 1,
    },
    "feddisk_ab": {"classifier_hidden": 8, "classifier_epochs": 1},
}
# FedDisk + FedProx in one slot: the resumed run must restore FedDisk's weights from the
# composite's per-part state.
SETTINGS["composite"] = {"parts": [{"name": "feddisk", **SETTINGS["feddisk"]}, {"name": "fedprox", "mu": 0.1}]}
"""Small settings for components whose defaults are slow or need a parameter."""

PLUGIN_DISTRIBUTION = "fedplug-conformance-plugins"
PLUGIN_ENTRY_POINT = "conformance"


def registry() -> Any:
    """What ``fedplug run`` sees in the helper process: the built-ins, the installed
    plugins and the test-only plugins (there through their entry point)."""
    manager = new_plugin_manager()
    manager.register(make_plugin(), name=PLUGIN_ENTRY_POINT)
    return collect_registry(manager)


def keeps_state(kind: str, component: Any) -> bool:
    """Whether ``component`` says it keeps state (see the module docstring)."""
    needs = component.client_needs() if hasattr(component, "client_needs") else None
    if needs is not None and needs.client_state:
        return True
    own = getattr(type(component), "state_dict", None)
    return own is not None and own is not getattr(INTERFACES[kind], "state_dict", None)


def stateful_components() -> list[tuple[str, str]]:
    """``(kind, name)`` of every registered component that keeps state."""
    found = []
    components = registry()
    for kind in SLOTS:
        for entry in components.entries(kind):
            config = entry.config_class(name=entry.name, **SETTINGS.get(entry.name, {}))
            arguments = (SMALL_EXPERIMENT["data"]["num_clients"],) if kind == "aggregators" else ()
            if keeps_state(kind, components.build(kind, config, *arguments)):
                found.append((kind, entry.name))
    return found


@dataclass(frozen=True)
class Case:
    kind: str
    name: str
    engine: str

    @property
    def id(self) -> str:
        return f"{self.name}-{self.engine}"


CASES = [Case(kind, name, engine) for kind, name in stateful_components() for engine in ENGINES]


def experiment(kind: str, name: str, engine: str, **train: Any) -> dict[str, Any]:
    """A tiny synthetic run (6 clients, ROUNDS rounds) with ``name`` in its slot."""
    data = json.loads(json.dumps(SMALL_EXPERIMENT))
    data["data"]["dataset"].update(num_train=360, num_test=120)
    data["train"].update({"rounds": ROUNDS, "engine": engine, **train})
    if engine == "parallel":
        data["train"]["workers"] = 2
    data["train"][SLOTS[kind]] = {"name": name, **SETTINGS.get(name, {})}
    return data


# ------------------------------------------------------------------- the helper process

HELPER = r"""
import json, os, signal, sys, traceback
import torch
torch.set_num_threads(1)
import fedplug.cli, fedplug.experiment, fedplug.plugins
registry = fedplug.plugins.default_registry()  # imports every plugin once, before forking
# What the children would import on first use, each child again (seconds): torch.func's
# lazy imports on the first grad under vmap (the vectorized engine), and Flower (the
# 'flower' aggregator). Importing starts no thread, so forking stays safe.
from torch.func import grad, vmap
vmap(grad(lambda x: (x * x).sum()))(torch.ones(2, 3))
if "flower" in registry.names("aggregators"):
    import flwr.app, flwr.serverapp.strategy, fedplug.flower_internals
import threading
assert threading.active_count() == 1, threading.enumerate()
print(json.dumps({"aggregators": registry.names("aggregators")}), flush=True)

for line in sys.stdin:
    request = json.loads(line)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(log, 1)
            os.dup2(log, 2)
            kill_round, kill_signal = request["kill_round"], request["signal"]
            if kill_round is not None:
                prepare = fedplug.experiment.prepare_experiment

                def prepare_and_arm(*args, **kwargs):
                    simulator = prepare(*args, **kwargs)

                    def kill(record):  # observers run after the round's checkpoint is written
                        if record.round == kill_round:
                            os.kill(os.getpid(), kill_signal)

                    simulator.observers.append(kill)
                    return simulator

                fedplug.experiment.prepare_experiment = prepare_and_arm
            code = fedplug.cli.main(request["argv"])
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else 1
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    print(json.dumps({"exit": os.waitstatus_to_exitcode(status)}), flush=True)
"""


def plugin_site(folder: Path) -> Path:
    """A folder holding ``conformance_plugins`` as an installed distribution: a module
    whose ``plugin`` is the plugin object, and its ``.dist-info`` with a ``fedplug``
    entry point."""
    folder.mkdir(parents=True)
    (folder / "fedplug_conformance_entry.py").write_text(
        "from conformance_plugins import make_plugin\n\nplugin = make_plugin()\n"
    )
    info = folder / "fedplug_conformance_plugins-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {PLUGIN_DISTRIBUTION}\nVersion: 1.0\n"
    )
    (info / "entry_points.txt").write_text(
        f"[fedplug]\n{PLUGIN_ENTRY_POINT} = fedplug_conformance_entry:plugin\n"
    )
    return folder


def subprocess_environment(site: Path) -> dict[str, str]:
    paths = [str(site), str(TESTS), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "OMP_NUM_THREADS": "1"}
    env["PYTHONUNBUFFERED"] = "1"
    env.pop(AUTOLOAD_SWITCH, None)
    return env


class Runner:
    """Runs ``fedplug`` commands in fresh children of one helper process."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.site = plugin_site(folder / "site")
        self.env = subprocess_environment(self.site)
        self.process = subprocess.Popen(
            [sys.executable, "-c", HELPER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=open(folder / "helper.log", "wb"),  # noqa: SIM115 (closed with the process)
            text=True,
            env=self.env,
            cwd=folder,
        )
        ready = self._reply()
        assert "conformance_momentum" in ready["aggregators"], (
            "the test-only plugins did not load through their entry point"
        )
        self.references: dict[tuple[str, str, str], Path] = {}
        self.count = 0

    def _reply(self) -> dict[str, Any]:
        readable, _, _ = select.select([self.process.stdout], [], [], RUN_TIMEOUT)
        line = self.process.stdout.readline() if readable else ""
        if not line:
            log = (self.folder / "helper.log").read_text()
            raise AssertionError(f"the helper process stopped answering; its log:\n{log}")
        return json.loads(line)

    def run(self, argv: list[str], *, kill_round: int | None = None, sig: int = signal.SIGKILL) -> tuple[int, str]:
        """Exit code (minus the signal's number when killed) and output of ``fedplug
        *argv`` in a fresh child; ``kill_round``: the child signals itself ``sig`` right
        after round ``kill_round``'s checkpoint."""
        self.count += 1
        log = self.folder / f"run-{self.count}.log"
        request = {"argv": argv, "kill_round": kill_round, "signal": int(sig), "log": str(log)}
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        code = self._reply()["exit"]
        return code, log.read_text()

    def reference(self, kind: str, name: str, engine: str) -> Path:
        """The output folder of an uninterrupted run (one per component and engine)."""
        key = (kind, name, engine)
        if key not in self.references:
            folder = self.folder / "references" / f"{name}-{engine}"
            folder.mkdir(parents=True)
            config = write_config(folder / "config.yaml", experiment(kind, name, engine))
            code, output = self.run(command(config, folder / "out"))
            assert code == 0, output
            self.references[key] = folder / "out"
        return self.references[key]

    def close(self) -> None:
        self.process.stdin.close()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


@pytest.fixture(scope="module")
def runner(tmp_path_factory: pytest.TempPathFactory) -> Any:
    helper = Runner(tmp_path_factory.mktemp("resume"))
    yield helper
    helper.close()


def write_config(path: Path, data: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def command(config: Path, out: Path, *extra: str) -> list[str]:
    return ["run", str(config), "--out", str(out), "--quiet", *extra]


# ------------------------------------------------------------------------ comparison


def history(out: Path) -> list[dict[str, Any]]:
    records = json.loads((out / "metrics.json").read_text())["history"]
    return [{key: value for key, value in record.items() if key not in VOLATILE} for record in records]


def checkpoint(out: Path) -> dict[str, Any]:
    return torch.load(out / "checkpoint.pt", map_location="cpu", weights_only=False)


def assert_identical(actual: Any, expected: Any, where: str) -> None:
    """``actual == expected`` bit for bit: tensors and arrays by dtype, shape and every
    element (NaN equal to NaN), containers item by item."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), where
        assert actual.dtype == expected.dtype and actual.shape == expected.shape, where
        assert torch.equal(actual, expected) or (
            actual.is_floating_point() and torch.equal(actual.isnan(), expected.isnan())
            and torch.equal(actual.nan_to_num(), expected.nan_to_num())
        ), where
    elif isinstance(expected, np.ndarray):
        assert isinstance(actual, np.ndarray) and actual.dtype == expected.dtype, where
        assert np.array_equal(actual, expected, equal_nan=expected.dtype.kind == "f"), where
    elif isinstance(expected, dict):
        assert isinstance(actual, dict) and set(actual) == set(expected), f"{where}: keys"
        for key in expected:
            assert_identical(actual[key], expected[key], f"{where}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert type(actual) is type(expected) and len(actual) == len(expected), where
        for index, (mine, theirs) in enumerate(zip(actual, expected)):
            assert_identical(mine, theirs, f"{where}[{index}]")
    elif isinstance(expected, float) and np.isnan(expected):
        assert isinstance(actual, float) and np.isnan(actual), where
    else:
        assert actual == expected, f"{where}: {actual!r} != {expected!r}"


def assert_same_run(resumed: Path, reference: Path) -> None:
    """The resumed run's records, model and final checkpoint equal the reference's."""
    assert history(resumed) == history(reference)
    model, expected_model = (torch.load(out / "model.pt", weights_only=True) for out in (resumed, reference))
    assert_identical(model, expected_model, "model.pt")
    state, expected_state = checkpoint(resumed), checkpoint(reference)
    # The fingerprint names the engine; the history's and the setup's seconds are wall time.
    for key in ("fingerprint", "history", "setup_seconds"):
        state.pop(key), expected_state.pop(key)
    assert_identical(state, expected_state, "checkpoint.pt")


def state_of(kind: str, state: dict[str, Any]) -> Any:
    """What the checkpoint ``state`` holds for a component of ``kind``."""
    return state.get(CHECKPOINT_KEYS.get(kind, f"<no {kind} in the checkpoint>"))


def holds_something(value: Any) -> bool:
    if isinstance(value, dict):
        return any(holds_something(item) for item in value.values())
    if isinstance(value, (list, tuple)):
        return any(holds_something(item) for item in value)
    return value is not None


# ----------------------------------------------------------------------------- tests


@pytest.mark.slow
@pytest.mark.parametrize("case", [pytest.param(case, id=case.id) for case in CASES])
def test_a_run_killed_at_a_random_round_resumes_bit_identically(
    case: Case, runner: Runner, tmp_path: Path
) -> None:
    seed = zlib.crc32(case.id.encode())
    kill_round = random.Random(seed).randint(1, ROUNDS - 1)
    print(f"case {case.id}: seed {seed}, SIGKILL after round {kill_round} of {ROUNDS}")
    config = write_config(tmp_path / "config.yaml", experiment(case.kind, case.name, case.engine))
    out = tmp_path / "out"

    code, output = runner.run(command(config, out), kill_round=kill_round)
    assert code == -signal.SIGKILL, f"the run was not killed (exit {code}):\n{output}"
    assert not (out / "metrics.json").exists()
    partial = checkpoint(out)
    assert [record["round"] for record in partial["history"]] == list(range(1, kill_round + 1))
    client_side = any(holds_something(state) for state in partial["client_states"].values())
    assert holds_something(state_of(case.kind, partial)) or client_side, (
        f"{case.name} says it keeps state, but the checkpoint after round {kill_round} holds none"
    )

    code, output = runner.run(command(config, out))
    assert code == 0, output
    assert_same_run(out, runner.reference(case.kind, case.name, REFERENCE_ENGINE[case.engine]))


@pytest.mark.slow
def test_no_resume_starts_over_and_overwrites_the_checkpoint(runner: Runner, tmp_path: Path) -> None:
    config = write_config(tmp_path / "config.yaml", experiment("aggregators", "fedavgm", "sequential"))
    out = tmp_path / "out"
    code, output = runner.run(command(config, out), kill_round=ROUNDS - 1)
    assert code == -signal.SIGKILL, output
    assert len(checkpoint(out)["history"]) == ROUNDS - 1

    # --no-resume ignores the checkpoint of ROUNDS - 1 rounds: killed after its own round 1,
    # it has replaced that checkpoint with one that holds round 1 only.
    code, output = runner.run(command(config, out, "--no-resume"), kill_round=1)
    assert code == -signal.SIGKILL, output
    reference = runner.reference("aggregators", "fedavgm", "sequential")
    restarted = [
        {key: value for key, value in RoundRecord.from_dict(record).as_dict().items() if key not in VOLATILE}
        for record in checkpoint(out)["history"]
    ]
    assert restarted == history(reference)[:1]

    code, output = runner.run(command(config, out, "--no-resume"))
    assert code == 0, output
    assert [record["round"] for record in history(out)] == list(range(1, ROUNDS + 1))
    assert_same_run(out, reference)


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


CTRL_C_ROUNDS = {"sequential": 40, "parallel": 8}
"""Rounds of the Ctrl-C runs: enough for Ctrl-C, sent once round 1's checkpoint is there,
to land mid-run (the parallel engine forks its workers every round: its rounds are slower)."""


@pytest.mark.slow
@pytest.mark.parametrize("engine", list(CTRL_C_ROUNDS))
def test_ctrl_c_exits_130_and_the_same_command_resumes(runner: Runner, tmp_path: Path, engine: str) -> None:
    """SIGINT to the process group of a real ``python -m fedplug.cli run`` (what a
    terminal's Ctrl-C sends) once its first checkpoint is there: exit code 130, the one
    line telling to run the same command again, and that command (run by the helper)
    resumes to the uninterrupted result. With SCAFFOLD's client states to carry over; on
    the parallel engine the forked workers get the SIGINT too (and ignore it), and the
    main process spends much of each round in fork(), so a Ctrl-C that arrives there
    must not be lost."""
    rounds = CTRL_C_ROUNDS[engine]
    config = write_config(tmp_path / "config.yaml", experiment("aggregators", "scaffold", engine, rounds=rounds))
    out = tmp_path / "out"
    reference = tmp_path / "reference"
    code, output = runner.run(command(config, reference))
    assert code == 0, output

    process = subprocess.Popen(
        [sys.executable, "-m", "fedplug.cli", *command(config, out)],
        env=runner.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, as a shell gives a foreground job
        # ... and Ctrl-C's default action, as a terminal gives a foreground job: a test run
        # started in the background (`make test &`, nohup, some CI runners) ignores SIGINT,
        # and an ignored disposition is inherited, so the CLI would never see the signal
        # (both cases failed that way, "after round 200 of 200", in a backgrounded suite).
        preexec_fn=_default_sigint,
    )
    deadline = time.monotonic() + RUN_TIMEOUT
    while not (out / "checkpoint.pt").exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    if process.poll() is not None:
        raise AssertionError(f"the run ended before Ctrl-C (exit {process.returncode}):\n{process.communicate()[1]}")
    os.killpg(process.pid, signal.SIGINT)
    stdout, stderr = process.communicate(timeout=RUN_TIMEOUT)
    done = len(checkpoint(out)["history"])
    print(f"Ctrl-C landed after round {done} of {rounds}")
    # Before training, the run says once how many torch threads it chose (fedplug/threads.py).
    lines = [line for line in stderr.splitlines() if not line.startswith("fedplug: torch uses ")]
    assert (process.returncode, lines) == (
        130,
        ["fedplug: interrupted; run the same command again to resume from the last round"],
    ), stderr
    assert stdout == ""
    assert 1 <= done < rounds, "Ctrl-C must land mid-run for this test to mean anything"
    assert not (out / "metrics.json").exists()

    code, output = runner.run(command(config, out))
    assert code == 0, output
    assert_same_run(out, reference)
