"""Small modules written the way Lightning's domain templates write theirs (ImageNet, GAN, DQN, PPO,
segmentation, fine-tuning), on tiny random data. Shared by tests/trainer/test_lightning_examples.py and its
2-process worker; the basics' modules are in lightning_example_parts.py."""

import math
from collections import OrderedDict

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset, random_split

from fabric_lite import DataModule, TrainModule, callbacks
from lightning_example_parts import FEATURES, Backbone, image_set


def _finetuning_base():
    # The tests that use the fine-tuning callback fail on their first line (the import) when it is missing.
    try:
        from fabric_lite.callbacks import BaseFinetuning
    except ImportError:
        return callbacks.Callback
    return BaseFinetuning


# -- ImageNet template: datasets built in setup(), loaders on the module, torchmetrics objects logged ---------------

class ImageNetLike(TrainModule):
    def __init__(self, data_path: str, lr: float = 0.1, momentum: float = 0.9, weight_decay: float = 1e-4,
                 batch_size: int = 8, workers: int = 0) -> None:
        super().__init__()
        from torchmetrics import Accuracy

        self.data_path, self.lr, self.momentum, self.weight_decay = data_path, lr, momentum, weight_decay
        self.batch_size, self.workers = batch_size, workers
        self.model = Backbone(16)
        self.train_dataset = self.eval_dataset = None
        self.train_acc1 = Accuracy(task="multiclass", num_classes=10, top_k=1)
        self.eval_acc1 = Accuracy(task="multiclass", num_classes=10, top_k=1)
        self.eval_acc5 = Accuracy(task="multiclass", num_classes=10, top_k=5)

    def forward(self, x):
        return self.model(x)

    def training_step(self, batch, batch_idx):
        images, target = batch
        output = self.model(images)
        loss = F.cross_entropy(output, target)
        self.log("train_loss", loss)
        self.train_acc1(output, target)
        self.log("train_acc1", self.train_acc1, prog_bar=True)
        return loss

    def _eval_step(self, batch, prefix):
        images, target = batch
        output = self.model(images)
        self.log(f"{prefix}_loss", F.cross_entropy(output, target))
        self.eval_acc1(output, target)
        self.eval_acc5(output, target)
        self.log(f"{prefix}_acc1", self.eval_acc1, prog_bar=True)
        self.log(f"{prefix}_acc5", self.eval_acc5, prog_bar=True)

    def validation_step(self, batch, batch_idx):
        self._eval_step(batch, "val")

    def test_step(self, batch, batch_idx):
        self._eval_step(batch, "test")

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum,
                                    weight_decay=self.weight_decay)
        return [optimizer], [torch.optim.lr_scheduler.LambdaLR(optimizer, lambda epoch: 0.1 ** (epoch // 30))]

    def setup(self, stage: str):
        from fabric_lite.strategies import ParallelStrategy

        if isinstance(self.trainer.strategy, ParallelStrategy):
            processes = max(1, self.trainer.strategy.num_processes)
            self.batch_size = int(self.batch_size / processes)
            self.workers = int(self.workers / processes)
        if stage == "fit":
            self.train_dataset = image_set(32, seed=6)
        self.eval_dataset = image_set(16, seed=7)

    def train_dataloader(self):
        return DataLoader(self.train_dataset, batch_size=self.batch_size, shuffle=True, num_workers=self.workers)

    def val_dataloader(self):
        return DataLoader(self.eval_dataset, batch_size=self.batch_size, num_workers=self.workers)

    def test_dataloader(self):
        return self.val_dataloader()


# -- GAN: manual optimization over two optimizers, toggle_optimizer, log_dict, self.loggers --------------------------

class GAN(TrainModule):
    def __init__(self, latent_dim: int = 4, lr: float = 2e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.automatic_optimization = False
        self.generator = nn.Sequential(nn.Linear(latent_dim, 16), nn.BatchNorm1d(16), nn.LeakyReLU(0.2),
                                       nn.Linear(16, FEATURES), nn.Tanh())
        self.discriminator = nn.Sequential(nn.Linear(FEATURES, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))
        self.validation_z = torch.randn(4, latent_dim)
        self.example_input_array = torch.zeros(2, latent_dim)
        self.frozen_while_generating = []
        self.logged = []
        self.logger_names = []

    def forward(self, z):
        return self.generator(z).view(z.size(0), 1, 8, 8)

    def training_step(self, batch):
        imgs, _ = batch
        opt_g, opt_d = self.optimizers()
        z = torch.randn(imgs.shape[0], self.hparams.latent_dim).type_as(imgs)
        valid = torch.ones(imgs.size(0), 1).type_as(imgs)

        self.toggle_optimizer(opt_g)
        self.frozen_while_generating.append(all(not p.requires_grad for p in self.discriminator.parameters()))
        g_loss = F.binary_cross_entropy_with_logits(self.discriminator(self(z).view(imgs.size(0), -1)), valid)
        opt_g.zero_grad()
        self.manual_backward(g_loss)
        opt_g.step()
        self.untoggle_optimizer(opt_g)

        self.toggle_optimizer(opt_d)
        real = F.binary_cross_entropy_with_logits(self.discriminator(imgs.view(imgs.size(0), -1)), valid)
        fake = F.binary_cross_entropy_with_logits(
            self.discriminator(self(z).detach().view(imgs.size(0), -1)), torch.zeros_like(valid))
        d_loss = (real + fake) / 2
        opt_d.zero_grad()
        self.manual_backward(d_loss)
        opt_d.step()
        self.untoggle_optimizer(opt_d)

        self.log_dict({"d_loss": d_loss, "g_loss": g_loss})
        self.logged.append((d_loss.item(), g_loss.item()))

    def configure_optimizers(self):
        lr = self.hparams.lr
        opt_g = torch.optim.Adam(self.generator.parameters(), lr=lr, betas=(0.5, 0.999))
        opt_d = torch.optim.Adam(self.discriminator.parameters(), lr=lr, betas=(0.5, 0.999))
        return opt_g, opt_d

    def on_train_epoch_end(self):
        samples = self(self.validation_z.type_as(self.generator[0].weight))
        for logger in self.loggers:
            self.logger_names.append(type(logger).__name__)
            if hasattr(logger.experiment, "add_image"):
                logger.experiment.add_image("generated_images", samples[0], self.current_epoch)


class ImagesOnly(DataModule):
    """The GAN's datamodule: prepared in setup(), as Lightning's demo MNIST datamodule is."""

    def __init__(self, batch_size: int = 8) -> None:
        super().__init__()
        self.batch_size = batch_size

    def setup(self, stage=None):
        self.train_set, self.val_set = random_split(image_set(40, seed=8), [32, 8],
                                                    generator=torch.Generator().manual_seed(0))

    def train_dataloader(self):
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self):
        return DataLoader(self.val_set, batch_size=self.batch_size)


# -- DQN: an IterableDataset over a replay buffer from the module's own train_dataloader, dict outputs -------------

class ReplaySamples(IterableDataset):
    def __init__(self, buffer, sample_size: int) -> None:
        self.buffer, self.sample_size = buffer, sample_size

    def __iter__(self):
        idx = torch.randint(len(self.buffer), (self.sample_size,))
        for i in idx.tolist():
            yield self.buffer[i]


class DQNLike(TrainModule):
    def __init__(self, episode_length: int = 12, batch_size: int = 4, sync_rate: int = 2) -> None:
        super().__init__()
        self.episode_length, self.batch_size, self.sync_rate = episode_length, batch_size, sync_rate
        self.net = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2))
        self.target_net = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2))
        g = torch.Generator().manual_seed(9)
        self.buffer = [(torch.randn(4, generator=g), int(torch.randint(2, (1,), generator=g)),
                        float(torch.rand(1, generator=g)), torch.randn(4, generator=g)) for _ in range(50)]
        self.syncs = []

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, nb_batch):
        states, actions, rewards, next_states = batch
        device = batch[0].device.index if self.on_gpu else "cpu"
        q = self.net(states).gather(1, actions.unsqueeze(-1)).squeeze(-1)
        with torch.no_grad():
            target = self.target_net(next_states).max(1)[0] * 0.99 + rewards
        loss = nn.MSELoss()(q, target)
        if self.global_step % self.sync_rate == 0:
            self.target_net.load_state_dict(self.net.state_dict())
            self.syncs.append(self.global_step)
        log = {"steps": torch.tensor(self.global_step).to(device)}
        return OrderedDict({"loss": loss, "log": log, "progress_bar": log})

    def configure_optimizers(self):
        return [torch.optim.Adam(self.net.parameters(), lr=1e-2)]

    def train_dataloader(self):
        return DataLoader(ReplaySamples(self.buffer, self.episode_length), batch_size=self.batch_size, sampler=None)


# -- PPO: manual optimization, epoch-only logging of Python floats, an overridden optimizer_step ------------------

class PPOLike(TrainModule):
    def __init__(self, steps_per_epoch: int = 16, batch_size: int = 4, nb_optim_iters: int = 2) -> None:
        super().__init__()
        self.steps_per_epoch, self.batch_size, self.nb_optim_iters = steps_per_epoch, batch_size, nb_optim_iters
        self.save_hyperparameters()
        self.automatic_optimization = False
        self.actor = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        self.critic = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
        self.actor_losses = {}

    def generate_samples(self):
        g = torch.Generator().manual_seed(100 + self.current_epoch)
        for _ in range(self.steps_per_epoch):
            state = torch.randn(4, generator=g)
            yield state, int(torch.randint(2, (1,), generator=g)), float(torch.randn(1, generator=g))

    def training_step(self, batch):
        state, action, ret = batch
        self.log("avg_ep_len", float(self.current_epoch + 1), prog_bar=True, on_step=False, on_epoch=True)
        optimizer_actor, optimizer_critic = self.optimizers()
        logp = torch.log_softmax(self.actor(state), -1).gather(1, action.unsqueeze(-1)).squeeze(-1)
        loss_actor = -(logp * ret).mean()
        self.manual_backward(loss_actor)
        optimizer_actor.step()
        optimizer_actor.zero_grad()
        loss_critic = (ret - self.critic(state).squeeze(-1)).pow(2).mean()
        self.manual_backward(loss_critic)
        optimizer_critic.step()
        optimizer_critic.zero_grad()
        self.log("loss_critic", loss_critic, on_step=False, on_epoch=True, prog_bar=False, logger=True)
        self.log("loss_actor", loss_actor, on_step=False, on_epoch=True, prog_bar=True, logger=True)
        self.actor_losses.setdefault(self.current_epoch, []).append(loss_actor.item())

    def configure_optimizers(self):
        return (torch.optim.Adam(self.actor.parameters(), lr=3e-3), torch.optim.Adam(self.critic.parameters(), lr=1e-2))

    def optimizer_step(self, *args, **kwargs):
        for _ in range(self.nb_optim_iters):
            super().optimizer_step(*args, **kwargs)

    def train_dataloader(self):
        class Source(IterableDataset):
            def __iter__(inner):
                return self.generate_samples()

        return DataLoader(Source(), batch_size=self.batch_size)


# -- segmentation: datasets made in __init__, dict outputs with extra keys, [optimizer], [scheduler] ---------------

class SegmentationLike(TrainModule):
    def __init__(self, batch_size: int = 2, lr: float = 1e-3) -> None:
        super().__init__()
        self.batch_size, self.lr = batch_size, lr
        self.net = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 5, 1))
        g = torch.Generator().manual_seed(10)
        self.trainset = TensorDataset(torch.rand(6, 3, 8, 8, generator=g), torch.randint(5, (6, 8, 8), generator=g))
        self.validset = TensorDataset(torch.rand(2, 3, 8, 8, generator=g), torch.randint(5, (2, 8, 8), generator=g))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_nb):
        img, mask = batch
        loss = F.cross_entropy(self(img.float()), mask.long(), ignore_index=250)
        log_dict = {"train_loss": loss}
        return {"loss": loss, "log": log_dict, "progress_bar": log_dict}

    def validation_step(self, batch, batch_idx):
        img, mask = batch
        self.log("val_loss", F.cross_entropy(self(img.float()), mask.long(), ignore_index=250), prog_bar=True)

    def configure_optimizers(self):
        opt = torch.optim.Adam(self.net.parameters(), lr=self.lr)
        return [opt], [torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10)]

    def train_dataloader(self):
        return DataLoader(self.trainset, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self):
        return DataLoader(self.validset, batch_size=self.batch_size, shuffle=False)


def cosine_lr(base: float, t: int, t_max: int) -> float:
    return base * (1 + math.cos(math.pi * t / t_max)) / 2


# -- fine-tuning: a BaseFinetuning callback added to the CLI, linked arguments -----------------------------------

class MilestonesFinetuning(_finetuning_base()):
    def __init__(self, milestones: tuple = (5, 10), train_bn: bool = False) -> None:
        super().__init__()
        self.milestones = milestones
        self.train_bn = train_bn

    def freeze_before_training(self, pl_module) -> None:
        self.freeze(modules=pl_module.feature_extractor, train_bn=self.train_bn)

    def finetune_function(self, pl_module, epoch: int, optimizer) -> None:
        if epoch == self.milestones[0]:
            self.unfreeze_and_add_param_group(modules=pl_module.feature_extractor[-2:], optimizer=optimizer,
                                              train_bn=self.train_bn)
        elif epoch == self.milestones[1]:
            self.unfreeze_and_add_param_group(modules=pl_module.feature_extractor[:-2], optimizer=optimizer,
                                              train_bn=self.train_bn)


class PairsData(DataModule):
    def __init__(self, num_workers: int = 0, batch_size: int = 8) -> None:
        super().__init__()
        self.num_workers, self.batch_size = num_workers, batch_size

    def train_dataloader(self):
        return DataLoader(image_set(16, classes=2, seed=11, shape=(3, 8, 8)), batch_size=self.batch_size,
                          shuffle=True)

    def val_dataloader(self):
        return DataLoader(image_set(8, classes=2, seed=12, shape=(3, 8, 8)), batch_size=self.batch_size)


class TransferLearning(TrainModule):
    def __init__(self, train_bn: bool = False, milestones: tuple = (2, 4), batch_size: int = 32, lr: float = 1e-3,
                 lr_scheduler_gamma: float = 1e-1) -> None:
        super().__init__()
        from torchmetrics import Accuracy

        self.train_bn, self.milestones, self.batch_size = train_bn, milestones, batch_size
        self.lr, self.lr_scheduler_gamma = lr, lr_scheduler_gamma
        self.feature_extractor = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 8, 3),
                                               nn.AdaptiveAvgPool2d(1))
        self.fc = nn.Sequential(nn.Linear(8, 4), nn.ReLU(), nn.Linear(4, 1))
        self.train_acc = Accuracy(task="binary")
        self.valid_acc = Accuracy(task="binary")
        self.save_hyperparameters()
        self.trainable_per_epoch = []

    def forward(self, x):
        return self.fc(self.feature_extractor(x).squeeze(-1).squeeze(-1))

    def on_train_epoch_start(self):
        self.trainable_per_epoch.append(sum(p.numel() for p in self.parameters() if p.requires_grad))

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        y_true = y.view((-1, 1)).type_as(x)
        self.log("train_acc", self.train_acc(torch.sigmoid(logits), y_true.int()), prog_bar=True)
        return F.binary_cross_entropy_with_logits(logits, y_true)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        y_true = y.view((-1, 1)).type_as(x)
        self.log("val_loss", F.binary_cross_entropy_with_logits(logits, y_true), prog_bar=True)
        self.log("val_acc", self.valid_acc(torch.sigmoid(logits), y_true.int()), prog_bar=True)

    def configure_optimizers(self):
        trainable = [p for p in self.parameters() if p.requires_grad]
        optimizer = torch.optim.Adam(trainable, lr=self.lr)
        return [optimizer], [torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=list(self.milestones),
                                                                  gamma=self.lr_scheduler_gamma)]


def finetuning_cli_class():
    """The CLI subclass the fine-tuning template defines: one more class group, linked arguments, defaults."""
    from fabric_lite.cli import TrainerCLI

    class FinetuningCLI(TrainerCLI):
        def add_arguments_to_parser(self, parser):
            parser.add_lightning_class_args(MilestonesFinetuning, "finetuning")
            parser.link_arguments("data.batch_size", "model.batch_size")
            parser.link_arguments("finetuning.milestones", "model.milestones")
            parser.link_arguments("finetuning.train_bn", "model.train_bn")
            parser.set_defaults({"trainer.max_epochs": 15, "trainer.enable_model_summary": False,
                                 "trainer.num_sanity_val_steps": 0})

    return FinetuningCLI
