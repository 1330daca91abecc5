"""What Lightning's example projects do (examples/pytorch: basics, domain templates, bug report), done by our own
small modules (tests/workers/lightning_example_parts.py, lightning_template_parts.py) with the same calls, hooks, Trainer arguments, callbacks
and command-line flags, alone and on 2 processes."""

import importlib.util
import math
import sys

import pytest
import torch
import torch.nn.functional as F
import yaml
from torch.utils.data import DataLoader, random_split

from conftest import WORKERS, torchrun
from fabric_lite import Trainer, TrainModule


def _load(name):
    """The example-shaped modules, shared with the 2-process worker (tests/workers is not on sys.path)."""
    spec = importlib.util.spec_from_file_location(name, WORKERS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # the command line resolves the classes by their module's name
    spec.loader.exec_module(module)
    return module


parts = _load("lightning_example_parts")
templates = _load("lightning_template_parts")

QUIET = ["--trainer.enable_progress_bar", "false"]


def mean(values):
    return sum(values) / len(values)


# -- basics/autoencoder.py ------------------------------------------------------------------------------------------

def test_autoencoder_cli_fit_then_test_and_predict_from_the_best_checkpoint(tmp_path):
    from fabric_lite.cli import TrainerCLI

    sampler = parts.SampleImages()
    cli = TrainerCLI(parts.AutoEncoder, parts.ImagesData, seed_everything_default=1234, run=False,
                     trainer_defaults={"callbacks": sampler, "max_epochs": 10}, save_config_kwargs={"overwrite": True},
                     args=["--trainer.max_epochs", "2", "--trainer.default_root_dir", str(tmp_path),
                           "--model.hidden_dim", "8", "--data.batch_size", "4", *QUIET])
    assert cli.model.hparams.hidden_dim == 8 and cli.datamodule.batch_size == 4 and cli.trainer.max_epochs == 2
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    assert sampler.shapes == [(3, parts.FEATURES)] * 2      # the callback reached trainer.datamodule each epoch
    val = cli.model.losses["val"][-2:]                      # the last epoch's 2 validation batches of 4
    assert cli.trainer.logged_metrics["val_loss_epoch"] == pytest.approx(mean(val), rel=1e-5)
    assert cli.trainer.callback_metrics["val_loss"] == pytest.approx(mean(val), rel=1e-5)
    assert cli.trainer.logged_metrics["val_loss_step"] == pytest.approx(val[-1], rel=1e-5)
    # in training on_step is already the default: one value, no suffix
    assert cli.trainer.logged_metrics["train_loss"] == pytest.approx(cli.model.losses["train"][-1], rel=1e-5)
    assert list(tmp_path.rglob("config.yaml")), "the run's config is saved next to its logs"

    results = cli.trainer.test(ckpt_path="best", datamodule=cli.datamodule)
    test_losses = cli.model.losses["test"]
    assert results == [{"test_loss_epoch": pytest.approx(mean(test_losses), rel=1e-5)}]
    predictions = cli.trainer.predict(ckpt_path="best", datamodule=cli.datamodule)
    assert [tuple(p.shape) for p in predictions] == [(4, parts.FEATURES)] * 2
    x = cli.datamodule.test_set.tensors[0][:4].view(4, -1)
    torch.testing.assert_close(predictions[0], cli.model(x).detach())


def test_autoencoder_print_config_round_trips_through_a_config_file(tmp_path, capsys):
    from fabric_lite.cli import TrainerCLI

    with pytest.raises(SystemExit) as stop:
        TrainerCLI(parts.AutoEncoder, parts.ImagesData, run=False,
                   args=["--model.hidden_dim", "5", "--trainer.max_epochs", "3", "--print_config"])
    assert stop.value.code in (0, None)
    text = capsys.readouterr().out
    config = yaml.safe_load(text)
    assert config["model"]["hidden_dim"] == 5 and config["trainer"]["max_epochs"] == 3
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    cli = TrainerCLI(parts.AutoEncoder, parts.ImagesData, run=False,
                     args=["--config", str(path), "--data.batch_size", "2"])
    assert (cli.model.hparams.hidden_dim, cli.trainer.max_epochs, cli.datamodule.batch_size) == (5, 3, 2)

    with pytest.raises(SystemExit) as stop:
        TrainerCLI(parts.AutoEncoder, parts.ImagesData, run=False, args=["--trainer.max_epochs", "three"])
    assert stop.value.code not in (0, None)
    assert "max_epochs" in capsys.readouterr().err


# -- basics/backbone_image_classifier.py -----------------------------------------------------------------------------

def test_backbone_classifier_epoch_and_step_logging_and_test_from_best(tmp_path):
    from fabric_lite.cli import TrainerCLI

    cli = TrainerCLI(parts.BackboneClassifier, parts.ImagesData, seed_everything_default=1234,
                     save_config_kwargs={"overwrite": True}, run=False,
                     args=["--trainer.max_epochs", "1", "--trainer.default_root_dir", str(tmp_path),
                           "--data.batch_size", "8", "--model.learning_rate", "0.01", *QUIET])
    assert "backbone" not in cli.model.hparams and cli.model.hparams.learning_rate == 0.01
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    train = cli.model.losses["train"]                       # 4 batches of 8
    logged = cli.trainer.logged_metrics
    assert logged["train_loss_step"] == pytest.approx(train[-1], rel=1e-5)
    assert logged["train_loss_epoch"] == pytest.approx(mean(train), rel=1e-5)
    assert cli.trainer.callback_metrics["train_loss"] == pytest.approx(mean(train), rel=1e-5)
    assert logged["valid_loss_epoch"] == pytest.approx(mean(cli.model.losses["valid"][-1:]), rel=1e-5)

    results = cli.trainer.test(ckpt_path="best", datamodule=cli.datamodule)
    assert results == [{"test_loss": pytest.approx(mean(cli.model.losses["test"]), rel=1e-5)}]
    predictions = cli.trainer.predict(ckpt_path="best", datamodule=cli.datamodule)
    assert tuple(predictions[0].shape) == (8, 10)


# -- basics/transformer.py: `import lightning as L` ----------------------------------------------------------------

def test_language_model_through_the_package_aliases(tmp_path, monkeypatch):
    import fabric_lite as L

    monkeypatch.chdir(tmp_path)                             # the example writes its logs under the working directory
    L.seed_everything(42)
    dataset = parts.TokenPairs()
    train, val, test = random_split(dataset, [len(dataset) - 16, 8, 8])
    model = parts.language_model_class()(vocab_size=dataset.vocab_size)
    assert isinstance(model, TrainModule)
    trainer = L.Trainer(gradient_clip_val=0.25, max_epochs=2, enable_progress_bar=False)
    trainer.fit(model, DataLoader(train, batch_size=4, shuffle=True), DataLoader(val, batch_size=4))
    assert {"train_loss", "val_loss"} <= set(trainer.progress_bar_metrics)
    results = trainer.test(model, DataLoader(test, batch_size=4))
    with torch.no_grad():
        by_hand = mean([F.nll_loss(model.model(x), y.view(-1)).item() for x, y in DataLoader(test, batch_size=4)])
    assert results == [{"test_loss": pytest.approx(by_hand, rel=1e-5)}]


# -- basics/profiler_example.py ------------------------------------------------------------------------------------

@pytest.mark.parametrize("automatic", [True, False])
def test_profiled_classifier_writes_pytorch_profiler_files(tmp_path, automatic):
    from fabric_lite.cli import TrainerCLI
    from fabric_lite.profilers import PyTorchProfiler

    # the profiler by class path on the command line (jsonargparse takes an instance default only lazily)
    cli = TrainerCLI(parts.ProfiledClassifier, parts.TwoLoaders, save_config_kwargs={"overwrite": True}, run=False,
                     trainer_defaults={"max_epochs": 1, "limit_train_batches": 3, "limit_val_batches": 2,
                                       "accelerator": "cpu"},
                     args=["--model.automatic_optimization", str(automatic).lower(),
                           "--trainer.profiler", f"{PyTorchProfiler.__module__}.PyTorchProfiler",
                           "--trainer.profiler.dirpath", str(tmp_path / "prof"),
                           "--trainer.profiler.filename", "perf", "--trainer.default_root_dir", str(tmp_path), *QUIET])
    assert isinstance(cli.trainer.profiler, PyTorchProfiler)
    before = parts.flat_weights(cli.model)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    assert cli.trainer.global_step == 3
    assert not torch.equal(before, parts.flat_weights(cli.model))
    files = [p.name for p in (tmp_path / "prof").iterdir()]
    assert "fit-perf.txt" in files, files                   # the summary, named {stage}-{filename}
    assert any(name.endswith(".json") for name in files), files  # chrome traces (export_to_chrome defaults on)


# -- domain_templates/imagenet.py -----------------------------------------------------------------------------------

def test_imagenet_template_fit_subcommand_with_progress_bar_checkpoint_and_metric_objects(tmp_path):
    from fabric_lite.callbacks import ModelCheckpoint, TQDMProgressBar
    from fabric_lite.cli import TrainerCLI

    checkpoint = ModelCheckpoint(monitor="val_acc1", mode="max")
    cli = TrainerCLI(templates.ImageNetLike,
                     trainer_defaults={"max_epochs": 90, "accelerator": "auto", "devices": 1, "logger": False,
                                       "benchmark": True, "callbacks": [TQDMProgressBar(refresh_rate=10), checkpoint]},
                     seed_everything_default=42, save_config_kwargs={"overwrite": True},
                     args=["fit", "--model.data_path", str(tmp_path), "--trainer.max_epochs", "1",
                           "--trainer.default_root_dir", str(tmp_path), "--trainer.enable_progress_bar", "true"])
    assert cli.model.batch_size == 8                        # one process: not a ParallelStrategy, nothing divided
    assert cli.trainer.global_step == 4                     # 32 samples in batches of 8
    model = cli.model
    with torch.no_grad():
        x, y = model.eval_dataset.tensors
        by_hand = (model(x).argmax(-1) == y).float().mean().item()
    assert checkpoint.best_model_score.item() == pytest.approx(by_hand, abs=1e-6)
    assert {"val_acc1", "val_acc5", "train_acc1"} <= set(cli.trainer.progress_bar_metrics)


# -- domain_templates/generative_adversarial_net.py ------------------------------------------------------------------

def test_gan_two_optimizers_by_hand_with_a_positional_datamodule(tmp_path):
    from fabric_lite.loggers import CSVLogger

    model = templates.GAN()
    trainer = Trainer(accelerator="cpu", devices=1, max_epochs=1, default_root_dir=str(tmp_path),
                      logger=CSVLogger(str(tmp_path)), enable_progress_bar=False)
    trainer.fit(model, templates.ImagesOnly())                  # a datamodule as the second positional argument
    assert trainer.global_step == 2 * 4                     # two optimizer steps in each of 4 batches
    assert model.frozen_while_generating == [True] * 4      # toggle_optimizer froze the discriminator
    assert all(p.requires_grad for p in model.parameters())  # untoggle_optimizer gave it back
    d_loss, g_loss = model.logged[-1]
    assert trainer.callback_metrics["d_loss"] == pytest.approx(d_loss, rel=1e-5)
    assert trainer.callback_metrics["g_loss"] == pytest.approx(g_loss, rel=1e-5)
    assert model.logger_names == ["CSVLogger"]


# -- domain_templates/reinforce_learn_Qnet.py -----------------------------------------------------------------------

def test_dqn_replay_buffer_from_the_modules_own_iterable_loader(tmp_path):
    from fabric_lite import seed_everything

    seed_everything(0)
    model = templates.DQNLike()
    trainer = Trainer(accelerator="cpu", devices=1, val_check_interval=100, max_epochs=2,
                      default_root_dir=str(tmp_path), enable_progress_bar=False)
    trainer.fit(model)                                      # no loaders given: the module's train_dataloader()
    assert trainer.global_step == 2 * 3                     # 12 samples per epoch in batches of 4
    assert model.syncs == [0, 2, 4]


# -- domain_templates/reinforce_learn_ppo.py ------------------------------------------------------------------------

def test_ppo_manual_steps_and_epoch_logging_of_python_floats(tmp_path):
    model = templates.PPOLike()
    trainer = Trainer(accelerator="cpu", devices=1, val_check_interval=100, max_epochs=2,
                      default_root_dir=str(tmp_path), enable_progress_bar=False)
    trainer.fit(model)
    assert trainer.global_step == 2 * 2 * 4                 # 2 optimizers x 4 batches x 2 epochs
    metrics = trainer.callback_metrics
    assert metrics["avg_ep_len"] == pytest.approx(2.0)      # the last epoch logged 2.0 at every step
    assert metrics["loss_actor"] == pytest.approx(mean(model.actor_losses[1]), rel=1e-5)
    assert "loss_actor" in trainer.progress_bar_metrics and "loss_critic" not in trainer.progress_bar_metrics
    assert "loss_critic" in trainer.logged_metrics


# -- domain_templates/semantic_segmentation.py ----------------------------------------------------------------------

def test_segmentation_dict_outputs_and_an_epoch_scheduler(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    model = templates.SegmentationLike()
    trainer = Trainer(max_epochs=3, enable_progress_bar=False)
    trainer.fit(model)
    assert trainer.global_step == 3 * 3                     # 6 images in batches of 2
    lr = trainer.optimizers[0].param_groups[0]["lr"]
    assert lr == pytest.approx(templates.cosine_lr(1e-3, 3, 10), rel=1e-9)   # stepped once per epoch
    assert "val_loss" in trainer.progress_bar_metrics


# -- domain_templates/computer_vision_fine_tuning.py -----------------------------------------------------------------

def test_fine_tuning_cli_unfreezes_at_milestones_with_linked_arguments(tmp_path):
    from fabric_lite.callbacks import BaseFinetuning

    assert issubclass(templates.MilestonesFinetuning, BaseFinetuning)
    cli = templates.finetuning_cli_class()(
        templates.TransferLearning, templates.PairsData, seed_everything_default=1234,
        args=["fit", "--trainer.max_epochs", "3", "--finetuning.milestones", "[1, 2]", "--data.batch_size", "4",
              "--trainer.default_root_dir", str(tmp_path), "--trainer.limit_train_batches", "2", *QUIET])
    model = cli.model
    assert model.batch_size == 4 and tuple(model.milestones) == (1, 2)    # linked from data/finetuning
    assert cli.trainer.num_sanity_val_steps == 0
    head = sum(p.numel() for p in model.fc.parameters())
    last_two = sum(p.numel() for p in model.feature_extractor[-2:].parameters())
    assert model.trainable_per_epoch == [head, head + last_two, sum(p.numel() for p in model.parameters())]
    assert len(cli.trainer.optimizers[0].param_groups) == 3


# -- bug_report/bug_report_model.py ---------------------------------------------------------------------------------

def test_bug_report_model_one_batch_each(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    train = DataLoader(parts.RandomVectors(32, 64, seed=0), batch_size=2)
    test = DataLoader(parts.RandomVectors(32, 64, seed=2), batch_size=2)
    model = parts.BoringModel()
    w0, b0 = model.layer.weight.detach().clone(), model.layer.bias.detach().clone()
    trainer = Trainer(default_root_dir=str(tmp_path), limit_train_batches=1, limit_val_batches=1,
                      limit_test_batches=1, num_sanity_val_steps=0, max_epochs=1, enable_model_summary=False,
                      enable_progress_bar=False)
    trainer.fit(model, train_dataloaders=train, val_dataloaders=DataLoader(parts.RandomVectors(32, 64, 1), 2))
    x = next(iter(train))                                   # d(sum of outputs)/dW = each row the sum of inputs
    torch.testing.assert_close(model.layer.weight.detach(), w0 - 0.1 * x.sum(0).expand(2, -1))
    torch.testing.assert_close(model.layer.bias.detach(), b0 - 0.1 * 2)
    results = trainer.test(model, dataloaders=test)
    with torch.no_grad():
        by_hand = model(next(iter(test))).sum().item()
    assert results == [{"test_loss": pytest.approx(by_hand, rel=1e-5)}]


def test_a_datamodule_given_where_the_loaders_go(tmp_path):
    """`trainer.fit(model, dm)` as the GAN template calls it; validate/test/predict take it the same way."""

    class Vectors(parts.DataModule):
        def __init__(self):
            super().__init__()
            self.stages = []

        def setup(self, stage):
            self.stages.append(("setup", stage))

        def teardown(self, stage):
            self.stages.append(("teardown", stage))

        def _loader(self):
            return DataLoader(parts.RandomVectors(32, 8, seed=3), batch_size=4)

        train_dataloader = val_dataloader = test_dataloader = predict_dataloader = _loader

    class Boring(parts.BoringModel):
        def predict_step(self, batch, batch_idx):
            return self(batch)

    dm, model = Vectors(), Boring()
    trainer = Trainer(max_epochs=1, default_root_dir=str(tmp_path), enable_progress_bar=False,
                      enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(model, dm)
    assert trainer.global_step == 2
    with torch.no_grad():
        by_hand = mean([model(x).sum().item() for x in dm._loader()])
    assert trainer.validate(model, dm) == [{"valid_loss": pytest.approx(by_hand, rel=1e-5)}]
    assert trainer.test(model, dm) == [{"test_loss": pytest.approx(by_hand, rel=1e-5)}]
    assert [tuple(p.shape) for p in trainer.predict(model, dm)] == [(4, 2), (4, 2)]
    assert dm.stages == [(k, s) for s in ("fit", "validate", "test", "predict") for k in ("setup", "teardown")]


def test_step_methods_that_take_the_batch_alone(tmp_path):
    """`def training_step(self, batch)` (the GAN and PPO templates) gets the batch alone; the others the index too."""
    seen = []

    class Mixed(parts.BoringModel):
        def training_step(self, batch):
            seen.append(("train", batch.shape[0]))
            return self(batch).sum()

        def validation_step(self, batch, *args):
            seen.append(("val", args))

        def test_step(self, batch, idx):                   # any name: the second positional is the index
            seen.append(("test", idx))

    loader = DataLoader(parts.RandomVectors(32, 4, seed=0), batch_size=2)
    trainer = Trainer(max_epochs=1, default_root_dir=str(tmp_path), enable_progress_bar=False,
                      enable_model_summary=False, num_sanity_val_steps=0, enable_checkpointing=False)
    model = Mixed()
    trainer.fit(model, loader, loader)
    trainer.test(model, loader)
    assert seen == [("train", 2), ("train", 2), ("val", (0,)), ("val", (1,)), ("test", 0), ("test", 1)]


# -- the same projects on 2 processes (one launch) -----------------------------------------------------------------

SCENARIOS = ["bug_report", "autoencoder_cli", "gan", "gan_fp16", "imagenet", "fine_tuning"]


@pytest.fixture(scope="module")
def two_process_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("lightning_examples_ddp")
    return torchrun(WORKERS / "lightning_examples_ddp.py", 2, "--root", str(out / "runs"), out_dir=out, timeout=240)


@pytest.mark.parametrize("name", SCENARIOS)
def test_example_on_two_processes(two_process_results, name):
    r0, r1 = (r[name] for r in two_process_results)
    assert r0.get("error") is None and r1.get("error") is None, (r0.get("error"), r1.get("error"))
    assert r0["weights"] == pytest.approx(r1["weights"], rel=1e-6)   # DDP kept the replicas equal
    for key, expected in r0["expect"].items():
        assert r0[key] == expected, key
        assert r1[key] == expected, key
    if name == "autoencoder_cli":
        assert r0["predictions"] + r1["predictions"] == 2   # 2 predict batches shared by the ranks
    if name == "bug_report":
        assert math.isfinite(r0["test_loss"]) and math.isfinite(r1["test_loss"])
