"""In-range extremes (issue 29, finding 10): values the config's types allow that used to
end in a traceback or a run that dropped every client.

- ``train.failures.client_timeout_seconds=1e10`` armed ``setitimer`` past what the
  platform holds (``OverflowError: timestamp out of range``) and every client was dropped:
  the config now stops at :data:`~fedplug.deadline.LONGEST_CLIENT_TIMEOUT_SECONDS`, and
  a deadline too far for the platform's timers (a vectorised block, a T a Flower server
  sent) is armed for the longest they hold.
- ``train.seed=10**23``: ``Overflow when unpacking long long`` from torch; seeds are
  bounded by :data:`~fedplug.config.MAX_SEED`.
- YAML or ``--set`` nested 5,000 deep: ``RecursionError`` inside PyYAML; now one line.
- ``hidden=[65536]*3`` or synthetic ``num_train=1e7 x num_features=1e5``: allocator
  tracebacks; now refused before allocating, with the key and the estimate.
- No default reply wait on FedML: a hung worker stalled a step forever without T.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

import fedplug.memory
from fedplug.config import MAX_NESTING, MAX_SEED, apply_override, read_yaml, validate_experiment
from fedplug.deadline import LONGEST_CLIENT_TIMEOUT_SECONDS, ClientTimeout, deadline
from fedplug.errors import ConfigError
from fedplug.experiment import run_experiment
from fedplug.plugins import default_registry

GIGABYTE = 1_000_000_000


def _one_line(error: pytest.ExceptionInfo[BaseException]) -> str:
    """The message of a refusal that must be one line (after the ``invalid config:``
    heading of a validation error)."""
    lines = str(error.value).removeprefix("invalid config:\n").splitlines()
    assert len(lines) == 1, str(error.value)
    return lines[0]


# ----------------------------------------------------------------- client timeouts


def test_a_client_timeout_past_the_bound_is_refused_in_one_line(small_experiment: dict[str, Any]) -> None:
    small_experiment["train"]["failures"] = {"client_timeout_seconds": 1e10}

    with pytest.raises(ConfigError) as error:
        validate_experiment(small_experiment)

    assert _one_line(error) == (
        "train.failures.client_timeout_seconds: Input should be less than or equal to 1000000"
    )


@pytest.mark.parametrize("engine", ["sequential", "vectorized", "parallel"])
def test_the_longest_client_timeout_trains_every_client_on_every_engine(
    small_experiment: dict[str, Any], engine: str
) -> None:
    # Prepare: the largest T the config allows; engine vectorized runs a block of n
    # chains under n x T, past what setitimer holds.
    small_experiment["train"].update(
        engine=engine, failures={"client_timeout_seconds": LONGEST_CLIENT_TIMEOUT_SECONDS}
    )
    if engine == "parallel":
        small_experiment["train"]["workers"] = 2
    config = validate_experiment(small_experiment)

    # Execute
    result, _ = run_experiment(config, None)

    # Assert: nobody dropped, every round kept every sampled client
    assert [record.failures for record in result.history] == [0, 0, 0]
    assert all(record.participants == 3 and not record.dropped for record in result.history)


@pytest.mark.parametrize("in_thread", [False, True], ids=["main-thread", "other-thread"])
def test_a_deadline_beyond_the_platform_timers_is_armed_and_an_inner_one_still_fires(
    in_thread: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    outcome: list[Any] = []
    crashed: list[BaseException | None] = []  # the watchdog thread's own errors
    monkeypatch.setattr(threading, "excepthook", lambda args: crashed.append(args.exc_value))

    def body() -> None:
        try:
            with deadline(1e10, "outer"):  # setitimer/Event.wait overflow above ~9.2e9 s
                with deadline(0.05, "inner"):
                    while True:
                        time.sleep(0.001)
        except ClientTimeout as error:
            outcome.append(error.what)
        with deadline(float("inf")):
            outcome.append("no limit reached")

    if in_thread:
        thread = threading.Thread(target=body)
        thread.start()
        thread.join(10)
    else:
        body()

    assert outcome == ["inner", "no limit reached"]
    assert crashed == []


# ------------------------------------------------------------------------- seeds


@pytest.mark.parametrize("key", ["train.seed", "data.seed"])
def test_a_seed_past_32_bits_is_refused_in_one_line(small_experiment: dict[str, Any], key: str) -> None:
    data = apply_override(small_experiment, f"{key}={10**23}")

    with pytest.raises(ConfigError) as error:
        validate_experiment(data)

    assert _one_line(error) == f"{key}: Input should be less than or equal to {MAX_SEED}"


def test_the_largest_seeds_train(small_experiment: dict[str, Any]) -> None:
    small_experiment["train"].update(seed=MAX_SEED, rounds=1)
    small_experiment["data"]["seed"] = MAX_SEED
    small_experiment["study"]["seeds"] = [MAX_SEED]

    result, _ = run_experiment(validate_experiment(small_experiment), None)

    assert len(result.history) == 1


# ---------------------------------------------------------------------- nesting


@pytest.mark.parametrize(
    ("shape", "depth"),
    [("flow-list", 5_000), ("flow-list", 20_000), ("flow-mapping", 20_000), ("block-mapping", 5_000)],
)
def test_a_config_file_nested_thousands_deep_is_refused_in_one_line(tmp_path: Path, shape: str, depth: int) -> None:
    if shape == "flow-list":
        value = "[" * depth + "]" * depth
    elif shape == "flow-mapping":
        value = "{a: " * depth + "1" + "}" * depth
    else:
        value = "\n" + "".join(" " * (level + 4) + "a:\n" for level in range(depth)) + " " * (depth + 4) + "1"
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump({"train": {"rounds": 1}}) + "algorithms:\n  deep: " + value + "\n")

    with pytest.raises(ConfigError) as error:
        read_yaml(path)

    message = _one_line(error)
    assert message.startswith(f"{path}: nested more than {MAX_NESTING} levels deep at line ")
    assert "a fedplug config nests fewer than 10 levels" in message


def test_a_config_nested_to_the_limit_still_loads(tmp_path: Path) -> None:
    path = tmp_path / "params.yaml"
    path.write_text("algorithms:\n  deep: " + "[" * (MAX_NESTING - 2) + "]" * (MAX_NESTING - 2) + "\n")

    assert read_yaml(path)["algorithms"]["deep"] is not None


@pytest.mark.parametrize("depth", [5_000, 20_000])
def test_a_set_value_nested_thousands_deep_is_refused_in_one_line(depth: int) -> None:
    with pytest.raises(ConfigError) as error:
        apply_override({}, "train.rounds=" + "[" * depth + "]" * depth)

    message = _one_line(error)
    assert message.startswith("--set 'train.rounds=[[[[")
    assert f"characters): the value is nested more than {MAX_NESTING} levels deep" in message
    assert len(message) < 300


def test_a_set_key_of_thousands_of_parts_is_refused_in_one_line() -> None:
    with pytest.raises(ConfigError) as error:
        apply_override({}, "train." + ".".join(["a"] * 20_000) + "=1")

    assert f"the key has 20001 parts, more than {MAX_NESTING}" in _one_line(error)


# ------------------------------------------------------------------------ memory


@pytest.fixture
def sixteen_gigabytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The machine has 16 GB available, whatever it really has: the messages are fixed."""
    monkeypatch.setattr(fedplug.memory, "available_bytes", lambda: 16 * GIGABYTE)


def test_a_model_larger_than_memory_is_refused_before_it_is_allocated(
    sixteen_gigabytes: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    from fedplug.config import validate_section

    registry = default_registry()
    config = validate_section("train", {"model": {"name": "mlp", "hidden": [65536, 65536, 65536]}}, registry)
    allocated: list[Any] = []
    monkeypatch.setattr(torch.nn.Linear, "reset_parameters", lambda self: allocated.append(self.weight.device))

    with pytest.raises(ConfigError) as error:
        registry.build("models", config.model, (8,), 4)

    assert _one_line(error) == (
        "train.model (name: mlp, hidden: [65536, 65536, 65536]) on inputs (8,): 8.59e+09 parameters: needs about "
        "137 GB of memory, more than the 16 GB this machine has available; use a smaller model (fewer or narrower "
        "layers)"
    )
    assert {str(device) for device in allocated} <= {"meta"}  # nothing was built for real


def test_the_memory_check_leaves_the_weights_as_they_were(sixteen_gigabytes: None) -> None:
    from fedplug.config import validate_section
    from fedplug.models.zoo import build_mlp

    registry = default_registry()
    config = validate_section("train", {"model": {"name": "mlp", "hidden": [16, 8]}}, registry)
    torch.manual_seed(3)
    checked = registry.build("models", config.model, (12,), 4)
    torch.manual_seed(3)
    plain = build_mlp(config.model, (12,), 4)

    assert all(torch.equal(a, b) for a, b in zip(checked.state_dict().values(), plain.state_dict().values()))


def test_an_allocation_that_fails_anyway_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    from fedplug.config import validate_section
    from fedplug.models import zoo

    registry = default_registry()
    config = validate_section("train", {"model": {"name": "mlp", "hidden": [16]}}, registry)
    real_build = zoo.build_mlp

    def refuse(model_config: Any, input_shape: tuple[int, ...], num_classes: int) -> Any:
        if torch.empty(0).device.type == "meta":
            return real_build(model_config, input_shape, num_classes)
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory")

    build = zoo.with_memory_check(refuse)

    with pytest.raises(ConfigError) as error:
        build(config.model, (12,), 4)

    assert _one_line(error).endswith("the allocation failed; use a smaller model (fewer or narrower layers)")


def test_a_synthetic_dataset_larger_than_memory_is_refused_before_it_is_drawn(
    small_experiment: dict[str, Any],
) -> None:
    # 1e7 x 1e5 values: terabytes, more than any machine this runs on (4 bytes each:
    # the float32 result; the generator's float64 temporaries are a few fixed blocks).
    small_experiment["data"]["dataset"].update(num_train=10_000_000, num_features=100_000)
    config = validate_experiment(small_experiment)

    started = time.monotonic()
    with pytest.raises(ConfigError) as error:
        run_experiment(config, None)

    message = _one_line(error)
    assert message.startswith(
        "data.dataset (synthetic) num_train + num_test = 10000200 samples x num_features = 100000: needs about 4 TB"
    )
    assert message.endswith("use fewer samples or features")
    assert time.monotonic() - started < 30


# -------------------------------------------------------- FedML's default reply wait


def test_fedml_waits_an_hour_for_a_step_when_no_client_timeout_is_set(small_experiment: dict[str, Any]) -> None:
    # Prepare: FedML's server state for the small experiment, without T, on a fake clock
    from fedplug.adapters.fedml.coordinator import Coordinator
    from fedplug.adapters.fedml.deadlines import DEFAULT_STEP_WAIT_SECONDS, StepDeadlines
    from fedplug.adapters.fedml.protocol import plan_rounds
    from fedplug.data.build import build_federation

    config = validate_experiment(small_experiment)
    registry = default_registry()
    federation = build_federation(config.data, registry)
    coordinator = Coordinator(config.train, federation, registry, plan_rounds(config.train, registry,
                                                                              federation.class_counts), 2)
    now = [100.0]
    deadlines = StepDeadlines(coordinator, clock=lambda: now[0])

    # Execute: the step's instructions go out; one worker with tasks hangs, the other replies
    silent = next(slot for slot in range(2) if coordinator.message[slot].tasks)
    deadlines.start_step()
    assert deadlines.take(1 - silent, {"fedplug_step": coordinator.step}) is None
    now[0] = 100.0 + DEFAULT_STEP_WAIT_SECONDS - 1
    before = deadlines.overdue(2)
    now[0] = 100.0 + DEFAULT_STEP_WAIT_SECONDS
    after = deadlines.overdue(2)
    stand_in = deadlines.timeout_reply(silent)

    # Assert: an hour, as Flower's Strategy.start(timeout=3600); then its tasks fail
    assert DEFAULT_STEP_WAIT_SECONDS == 3600.0
    assert deadlines.active and (before, after) == ([], [silent])
    errors = [result.error for result in stand_in["results"]]
    assert errors and all(
        "sent no reply within 3600s (the server's wait for a step; train.failures.client_timeout_seconds is unset)"
        in error for error in errors
    )
