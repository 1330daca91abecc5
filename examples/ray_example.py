"""fabric_lite under Ray: a Trainer in Ray Train's TorchTrainer, and a Ray Tune search over its hyperparameters.

    pip install 'fabric-lite[ray]'
    python examples/ray_example.py train    # 2 workers on this machine's CPUs; retried once if a worker dies
    python examples/ray_example.py tune     # 4 learning rates, ASHA stops the bad ones after their first epoch

Each starts a local Ray instance (ray.init(num_cpus=2)); on a cluster, `ray.init()` joins the running one. Results
and checkpoints go to runs/ray (Ray's storage path). Run `train` again and it resumes from the run's newest
checkpoint: a new driver with the same storage path and run name picks it up, and `fit(ckpt_path="last")` takes it.
"""

import argparse
import os

import torch
import torch.nn.functional as F

from fabric_lite import Trainer, TrainModule, set_seed
from fabric_lite.ray import RayReportCallback

STORAGE = os.path.abspath("runs/ray")


class Regression(TrainModule):
    def __init__(self, lr: float = 0.05):
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        self.log("train_loss", loss, on_step=False, on_epoch=True, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.mse_loss(self.net(x), y), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)


def loaders(n: int = 512):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 8, generator=g)
    y = torch.sin(x[:, :1] * 2) + x[:, 1:2] * x[:, 2:3] + 0.05 * torch.randn(n, 1, generator=g)
    train, val = torch.utils.data.random_split(torch.utils.data.TensorDataset(x, y), [n - 128, 128], generator=g)
    return (torch.utils.data.DataLoader(train, batch_size=32, shuffle=True, generator=torch.Generator().manual_seed(1)),
            torch.utils.data.DataLoader(val, batch_size=64))


def train_fn(config):
    """Runs in every Ray worker (TorchTrainer) or in a Tune trial: fabric_lite reads Ray's environment."""
    root = config["root"]
    if config.get("trial"):  # a Tune trial: a directory of its own, so a new search starts fresh
        from ray import tune

        root = os.path.join(root, tune.get_context().get_trial_id())
    set_seed(0)
    module = Regression(lr=config["lr"])
    train, val = loaders()
    trainer = Trainer(max_epochs=config["epochs"], default_root_dir=root, callbacks=[RayReportCallback()],
                      enable_progress_bar=False, accelerator="cpu")
    trainer.fit(module, train, val, ckpt_path="last")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=["train", "tune"])
    parser.add_argument("--epochs", type=int, default=6)
    args = parser.parse_args()

    import ray
    import ray.train
    from ray import tune
    from ray.train.torch import TorchTrainer
    from ray.tune.schedulers import ASHAScheduler

    ray.init(num_cpus=2, include_dashboard=False)
    root = os.path.abspath(f"runs/ray_work/{args.mode}")
    if args.mode == "train":
        trainer = TorchTrainer(
            train_fn, train_loop_config={"lr": 0.05, "epochs": args.epochs, "root": root},
            scaling_config=ray.train.ScalingConfig(num_workers=2),
            run_config=ray.train.RunConfig(storage_path=STORAGE, name="regression",
                                           failure_config=ray.train.FailureConfig(max_failures=1)))
        result = trainer.fit()
        where = result.checkpoint.path if result.checkpoint is not None else "none (nothing left to train)"
        print(f"final metrics: {result.metrics}\nnewest checkpoint (a fabric_lite checkpoint): {where}")
        return
    space = {"lr": tune.grid_search([0.05, 0.0005, 0.02, 0.0001]), "epochs": args.epochs, "root": root, "trial": True}
    tuner = tune.Tuner(
        train_fn, param_space=space,
        tune_config=tune.TuneConfig(metric="val_loss", mode="min", max_concurrent_trials=1,
                                    scheduler=ASHAScheduler(max_t=args.epochs, grace_period=1, reduction_factor=2)),
        run_config=tune.RunConfig(storage_path=STORAGE, name="regression_search"))
    grid = tuner.fit()
    for result in grid:
        print(f"lr={result.config['lr']:<8} epochs run: {result.metrics['training_iteration']}  "
              f"val_loss={result.metrics['val_loss']:.4f}")
    best = grid.get_best_result()
    print(f"best: lr={best.config['lr']}, checkpoint {best.checkpoint.path}")


if __name__ == "__main__":
    main()
