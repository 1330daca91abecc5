"""Lightning's example projects (as lightning_example_parts writes them) on 2 processes: each scenario records its
result or its error, so one missing feature does not hide the others."""

import traceback

from torch.utils.data import DataLoader

import lightning_example_parts as parts
import lightning_template_parts as templates
from common import parse, write_result
from fabric_lite import Trainer

args = parse({"--root": {"required": True}})
DDP = ["--trainer.devices", "2", "--trainer.accelerator", "cpu", "--trainer.strategy", "ddp",
       "--trainer.enable_progress_bar", "false"]
results = {}
rank = 0


def scenario(fn):
    global rank
    try:
        results[fn.__name__] = fn(f"{args.root}/{fn.__name__}")
    except BaseException as err:  # SystemExit from a refused command line included: record it and go on
        results[fn.__name__] = {"error": f"{type(err).__name__}: {err}\n{traceback.format_exc()[-1500:]}"}
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        rank = dist.get_rank()
    write_result(args.out, rank, results)


@scenario
def bug_report(root):
    model = parts.BoringModel()
    trainer = Trainer(accelerator="cpu", devices=2, default_root_dir=root, limit_train_batches=1,
                      limit_val_batches=1, limit_test_batches=1, num_sanity_val_steps=0, max_epochs=1,
                      enable_model_summary=False, enable_progress_bar=False)
    trainer.fit(model, train_dataloaders=DataLoader(parts.RandomVectors(32, 64, 0), batch_size=2),
                val_dataloaders=DataLoader(parts.RandomVectors(32, 64, 1), batch_size=2))
    test = trainer.test(model, dataloaders=DataLoader(parts.RandomVectors(32, 64, 2), batch_size=2))
    return {"weights": parts.flat_weights(model).tolist(), "global_step": trainer.global_step,
            "world_size": trainer.world_size, "test_loss": test[0]["test_loss"],
            "expect": {"global_step": 1, "world_size": 2}}


@scenario
def autoencoder_cli(root):
    from fabric_lite.cli import TrainerCLI

    cli = TrainerCLI(parts.AutoEncoder, parts.ImagesData, seed_everything_default=1234, run=False,
                     trainer_defaults={"callbacks": parts.SampleImages(), "max_epochs": 10},
                     save_config_kwargs={"overwrite": True},
                     args=["--trainer.max_epochs", "1", "--trainer.default_root_dir", root, "--data.batch_size", "4",
                           *DDP])
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    cli.trainer.test(ckpt_path="best", datamodule=cli.datamodule)
    predictions = cli.trainer.predict(ckpt_path="best", datamodule=cli.datamodule)
    return {"weights": parts.flat_weights(cli.model).tolist(), "global_step": cli.trainer.global_step,
            "predictions": len(predictions), "expect": {"global_step": 4}}


@scenario
def gan(root):
    from fabric_lite.strategies import DDPStrategy

    model = templates.GAN()  # toggling leaves one network out of each loss: DDP must look for unused parameters
    trainer = Trainer(accelerator="cpu", devices=2, strategy=DDPStrategy(find_unused_parameters=True), max_epochs=1,
                      default_root_dir=root, enable_progress_bar=False)
    trainer.fit(model, templates.ImagesOnly())
    return {"weights": parts.flat_weights(model).tolist(), "global_step": trainer.global_step,
            "frozen": model.frozen_while_generating, "expect": {"global_step": 4, "frozen": [True, True]}}


@scenario
def gan_fp16(root):
    model = templates.GAN()  # fp16's loss scaler may skip a step on one process only: refused before training
    trainer = Trainer(accelerator="cpu", devices=2, strategy="ddp", precision="16-mixed", max_epochs=1,
                      default_root_dir=root, enable_progress_bar=False)
    try:
        trainer.fit(model, templates.ImagesOnly())
        said = ""
    except ValueError as err:
        said = str(err)
    return {"weights": [], "expect": {"refused": True, "global_step": 0},
            "refused": "loss scaler skips a step" in said and "bf16-mixed" in said, "global_step": trainer.global_step}


@scenario
def imagenet(root):
    from fabric_lite.callbacks import ModelCheckpoint, TQDMProgressBar
    from fabric_lite.cli import TrainerCLI

    cli = TrainerCLI(templates.ImageNetLike,
                     trainer_defaults={"max_epochs": 90, "accelerator": "auto", "devices": 1, "logger": False,
                                       "benchmark": True, "callbacks": [TQDMProgressBar(refresh_rate=10),
                                                                        ModelCheckpoint(monitor="val_acc1",
                                                                                        mode="max")]},
                     seed_everything_default=42, save_config_kwargs={"overwrite": True},
                     args=["fit", "--model.data_path", root, "--trainer.max_epochs", "1",
                           "--trainer.default_root_dir", root, *DDP[:6]])  # its own progress bar stays on
    return {"weights": parts.flat_weights(cli.model).tolist(), "global_step": cli.trainer.global_step,
            "batch_size": cli.model.batch_size, "expect": {"global_step": 4, "batch_size": 4}}


@scenario
def fine_tuning(root):
    # (with Lightning's strategy name for DDP that expects frozen parameters: plain "ddp" is refused with that fix)
    ddp = [*DDP[:DDP.index("ddp")], "ddp_find_unused_parameters_true", *DDP[DDP.index("ddp") + 1:]]
    cli = templates.finetuning_cli_class()(
        templates.TransferLearning, templates.PairsData, seed_everything_default=1234,
        args=["fit", "--trainer.max_epochs", "3", "--finetuning.milestones", "[1, 2]", "--data.batch_size", "4",
              "--trainer.default_root_dir", root, *ddp])
    model = cli.model
    return {"weights": parts.flat_weights(model).tolist(), "global_step": cli.trainer.global_step,
            "param_groups": len(cli.trainer.optimizers[0].param_groups),
            "expect": {"global_step": 3 * 2, "param_groups": 3}}
