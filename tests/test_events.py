"""The doors' events (fabric_lite/events.py) and the features that observe them (fabric_lite/integrations.py)."""

import ast
from pathlib import Path

import pytest

import fabric_lite
from fabric_lite.events import EVENTS, EventBus, announces_construction, on_construction

PACKAGE = Path(fabric_lite.__file__).parent
CORE = ("accelerator", "trainer", "strategies", "data", "checkpoint", "engine.py")
FEATURES = ("fabric_lite.explain", "fabric_lite.ray", "fabric_lite.profilers")


def test_a_bus_calls_the_observers_of_an_event_in_order_and_refuses_unknown_events():
    bus, heard = EventBus(), []
    assert all(getattr(bus, event) == [] for event in EVENTS) and bus.instrument is None
    bus.subscribe("step", lambda *args: heard.append(("a", args)))
    bus.subscribe("step", lambda *args: heard.append(("b", args)))
    bus.emit("step", "trainer", 3)
    assert heard == [("a", ("trainer", 3)), ("b", ("trainer", 3))]
    with pytest.raises(ValueError, match="Unknown event 'stpe'"):
        bus.subscribe("stpe", print)


def test_construction_hands_the_arguments_given_to_the_wiring_before_init():
    seen = []

    class Door:
        @announces_construction
        def __init__(self, a, b=2, **rest):
            seen.append(("init", self.events is not None))

    on_construction("Door", lambda door, arguments: seen.append(("wired", arguments)))
    Door(1, c=3)
    assert seen == [("wired", {"a": 1, "rest": {"c": 3}}), ("init", True)]


def test_a_trainer_without_features_has_no_instrument_and_only_preemption_observes_its_steps(tmp_path):
    from fabric_lite import Trainer
    from fabric_lite.launch.preemption import TrainerPreemption

    trainer = Trainer(accelerator="cpu", default_root_dir=str(tmp_path), enable_progress_bar=False)
    assert trainer.events.instrument is None and not trainer.profiler.enabled
    assert [type(o.__self__) for o in trainer.events.step] == [TrainerPreemption]
    assert trainer.events.prepared == [] and trainer.events.stage_start == []
    profiled = Trainer(accelerator="cpu", default_root_dir=str(tmp_path), profiler="simple")
    assert profiled.events.instrument is profiled.profiler


def _imports(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            yield node.module
            yield from (f"{node.module}.{alias.name}" for alias in node.names)


def test_no_core_module_imports_a_feature_that_observes_the_doors():
    files = [p for name in CORE for p in ((PACKAGE / name).rglob("*.py") if (PACKAGE / name).is_dir()
                                          else [PACKAGE / name])]
    found = [(str(p.relative_to(PACKAGE)), name) for p in files for name in _imports(p)
             if any(name == f or name.startswith(f + ".") for f in FEATURES)]
    assert found == []
