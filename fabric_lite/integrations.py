"""Which feature observes which door: explain, the Trainer's profiler, preemption and Ray subscribe here.

Imported by the package root, so every door built afterwards is wired (`events.on_construction`); the doors
never import these features. Each function below runs before the door's `__init__`, with the arguments its
caller gave, and imports its feature only when the door needs it.
"""

from __future__ import annotations

from typing import Any, Dict

from fabric_lite.events import FitRun, on_construction

__all__ = ["wire_accelerator", "wire_trainer"]


def wire_accelerator(accelerator: Any, arguments: Dict[str, Any]) -> None:
    """Under `fabric-lite explain`: keep the arguments given, and print the plan at the first
    `prepare(...)` given a dataloader (decided once the door has read the launch environment: `configured`)."""

    def configured(door: Any, config: Any) -> None:
        launch = config.launch
        if launch.explain_dry_run:
            door.explain_arguments = arguments
        if launch.explain is not None:
            door.events.subscribe("prepared", _explain_prepared)

    accelerator.events.subscribe("configured", configured)


def _explain_prepared(accelerator: Any, objects: Any) -> None:
    from torch.utils.data import DataLoader

    if any(isinstance(obj, DataLoader) for obj in objects):
        from fabric_lite.explain import explain_accelerator

        explain_accelerator(accelerator)  # prints the plan and exits 0


def wire_trainer(trainer: Any, arguments: Dict[str, Any]) -> None:
    """The Trainer's `profiler=` as its instrument, `explain=True` (or `fabric-lite explain`) as the plan printed
    in place of training, preemption on every fit, and under Ray, the checkpoint Ray hands the run."""
    from fabric_lite.launch.preemption import TrainerPreemption
    from fabric_lite.profilers import resolve_profiler

    events = trainer.events
    #: Profiles the hooks and steps when given one (`profiler="simple"`, "advanced", "pytorch"); a
    #: PassThroughProfiler otherwise.
    trainer.profiler = profiler = resolve_profiler(arguments.get("profiler"))
    if profiler.enabled:
        events.instrument = profiler
        events.subscribe("stage_start", _start_profile)
        events.subscribe("stage_end", _end_profile)

    def configured(door: Any, config: Any) -> None:
        # (the run config holds the launch environment the Trainer read once)
        if config.explain_dry_run:
            door.explain_arguments = arguments
        if arguments.get("explain") or config.launch.explain is not None:
            door.events.subscribe("prepared", _explain_fit)
        if config.process.started_by_ray:
            door.events.subscribe("fit_start", _ray_resume)

    events.subscribe("configured", configured)
    TrainerPreemption(trainer).subscribe(events)


def _start_profile(trainer: Any, stage: str) -> None:
    profiler = trainer.profiler
    profiler.module = trainer.module  # (for profilers that label its layers)
    # (positional: a profiler written for Lightning names the second argument local_rank)
    profiler.setup(stage, trainer.global_rank if trainer.world_size > 1 else None, trainer.log_dir)


def _end_profile(trainer: Any, stage: str) -> None:
    """Print the stage's report on the main process (each process writes its report file, if it has one)."""
    import sys

    profiler = trainer.profiler
    profiler.log_dir = trainer.log_dir
    text = profiler.describe()
    if text and trainer.is_global_zero:
        print(text, file=sys.stderr, flush=True)
    profiler.teardown(stage)


def _explain_fit(trainer: Any, run: FitRun) -> None:
    from fabric_lite.explain import explain_trainer

    # exits 0 under `fabric-lite explain`; under `--rehearse`, fit trains up to its first optimizer step
    run.train = explain_trainer(trainer, run.module, run.ckpt_path)


def _ray_resume(trainer: Any, run: FitRun) -> None:
    if run.ckpt_path in (None, "last"):
        from fabric_lite.ray import resume_checkpoint

        run.ckpt_path = resume_checkpoint(trainer, run.ckpt_path)


on_construction("Accelerator", wire_accelerator)
on_construction("Trainer", wire_trainer)
