"""The resolved plan of a run, printed instead of running it: `fabric-lite explain` and `Trainer(explain=True)`.

The plan is a list of sections of (label, value) lines: hardware and processes, precision, data
sharding, optimization, where checkpoints and logs go, and settings that are given in two places
(the explicit argument wins over the launcher) or that are accepted but have no effect.

Two ways in:

* ``Trainer(..., explain=True).fit(...)`` sets everything up as for training (strategy, model,
  optimizers, prepared loaders), prints the plan on rank 0 and returns: no step, no callback
  set-up, no checkpoint, no log.
* ``fabric-lite explain [launch flags] train.py [args]`` reads the flags and the config file
  exactly as `fabric-lite launch` does, then runs the script here, in ONE process, with
  ``FABRIC_LITE_EXPLAIN`` set (see `environments.read_launch_settings`). The first
  ``Accelerator.prepare(...)`` given a dataloader, or ``Trainer.fit(...)``, prints the plan for the
  world size the real launch would have (nproc_per_node x nnodes; data lines are rank 0's share)
  and exits with status 0, before any training step. While the script runs, the constructor
  arguments of `Accelerator` and `Trainer` are recorded (to report settings given twice or ignored),
  `devices` / `num_nodes` are checked against the planned launch instead of this lone process, and
  `Trainer(devices=N)` does not start itself again.

``FABRIC_LITE_EXPLAIN=1 python train.py`` (or under torchrun) works too: the plan then describes
the processes actually running, without the recorded arguments.
"""

from fabric_lite.explain.plan import SECTIONS, Plan, explain_accelerator, explain_trainer, plan_for_accelerator
from fabric_lite.explain.request import requested
from fabric_lite.explain.trainer_plan import plan_for_trainer
from fabric_lite.explain.shares import Share, loader_share

__all__ = [
    "SECTIONS", "Plan", "requested", "plan_for_accelerator", "plan_for_trainer", "explain_accelerator",
    "explain_trainer", "loader_share", "Share",
]
