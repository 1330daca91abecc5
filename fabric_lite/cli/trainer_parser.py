"""The argument parser under `TrainerCLI`: jsonargparse's parser, with the Trainer door's class groups and
errors that fit on one line. Imported only when a TrainerCLI is built (jsonargparse is the extra ``cli``)."""

from __future__ import annotations

import difflib
import re
import sys
from typing import Any, Callable, Dict, List, NoReturn, Optional, Sequence, Tuple, Union

import torch
from jsonargparse import ActionConfigFile, ArgumentParser, Namespace, class_from_function

import fabric_lite.callbacks  # noqa: F401  (every callback and logger class, so `EarlyStopping` resolves by name)
from fabric_lite.callbacks.base import Callback
from fabric_lite.trainer.module import DataModule, TrainModule
from fabric_lite.trainer.trainer import Trainer

__all__ = ["TrainerArgumentParser", "LightningArgumentParser", "ActionConfigFile", "Namespace",
           "one_line_error", "dump_keeping_none"]

ClassSpec = Union[type, Tuple[type, ...]]


class TrainerArgumentParser(ArgumentParser):
    """jsonargparse's parser, plus groups for Trainer/TrainModule/DataModule/Callback classes, optimizers and
    schedulers (Lightning's `LightningArgumentParser`)."""

    def __init__(self, *args: Any, description: str = "fabric_lite Trainer command line",
                 env_prefix: str = "FABRIC_LITE", default_env: bool = False, **kwargs: Any) -> None:
        # A misspelt option must be refused, not read as the option it abbreviates.
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, description=description, env_prefix=env_prefix, default_env=default_env, **kwargs)
        #: keys of the callback groups added with add_lightning_class_args (their callbacks join the Trainer's)
        self.callback_keys: List[str] = []
        #: key -> (optimizer class or tuple of base classes, link target or "AUTOMATIC")
        self.optimizer_groups: Dict[str, Tuple[ClassSpec, str]] = {}
        #: key -> (scheduler class or tuple of base classes, link target or "AUTOMATIC")
        self.lr_scheduler_groups: Dict[str, Tuple[ClassSpec, str]] = {}
        #: the subcommands under this parser (their name is left out of the option an error names)
        self.subcommand_names: List[str] = []

    def add_lightning_class_args(self, lightning_class: Union[type, Callable[..., Any]], nested_key: str,
                                 subclass_mode: bool = False, required: bool = True) -> List[str]:
        """The arguments of a Trainer, TrainModule, DataModule or Callback class (or a function returning one)
        under `nested_key`; `subclass_mode` accepts any subclass, chosen by class path."""
        if callable(lightning_class) and not isinstance(lightning_class, type):
            lightning_class = class_from_function(lightning_class)
        allowed = (Trainer, TrainModule, DataModule, Callback)
        if not (isinstance(lightning_class, type) and issubclass(lightning_class, allowed)):
            raise TypeError(f"add_lightning_class_args({lightning_class!r}, {nested_key!r}): expected a subclass of "
                            f"Trainer, TrainModule, DataModule or Callback, or a function returning one of them.")
        if issubclass(lightning_class, Callback):
            self.callback_keys.append(nested_key)
        if subclass_mode:
            return self.add_subclass_arguments(lightning_class, nested_key, fail_untyped=False, required=required)
        # The Trainer is built by the CLI itself (after callbacks from other groups join it).
        return self.add_class_arguments(lightning_class, nested_key, fail_untyped=False,
                                        instantiate=not issubclass(lightning_class, Trainer), sub_configs=True)

    add_class_args = add_lightning_class_args

    def add_optimizer_args(self, optimizer_class: ClassSpec = (torch.optim.Optimizer,), nested_key: str = "optimizer",
                           link_to: str = "AUTOMATIC") -> None:
        """An optimizer group (`--optimizer Adam --optimizer.lr 0.01`); a tuple of classes accepts subclasses.
        The optimizer is built later, over the model's parameters."""
        _check_classes(optimizer_class, (torch.optim.Optimizer,), "add_optimizer_args", "torch.optim.Optimizer")
        kwargs: Dict[str, Any] = {"instantiate": False, "fail_untyped": False, "skip": {"params"}}
        if isinstance(optimizer_class, tuple):
            self.add_subclass_arguments(optimizer_class, nested_key, required=False, **kwargs)
        else:
            self.add_class_arguments(optimizer_class, nested_key, sub_configs=True, **kwargs)
        self.optimizer_groups[nested_key] = (optimizer_class, link_to)

    def add_lr_scheduler_args(self, lr_scheduler_class: Optional[ClassSpec] = None, nested_key: str = "lr_scheduler",
                              link_to: str = "AUTOMATIC") -> None:
        """A learning-rate scheduler group (`--lr_scheduler StepLR --lr_scheduler.step_size 2`); built later,
        over the optimizer."""
        from fabric_lite.cli.trainer_cli import LR_SCHEDULER_CLASSES

        lr_scheduler_class = lr_scheduler_class or LR_SCHEDULER_CLASSES
        _check_classes(lr_scheduler_class, LR_SCHEDULER_CLASSES, "add_lr_scheduler_args",
                       "torch.optim.lr_scheduler.LRScheduler or fabric_lite.cli.ReduceLROnPlateau")
        kwargs: Dict[str, Any] = {"instantiate": False, "fail_untyped": False, "skip": {"optimizer"}}
        if isinstance(lr_scheduler_class, tuple):
            self.add_subclass_arguments(lr_scheduler_class, nested_key, required=False, **kwargs)
        else:
            self.add_class_arguments(lr_scheduler_class, nested_key, sub_configs=True, **kwargs)
        self.lr_scheduler_groups[nested_key] = (lr_scheduler_class, link_to)

    def error(self, message: str, ex: Optional[Exception] = None) -> NoReturn:
        """Exit 2 with one line that names the key, instead of the full usage and a nested report."""
        if not self.exit_on_error:
            super().error(message, ex)
        parser = getattr(ex, "subcommand_parser", None) or self
        options = re.findall(r"--[\w.]+", parser.format_usage())
        prog = parser.prog.replace(" [options]", "")
        line = one_line_error(message, options)
        for name in self.subcommand_names:  # `fit.model.width` is `--model.width` to the user
            line = re.sub(rf"(?<![\w.]){re.escape(name)}\.(?=\w)", "", line)
        sys.stderr.write(f"error: {line} (run `{prog} --help` for the options)\n")
        self.exit(2)


LightningArgumentParser = TrainerArgumentParser


def dump_keeping_none(parser: ArgumentParser) -> Dict[str, Any]:
    """The keyword that makes `dump`/`save` write options left at None (renamed in jsonargparse 4.49)."""
    from jsonargparse import __version__

    major, minor = (int(p) for p in __version__.split(".")[:2])
    return {"skip_unset": False} if (major, minor) >= (4, 49) else {"skip_none": False}


def _check_classes(given: ClassSpec, bases: Tuple[type, ...], where: str, what: str) -> None:
    for cls in given if isinstance(given, tuple) else (given,):
        if not (isinstance(cls, type) and issubclass(cls, bases)):
            raise TypeError(f"{where}({cls!r}): expected a subclass of {what} (or a tuple of them).")


_NOISE = ("Does not validate against any of the Union subtypes", "Subtypes:", "Errors:", "Given value type:",
          "Given value:", "Expected a <class 'NoneType'>", "Expected a path but")


def one_line_error(message: str, options: Sequence[str] = ()) -> str:
    """jsonargparse's error report (usage, nested union errors) as one line naming the option at fault."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    if not lines:
        return "invalid arguments"
    first = lines[0]
    unknown = re.match(r"Unrecognized arguments:\s*(.*)", first, re.IGNORECASE)
    if unknown:
        flags = [w.split("=", 1)[0] for w in unknown.group(1).split() if w.startswith("-")]
        hints = [h for f in flags for h in difflib.get_close_matches(f, list(options), n=1)]
        hint = f"; did you mean {', '.join(hints)}?" if hints else ""
        return f"unknown option(s): {unknown.group(1)}{hint}"
    refused = re.match(r"(?:Subcommand|Group) '([\w.-]+)' does not accept option '([\w.]+)'", first)
    if refused:  # (a key in a config file, or a dict given as args)
        group, key = refused.groups()
        flag = f"--{key}" if first.startswith("Subcommand") else f"--{group}.{key}"
        hints = difflib.get_close_matches(flag, list(options), n=1)
        return f"unknown option {flag} (in a --config file?)" + (f"; did you mean {hints[0]}?" if hints else "")
    required = re.match(r'Key "([^"]+)" is required', first) or re.match(
        r"the following arguments are required: ([\w.]+)", first)
    if required:
        return f"--{required.group(1)} is required: give it on the command line or in a --config file"
    keyed = re.match(r'Parser key "([^"]+)":\s*(.*)', first)
    if not keyed:
        return "; ".join(lines)
    key, rest = keyed.groups()
    given = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("Given value:")), None)
    subtypes = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("Subtypes:")), None)
    chosen = re.search(r"Problem with given class_path '([\w.]+)'", message)
    chosen_name = chosen.group(1).rsplit(".", 1)[-1] if chosen else None
    nested = re.match(r"NestedArg\(key='([^']*)', val='([^']*)'\)", given or "")
    if nested:
        option, value = nested.groups()
        if chosen_name is None or chosen_name in _short_types(subtypes or ""):  # `--optimizer.lr 0.1` alone
            return (f"--{key}.{option} {value} was given without a class for --{key}: choose one first "
                    f"(e.g. --{key} CLASS_NAME --{key}.{option} {value})")
        return f"--{key}.{option}: {chosen_name} has no argument {option!r} (see `--{key}.help {chosen_name}`)"
    namespace = re.match(r"Namespace\(class_path='([\w.]+)'", given or "")
    if namespace:
        given = namespace.group(1).rsplit(".", 1)[-1]
    reasons: List[str] = []
    for line in ([rest] if rest else []) + lines[1:]:
        line = line.lstrip("- ")
        if line.startswith(_NOISE) or line == "Errors:":
            continue
        line = line.rstrip(":")
        plain = re.match(r"Expected a (.+?)\. Got value: (.*)", line)
        if plain:  # (a single type: jsonargparse names the value in the reason)
            given, line = plain.group(2), f"expected {plain.group(1)}"
        line = _short_types(line).replace("Expected a ", "expected ")
        if line.startswith("expected dot import path string"):
            line = "not the name nor the dotted import path of a class of that kind"
        if line.startswith("Problem with given class_path"):
            line = line.replace("Problem with given class_path", "with class")
        if line and line not in reasons:
            reasons.append(line)
    head = f"--{key}"
    if given is not None:
        head += f": {given!r} is not accepted"
    if subtypes:
        head += f" (expected {_type_names(subtypes)})"
        reasons = [r for r in reasons if not r.startswith("expected ")]
    detail = "; ".join(reasons[:3])
    return f"{head}: {detail}" if detail else head


def _short_types(text: str) -> str:
    text = re.sub(r"<class '(?:[\w.]+\.)?(\w+)'>", r"\1", text)
    return re.sub(r"\b(?:[a-z_][\w]*\.)+([A-Z]\w*)", r"\1", text)


def _type_names(subtypes: str) -> str:
    names = [n.strip() for n in re.split(r",\s*(?![^\[]*\])", _short_types(subtypes).strip("[]")) if n.strip()]
    names = [n.replace("typing.", "").replace("NoneType", "None") for n in names]
    return ", ".join(names[:-1]) + f" or {names[-1]}" if len(names) > 1 else "".join(names)
