"""`TrainerCLI`: a training script's command line read from the Trainer's, the module's and the datamodule's
signatures, with YAML config files (Lightning's `LightningCLI`).

    # train.py
    TrainerCLI(MyModule, MyDataModule)
    # python train.py fit --config cfg.yaml --trainer.max_epochs 3 --model.lr 0.01 --optimizer Adam

Built on jsonargparse (the extra ``cli``), imported only when a TrainerCLI is built.
"""

from __future__ import annotations

import inspect
import os
import random
import re
import warnings
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterable, List, Optional, Type, Union

import torch

from fabric_lite.callbacks.base import Callback
from fabric_lite.trainer.module import DataModule, TrainModule
from fabric_lite.trainer.trainer import Trainer

if TYPE_CHECKING:
    from fabric_lite.cli.trainer_parser import Namespace, TrainerArgumentParser

__all__ = ["TrainerCLI", "LightningCLI", "SaveConfigCallback", "ReduceLROnPlateau", "instantiate_class",
           "OptimizerCallable", "LRSchedulerCallable", "LR_SCHEDULER_CLASSES", "LRSchedulerTypeTuple",
           "LRSchedulerTypeUnion", "LRSchedulerType", "ArgsType"]

#: The seed a TrainerCLI chose at random (`--seed_everything true`), handed to the processes the Trainer starts
#: again under torchrun (`devices=N`) so that every rank draws the same one.
SEED_VARIABLE = "FABRIC_LITE_CLI_SEED"

ArgsType = Optional[Union[List[str], Dict[str, Any], "Namespace"]]
#: Type hints for a module's __init__ that takes an optimizer or scheduler to build later (dependency injection).
OptimizerCallable = Callable[[Iterable], torch.optim.Optimizer]


class ReduceLROnPlateau(torch.optim.lr_scheduler.ReduceLROnPlateau):
    """torch's ReduceLROnPlateau that also names the metric it follows (`--lr_scheduler.monitor val_loss`)."""

    def __init__(self, optimizer: torch.optim.Optimizer, monitor: str, *args: Any, **kwargs: Any) -> None:
        super().__init__(optimizer, *args, **kwargs)
        self.monitor = monitor


#: The scheduler classes the automatic `--lr_scheduler` group accepts (torch's ReduceLROnPlateau has no metric).
LR_SCHEDULER_CLASSES = (torch.optim.lr_scheduler.LRScheduler, ReduceLROnPlateau)
#: Lightning's names for the same: the scheduler classes as a tuple, a Union, and a Union of their types.
LRSchedulerTypeTuple = LR_SCHEDULER_CLASSES
LRSchedulerTypeUnion = Union[torch.optim.lr_scheduler.LRScheduler, ReduceLROnPlateau]
LRSchedulerType = Union[Type[torch.optim.lr_scheduler.LRScheduler], Type[ReduceLROnPlateau]]
LRSchedulerCallable = Callable[[torch.optim.Optimizer], LRSchedulerTypeUnion]


def load_jsonargparse_parser() -> Type["TrainerArgumentParser"]:
    """The parser class, or one sentence saying what to install."""
    try:
        from fabric_lite.cli.trainer_parser import TrainerArgumentParser
    except ImportError as err:
        if getattr(err, "name", None) and not str(err.name).startswith("jsonargparse") and err.name != "docstring_parser":
            raise
        raise ModuleNotFoundError("TrainerCLI needs jsonargparse: pip install 'fabric-lite[cli]'") from None
    return TrainerArgumentParser


class SaveConfigCallback(Callback):
    """Writes the run's full config (config.yaml) into the Trainer's log_dir when fit starts; refuses to overwrite
    one that is there unless `overwrite=True`, so a second run cannot silently replace a first run's record."""

    def __init__(self, parser: "TrainerArgumentParser", config: "Namespace", config_filename: str = "config.yaml",
                 overwrite: bool = False, multifile: bool = False, save_to_log_dir: bool = True) -> None:
        self.parser = parser
        self.config = config
        self.config_filename = config_filename
        self.overwrite = overwrite
        self.multifile = multifile
        self.save_to_log_dir = save_to_log_dir
        self.already_saved = False
        if not save_to_log_dir and type(self).save_config is SaveConfigCallback.save_config:
            raise ValueError("SaveConfigCallback(save_to_log_dir=False) saves nothing: subclass it and write "
                             "save_config(trainer, module, stage), or leave save_to_log_dir=True.")

    def setup(self, trainer: Any, module: Any, stage: str) -> None:
        if self.already_saved:
            return
        if self.save_to_log_dir:
            from fabric_lite.checkpoint import files as checkpoint_io

            log_dir = os.fspath(trainer.log_dir)
            path = f"{log_dir.rstrip('/')}/{self.config_filename}"
            fs, local = checkpoint_io.filesystem(path)
            exists = bool(trainer.is_global_zero and not self.overwrite and fs.isfile(local))
            if trainer.strategy.collectives.broadcast_object(exists):
                raise RuntimeError(
                    f"SaveConfigCallback: {path} exists already (a previous run's config); not overwriting it. "
                    f"Delete it, use another trainer.default_root_dir or logger version, pass "
                    f"TrainerCLI(save_config_kwargs={{'overwrite': True}}), or TrainerCLI(save_config_callback=None).")
            if trainer.is_global_zero:  # one writer
                fs.makedirs(local.rsplit("/", 1)[0], exist_ok=True)
                from fabric_lite.cli.trainer_parser import dump_keeping_none

                keep_none = dump_keeping_none(self.parser)
                if self.multifile:
                    self.parser.save(self.config, local, overwrite=True, multifile=True, **keep_none)
                else:
                    text = self.parser.dump(self.config, **keep_none)
                    with fs.open(local, "w") as f:
                        f.write(text)
        if trainer.is_global_zero:
            self.save_config(trainer, module, stage)
            self.already_saved = True
        self.already_saved = bool(trainer.strategy.collectives.broadcast_object(self.already_saved))

    def save_config(self, trainer: Any, module: Any, stage: str) -> None:
        """Override to store the config elsewhere too (a logger's hyperparameters...); runs on rank 0 only."""


class TrainerCLI:
    """A command line for a TrainModule and a DataModule: `fit`/`validate`/`test`/`predict`, `--config` files,
    `--trainer.*`/`--model.*`/`--data.*` options, `--optimizer`/`--lr_scheduler` class paths, `--print_config`.

    `run=False` builds without a subcommand: `cli.model`, `cli.datamodule`, `cli.trainer`, `cli.config`.

    Args:
        model_class: the TrainModule class (or a function returning one); None: any, named by `--model`.
        datamodule_class: the DataModule class (or a function returning one); None: optional, named by `--data`.
        save_config_callback: the callback that writes config.yaml into the log dir; None: none.
        save_config_kwargs: its arguments (`{"overwrite": True}`, `{"config_filename": "run.yaml"}`).
        trainer_class: the Trainer class (or a function returning one).
        trainer_defaults: Trainer arguments that replace its defaults; callbacks given here are always added.
        seed_everything_default: `--seed_everything`'s default: an int, True (a random seed) or False.
        parser_kwargs: arguments of the parsers; under a subcommand's name, of that subcommand's parser only.
        subclass_mode_model: accept any subclass of `model_class`, named on the command line.
        subclass_mode_data: accept any subclass of `datamodule_class`, named on the command line.
        args: what to parse instead of `sys.argv[1:]`: a list of strings, a dict or a config namespace.
        run: run the subcommand given (fit, validate, test, predict); False: build only, no subcommands.
        auto_configure_optimizers: add `--optimizer` and `--lr_scheduler`, which replace configure_optimizers.
        parser_class: the parser class (a TrainerArgumentParser subclass).
    """

    def __init__(
        self,
        model_class: Optional[Union[Type[TrainModule], Callable[..., TrainModule]]] = None,
        datamodule_class: Optional[Union[Type[DataModule], Callable[..., DataModule]]] = None,
        save_config_callback: Optional[Type[SaveConfigCallback]] = SaveConfigCallback,
        save_config_kwargs: Optional[Dict[str, Any]] = None,
        trainer_class: Union[Type[Trainer], Callable[..., Trainer]] = Trainer,
        trainer_defaults: Optional[Dict[str, Any]] = None,
        seed_everything_default: Union[bool, int] = True,
        parser_kwargs: Optional[Dict[str, Any]] = None,
        subclass_mode_model: bool = False,
        subclass_mode_data: bool = False,
        args: ArgsType = None,
        run: bool = True,
        auto_configure_optimizers: bool = True,
        parser_class: Optional[Type["TrainerArgumentParser"]] = None,
    ) -> None:
        self.parser_class = parser_class or load_jsonargparse_parser()
        self.save_config_callback = save_config_callback
        self.save_config_kwargs = dict(save_config_kwargs or {})
        self.trainer_class = trainer_class
        self.trainer_defaults = dict(trainer_defaults or {})
        self.seed_everything_default = seed_everything_default
        self.parser_kwargs = dict(parser_kwargs or {})
        self.auto_configure_optimizers = auto_configure_optimizers
        self.model_class = model_class
        self.datamodule_class = datamodule_class
        # No class given: any subclass, chosen on the command line (`--model mypkg.MyModule`).
        self.subclass_mode_model = model_class is None or subclass_mode_model
        self.subclass_mode_data = datamodule_class is None or subclass_mode_data
        self.subcommand_parsers: Dict[str, "TrainerArgumentParser"] = {}
        self.subcommand_method_arguments: Dict[str, List[str]] = {}

        names = self.subcommands()
        main_kwargs = {k: v for k, v in self.parser_kwargs.items() if k not in names}
        sub_kwargs = {k: v for k, v in self.parser_kwargs.items() if k in names}
        self.setup_parser(run, main_kwargs, sub_kwargs)
        self.parse_arguments(self.parser, args)
        self.subcommand: Optional[str] = self.config["subcommand"] if run else None
        self.set_seed()
        self.before_instantiate_classes()
        self.instantiate_classes()
        self.after_instantiate_classes()
        if self.subcommand is not None:
            self.run_subcommand(self.subcommand)

    # -- the parser ----------------------------------------------------------------------------------
    def init_parser(self, **kwargs: Any) -> "TrainerArgumentParser":
        """A parser with `-c/--config` (and jsonargparse's `--print_config`)."""
        from fabric_lite import __version__
        from fabric_lite.cli.trainer_parser import ActionConfigFile

        kwargs.setdefault("dump_header", [f"fabric_lite=={__version__}"])
        parser = self.parser_class(**kwargs)
        parser.add_argument("-c", "--config", action=ActionConfigFile,
                            help="a YAML or JSON config file; several are merged in the order given")
        return parser

    def setup_parser(self, add_subcommands: bool, main_kwargs: Dict[str, Any], sub_kwargs: Dict[str, Any]) -> None:
        """The main parser, with one subparser per subcommand (or the arguments themselves when not running)."""
        self.parser = self.init_parser(**main_kwargs)
        if not add_subcommands:
            self.add_all_arguments(self.parser)
            return
        subcommands = self.parser.add_subcommands()
        self.parser.subcommand_names = list(self.subcommands())
        trainer_type = self.trainer_class if isinstance(self.trainer_class, type) else Trainer
        for name, skip in self.subcommands().items():
            method = getattr(trainer_type, name)
            doc = (inspect.getdoc(method) or "").split("\n", 1)[0] or None
            kwargs = dict(sub_kwargs.get(name, {}))
            kwargs.setdefault("description", doc)
            parser = self.init_parser(**kwargs)
            self.add_all_arguments(parser)
            self.subcommand_method_arguments[name] = parser.add_method_arguments(trainer_type, name, skip=set(skip))
            self.subcommand_parsers[name] = parser
            subcommands.add_subcommand(name, parser, help=doc)

    @staticmethod
    def subcommands() -> Dict[str, set]:
        """The subcommands, each with the Trainer method arguments the CLI fills itself (not options)."""
        return {
            "fit": {"module", "model", "train_dataloaders", "val_dataloaders", "datamodule"},
            "validate": {"module", "model", "dataloaders", "datamodule"},
            "test": {"module", "model", "dataloaders", "datamodule"},
            "predict": {"module", "model", "dataloaders", "datamodule"},
        }

    def add_all_arguments(self, parser: "TrainerArgumentParser") -> None:
        """Default, core and user arguments, then the automatic optimizer and scheduler groups."""
        self.add_default_arguments_to_parser(parser)
        self.add_core_arguments_to_parser(parser)
        self.add_arguments_to_parser(parser)
        if self.auto_configure_optimizers:
            if not parser.optimizer_groups:  # (unless add_arguments_to_parser added its own)
                parser.add_optimizer_args((torch.optim.Optimizer,))
            if not parser.lr_scheduler_groups:
                parser.add_lr_scheduler_args(LR_SCHEDULER_CLASSES)
        self.link_optimizers_and_lr_schedulers(parser)

    def add_default_arguments_to_parser(self, parser: "TrainerArgumentParser") -> None:
        parser.add_argument("--seed_everything", type=Union[bool, int], default=self.seed_everything_default,
                            help="an int: seed every generator with it before building the classes; true: a random "
                                 "seed (written into the saved config); false: no seeding")

    def add_core_arguments_to_parser(self, parser: "TrainerArgumentParser") -> None:
        """The `trainer`, `model` and `data` groups."""
        parser.add_lightning_class_args(self.trainer_class, "trainer")
        # An object given as a default (`trainer_defaults={"profiler": PyTorchProfiler(...)}`) is not a value the
        # parser can hold for a class-typed option: it is handed to the Trainer when the command line sets nothing.
        plain = {k: v for k, v in self.trainer_defaults.items() if k != "callbacks" and _is_plain(v)}
        parser.set_defaults({f"trainer.{k}": v for k, v in plain.items()})
        parser.add_lightning_class_args(self.model_class or TrainModule, "model", subclass_mode=self.subclass_mode_model)
        # Without a datamodule class, data is optional: the module may define its own dataloaders.
        parser.add_lightning_class_args(self.datamodule_class or DataModule, "data",
                                        subclass_mode=self.subclass_mode_data,
                                        required=self.datamodule_class is not None)

    def add_arguments_to_parser(self, parser: "TrainerArgumentParser") -> None:
        """Override to add arguments or `parser.link_arguments(...)`."""

    @staticmethod
    def link_optimizers_and_lr_schedulers(parser: "TrainerArgumentParser") -> None:
        """Links the optimizer and scheduler groups added with a `link_to` target."""
        for key, (cls, link_to) in {**parser.optimizer_groups, **parser.lr_scheduler_groups}.items():
            if link_to == "AUTOMATIC":
                continue
            if isinstance(cls, tuple):
                parser.link_arguments(key, link_to)
            else:
                parser.link_arguments(key, link_to, compute_fn=_class_path_adder(cls))

    def parse_arguments(self, parser: "TrainerArgumentParser", args: ArgsType) -> None:
        """`self.config`: from `args` (a list like sys.argv[1:], a dict or a Namespace), else sys.argv."""
        if isinstance(args, dict) or (args is not None and not isinstance(args, (list, tuple))):
            self.config = parser.parse_object(args)
        else:
            self.config = parser.parse_args(None if args is None else list(args))

    # -- building --------------------------------------------------------------------------------------
    def set_seed(self) -> None:
        """Seeds every generator (`--seed_everything`); a random seed is written into the config."""
        from fabric_lite.seed import seed_everything

        seed = self.section(self.config).get("seed_everything")
        if seed is False or seed is None:
            return
        if seed is True:
            seed = _shared_random_seed()
        seed_everything(int(seed))
        self.section(self.config)["seed_everything"] = int(seed)

    def before_instantiate_classes(self) -> None:
        """Override to run code before the classes are built."""

    def instantiate_classes(self) -> None:
        """Builds the datamodule, the model (with the optimizer from `--optimizer`) and the Trainer."""
        instantiate = getattr(self.parser, "instantiate", None) or self.parser.instantiate_classes
        self.config_init = instantiate(self.config)
        self.datamodule = self.section(self.config_init).get("data")
        self.model = self.section(self.config_init).get("model")
        self.add_configure_optimizers_method_to_model(self.subcommand)
        self.trainer = self.instantiate_trainer()

    def after_instantiate_classes(self) -> None:
        """Override to run code after the classes are built."""

    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        """The Trainer from `--trainer.*`, with the callbacks of extra callback groups and the config saver."""
        parser = self.subcommand_parser(self.subcommand)
        extra = [self.section(self.config_init).get(key) for key in parser.callback_keys]
        section = self.section(self.config_init).get("trainer")
        given = vars(section) if section is not None else {}
        config = {**{k: v for k, v in given.items() if not k.startswith("__")}, **kwargs}  # (not `__path__`)
        callbacks = config.get("callbacks")
        callbacks = [] if callbacks is None else list(callbacks) if isinstance(callbacks, (list, tuple)) else [callbacks]
        callbacks.extend(c for c in extra if c is not None)
        default = self.trainer_defaults.get("callbacks")
        if default is not None:
            callbacks.extend(default if isinstance(default, (list, tuple)) else [default])
        if self.save_config_callback is not None and not config.get("fast_dev_run", False):
            callbacks.append(self.save_config_callback(parser, self.section(self.config), **self.save_config_kwargs))
        config["callbacks"] = callbacks
        for key, value in self.trainer_defaults.items():
            if key != "callbacks" and not _is_plain(value) and config.get(key) is None:
                config[key] = value
        try:
            return self.trainer_class(**config)
        except (ValueError, TypeError) as err:
            # The Trainer's own argument checks ("Trainer(devices=0): ...") name the option: one line, exit 2.
            bad = re.match(r"\w*Trainer\((\w+)=", str(err))
            if bad is None or bad.group(1) not in config:
                raise
            parser.error(f"--trainer.{bad.group(1)}: {err}", err)

    @staticmethod
    def configure_optimizers(module: TrainModule, optimizer: torch.optim.Optimizer,
                             lr_scheduler: Optional[Any] = None) -> Any:
        """What the module's configure_optimizers returns when `--optimizer` is given (override to change it)."""
        if lr_scheduler is None:
            return optimizer
        if isinstance(lr_scheduler, ReduceLROnPlateau):
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": lr_scheduler, "monitor": lr_scheduler.monitor}}
        return [optimizer], [lr_scheduler]

    def add_configure_optimizers_method_to_model(self, subcommand: Optional[str]) -> None:
        """With `--optimizer` given (and the automatic groups on), the module's configure_optimizers returns it."""
        if not self.auto_configure_optimizers or self.model is None:
            return
        parser = self.subcommand_parser(subcommand)
        optimizers = [k for k, (_, link) in parser.optimizer_groups.items() if link == "AUTOMATIC"]
        schedulers = [k for k, (_, link) in parser.lr_scheduler_groups.items() if link == "AUTOMATIC"]
        if not optimizers:
            return
        if len(optimizers) > 1 or len(schedulers) > 1:
            raise ValueError(f"TrainerCLI builds at most one optimizer and one scheduler itself; found the automatic "
                             f"groups {optimizers + schedulers}. Give the others a link_to target and write "
                             f"configure_optimizers, or pass TrainerCLI(auto_configure_optimizers=False).")
        optimizer_init = _class_init(parser.optimizer_groups[optimizers[0]][0], self.section(self.config_init).get(optimizers[0]))
        if not optimizer_init:
            return  # no --optimizer given: the module's own configure_optimizers stands
        scheduler_init = None
        if schedulers:
            scheduler_init = _class_init(parser.lr_scheduler_groups[schedulers[0]][0],
                                         self.section(self.config_init).get(schedulers[0]))
        if type(self.model).configure_optimizers is not TrainModule.configure_optimizers:
            warnings.warn(f"{type(self.model).__name__}.configure_optimizers is replaced by the optimizer given to "
                          f"{type(self).__name__} ({optimizer_init['class_path']}).", UserWarning, stacklevel=2)
        optimizer = instantiate_class(self.model.parameters(), optimizer_init)
        scheduler = instantiate_class(optimizer, scheduler_init) if scheduler_init else None
        build = self.configure_optimizers

        def configure_optimizers(module: TrainModule) -> Any:
            return build(module, optimizer, scheduler)

        self.model.configure_optimizers = configure_optimizers.__get__(self.model)

    # -- running --------------------------------------------------------------------------------------
    def run_subcommand(self, subcommand: str) -> None:
        """`before_<subcommand>()`, the Trainer method (or this CLI's own method of that name), `after_<subcommand>()`."""
        before = getattr(self, f"before_{subcommand}", None)
        if callable(before):
            before()
        fn = getattr(self, subcommand, None) or getattr(self.trainer, subcommand)
        fn(**self.prepare_subcommand_kwargs(subcommand, fn))
        after = getattr(self, f"after_{subcommand}", None)
        if callable(after):
            after()

    def prepare_subcommand_kwargs(self, subcommand: str, fn: Optional[Callable[..., Any]] = None) -> Dict[str, Any]:
        """The method's options from the config, the model (under the method's name for it) and the datamodule."""
        section = self.config_init[subcommand]
        kwargs = {k: section[k] for k in self.subcommand_method_arguments[subcommand] if k in section}
        params = inspect.signature(fn or getattr(self.trainer, subcommand)).parameters
        kwargs["model" if "model" in params else "module"] = self.model
        if self.datamodule is not None:
            kwargs["datamodule"] = self.datamodule
        return kwargs

    # -- helpers --------------------------------------------------------------------------------------
    def section(self, config: Any) -> Any:
        """The part of a config for the subcommand that runs (the whole config with run=False)."""
        return config.get(str(self.subcommand), config) if self.subcommand else config

    def subcommand_parser(self, subcommand: Optional[str]) -> "TrainerArgumentParser":
        return self.parser if subcommand is None else self.subcommand_parsers[subcommand]


#: Lightning's name for it.
LightningCLI = TrainerCLI


def _shared_random_seed() -> int:
    """A random seed that every process of one launch draws alike: the launching process's (handed down in the
    environment to the ranks the Trainer starts again), else one derived from the launch's rendezvous address (a
    launch by torchrun or `fabric-lite launch`, where each rank parses the command line on its own)."""
    import hashlib

    from fabric_lite.strategies.environments import read_launch_environment

    process = read_launch_environment().process
    inherited = os.environ.get(SEED_VARIABLE)
    if process.is_distributed and inherited:
        return int(inherited)
    if process.is_distributed:
        identity = f"{process.master_addr}:{process.master_port}:{process.world_size}".encode()
        seed = int.from_bytes(hashlib.sha256(identity).digest()[:4], "little")
    else:
        seed = random.SystemRandom().randint(0, 2**32 - 1)
    os.environ[SEED_VARIABLE] = str(seed)  # for the processes a Trainer(devices=N) starts from this one
    return seed


def _class_init(cls: Any, init: Any) -> Dict[str, Any]:
    """A group's value as {"class_path", "init_args"} (a single-class group holds only the init args)."""
    if init is None:
        return {}
    as_dict = init.as_dict() if hasattr(init, "as_dict") else dict(init)
    if isinstance(cls, tuple):
        return as_dict
    return {"class_path": f"{cls.__module__}.{cls.__qualname__}", "init_args": as_dict}


def _class_path_adder(cls: type) -> Callable[[Any], Dict[str, Any]]:
    def add(init_args: Any) -> Dict[str, Any]:
        return _class_init(cls, init_args) or {"class_path": f"{cls.__module__}.{cls.__qualname__}", "init_args": {}}

    return add


def instantiate_class(args: Any, init: Dict[str, Any]) -> Any:
    """Builds `init["class_path"]` with the positional `args` (one value or a tuple) and `init["init_args"]`."""
    import importlib

    module_name, _, name = init["class_path"].rpartition(".")
    cls = getattr(importlib.import_module(module_name), name)
    return cls(*(args if isinstance(args, tuple) else (args,)), **(init.get("init_args") or {}))


def _is_plain(value: Any) -> bool:
    """A value a config file can hold (numbers, strings, lists and dicts of them), not an object."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    if isinstance(value, (list, tuple)):
        return all(_is_plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _is_plain(v) for k, v in value.items())
    return False
