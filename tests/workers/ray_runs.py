"""A Ray driver: runs fabric_lite in Ray Train's TorchTrainer (both doors) or in a Ray Tune search, on a Ray
instance that the test started, and writes what Ray returned to OUT/NAME.json.

    python ray_runs.py trainer|raw --address HOST:PORT --storage DIR --name RUN --out OUT [--kill-epoch E]
                       [--max-failures N] [--epochs E]
    python ray_runs.py tune --address HOST:PORT --storage DIR --name RUN --out OUT

`--kill-epoch E`: on the first attempt worker 1 SIGKILLs itself in the middle of epoch E (a marker file in OUT says
that it did), after the checkpoint of epoch E-1 was reported. Rank 0 writes the final weights to OUT/NAME.pt.
Self-contained (Ray ships the functions of __main__ to its workers by value): only torch and fabric_lite are
imported in the workers.
"""

import argparse
import json
import os
import signal
import sys
from pathlib import Path


def _data(n=64, seed=3):
    import torch

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]) + 0.1 * torch.randn(n, 1, generator=g)
    return torch.utils.data.TensorDataset(x, y)


def _loader(batch_size=8):
    import torch

    return torch.utils.data.DataLoader(_data(), batch_size=batch_size, shuffle=True,
                                       generator=torch.Generator().manual_seed(5))


def _kill_here(config, epoch, batch_idx, rank):
    marker = Path(config["out"]) / f"{config['name']}.killed"
    if config.get("kill_epoch") is not None and epoch == config["kill_epoch"] and batch_idx == 1 and rank == 1 \
            and not marker.exists():
        marker.write_text(str(os.getpid()))
        os.kill(os.getpid(), signal.SIGKILL)


def trainer_loop(config):
    import torch
    import torch.nn.functional as F

    from fabric_lite import Callback, Trainer, TrainModule, set_seed
    from fabric_lite.ray import RayReportCallback

    class Regression(TrainModule):
        def __init__(self, lr):
            super().__init__()
            self.lr = lr
            self.net = torch.nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            _kill_here(config, self.trainer.current_epoch, batch_idx, self.trainer.global_rank)
            x, y = batch
            loss = F.mse_loss(self.net(x), y)
            self.log("train_loss", loss, on_step=False, on_epoch=True, sync_dist=True)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)

    class RecordStart(Callback):
        """Rank 0 notes the step each attempt starts from (OUT/NAME.starts): 0, or where it resumed."""

        def on_train_start(self, trainer, module):
            if trainer.is_global_zero and config.get("weights"):
                with open(Path(config["out"]) / f"{config['name']}.starts", "a") as f:
                    f.write(f"{trainer.global_step}\n")

    set_seed(0)
    module = Regression(config.get("lr", 0.05))
    trainer = Trainer(max_epochs=config["epochs"], default_root_dir=config["root"],
                      callbacks=[RayReportCallback(), RecordStart()],
                      enable_progress_bar=False, enable_model_summary=False, logger=False, accelerator="cpu")
    trainer.fit(module, _loader(), ckpt_path="last")
    if trainer.is_global_zero and config.get("weights"):
        torch.save(module.net.state_dict(), config["weights"])


def raw_loop(config):
    import torch
    import torch.nn.functional as F

    import fabric_lite.ray
    from fabric_lite import Accelerator, set_seed

    class Progress:
        def __init__(self):
            self.epoch = 0

        def state_dict(self):
            return {"epoch": self.epoch}

        def load_state_dict(self, state):
            self.epoch = state["epoch"]

    set_seed(0)
    accelerator = Accelerator(cpu=True)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, optimizer, loader = accelerator.prepare(model, optimizer, _loader())
    progress = Progress()
    accelerator.register_for_checkpointing(progress)
    resume = fabric_lite.ray.get_checkpoint()
    if resume is not None:
        accelerator.load_state(resume)
    while progress.epoch < config["epochs"]:
        total = torch.zeros(())
        for batch_idx, (x, y) in enumerate(loader):
            _kill_here(config, progress.epoch, batch_idx, accelerator.process_index)
            optimizer.zero_grad()
            loss = F.mse_loss(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            total += loss.detach()
        progress.epoch += 1
        mean = accelerator.reduce(total, "mean").item()
        path = accelerator.save_state(f"{config['root']}/epoch_{progress.epoch}", blocking=False)
        fabric_lite.ray.report(accelerator, {"train_loss": mean, "epoch": progress.epoch}, checkpoint=path)
    if accelerator.is_main_process and config.get("weights"):
        torch.save(accelerator.unwrap_model(model).state_dict(), config["weights"])


def _step(meta):
    return meta.get("global_step", meta["step"])  # the Trainer's optimizer steps; the raw door's step counter


def _summary(result):
    import fabric_lite.checkpoint.files as files

    checkpoints = [c.path for c, _ in (result.best_checkpoints or [])]
    return {
        "error": None if result.error is None else f"{type(result.error).__name__}: {result.error}",
        "metrics": result.metrics,
        "checkpoint": None if result.checkpoint is None else result.checkpoint.path,
        "checkpoints": checkpoints,
        "checkpoint_metrics": [m for _, m in (result.best_checkpoints or [])],
        "fabric_lite_steps": [_step(files.read_manifest(path)["meta"]) for path in checkpoints],
    }


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("door", choices=["trainer", "raw", "tune"])
    parser.add_argument("--address", required=True)
    parser.add_argument("--storage", required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--kill-epoch", type=int, default=None)
    parser.add_argument("--max-failures", type=int, default=0)
    args = parser.parse_args()

    import ray
    import ray.train
    from ray.train.torch import TorchTrainer

    ray.init(address=args.address, log_to_driver=True)
    out = Path(args.out)
    config = {"out": str(out), "name": args.name, "epochs": args.epochs, "kill_epoch": args.kill_epoch,
              "root": str(out / f"{args.name}_root"), "weights": str(out / f"{args.name}.pt")}
    if args.door == "tune":
        summary = tune(args, config)
    else:
        loop = trainer_loop if args.door == "trainer" else raw_loop
        trainer = TorchTrainer(
            loop, train_loop_config=config, scaling_config=ray.train.ScalingConfig(num_workers=2),
            run_config=ray.train.RunConfig(storage_path=args.storage, name=args.name,
                                           failure_config=ray.train.FailureConfig(max_failures=args.max_failures)))
        try:
            summary = _summary(trainer.fit())
        except Exception as err:  # Ray raises where the run failed for good (no retries left)
            summary = {"error": f"{type(err).__name__}: {err}"}
    (out / f"{args.name}.json").write_text(json.dumps(summary, default=str))
    print(json.dumps(summary, default=str))


def tune_trial(config):
    """One trial: a one-process Trainer (a lone process in a Ray Tune trial), reporting through ray.tune."""
    trainer_loop(config)


def tune(args, config):
    from ray import tune as ray_tune
    from ray.tune.schedulers import ASHAScheduler

    # Trials run one at a time, in this order: ASHA then compares each trial with those before it at the same
    # rung, so the two bad learning rates are stopped at their first rung and the good ones run on.
    space = dict(config, epochs=6, weights=None, lr=ray_tune.grid_search([0.05, 0.0005, 0.03, 0.0001]))
    space["root"] = ray_tune.sample_from(lambda spec: f"{config['root']}/lr_{spec.config.lr}")
    scheduler = ASHAScheduler(time_attr="training_iteration", max_t=6, grace_period=1, reduction_factor=2)
    tuner = ray_tune.Tuner(
        tune_trial, param_space=space,
        tune_config=ray_tune.TuneConfig(metric="train_loss", mode="min", scheduler=scheduler, max_concurrent_trials=1),
        run_config=ray_tune.RunConfig(storage_path=args.storage, name=args.name))
    grid = tuner.fit()
    trials = []
    for result in grid:
        trials.append({"lr": result.config["lr"], "iterations": result.metrics.get("training_iteration"),
                       "train_loss": result.metrics.get("train_loss"),
                       "checkpoint": None if result.checkpoint is None else result.checkpoint.path,
                       "error": None if result.error is None else str(result.error)})
    best = grid.get_best_result()
    return {"trials": trials, "best_lr": best.config["lr"],
            "best_checkpoint": None if best.checkpoint is None else best.checkpoint.path}


if __name__ == "__main__":
    sys.exit(main())
