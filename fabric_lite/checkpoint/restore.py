"""`Accelerator.load_state`: a checkpoint is read, verified and checked whole, then applied all or nothing.

Two phases. Reading: the manifest, every file this process needs (checksums first where loading could run
code), the state's layout, whether each model, optimizer and scheduler fits, the RNG states; nothing of the
run changes and any problem is a `CheckpointError`. Applying: first the small objects whose own
`load_state_dict` decides whether a saved state fits (dataloader positions, registered objects and the
Trainer's callbacks, schedulers, the loss scaler, per-process objects), each one's previous state kept (on
the host) so that a refusal puts back those already applied; then optimizers (their previous state is kept
by reference, loading replaces it), once all processes agree that the small objects went through (what
follows may take collectives); then the model weights or the engine's state (checked to fit in the first
phase), the RNGs and a partial accumulation window. Weights are not copied to be put back (that would cost a model's memory again): a
failure while loading them (memory, a collective) says the model may be partly loaded.

A checkpoint saved inside an accumulation window holds each process's partial gradients. On the same
number of processes each takes its own back; on another number, every process takes the average of all
saved ones, so that the window's closing all-reduce (a mean) gives the mean of the saved processes'
partial gradients plus the new ones, the same gradient an uninterrupted run would have.
"""

from __future__ import annotations

import copy
import functools
import os
import re
import warnings
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple, Union

import torch

from fabric_lite.checkpoint import files as checkpoint_io
from fabric_lite.checkpoint import fit, names, sharded
from fabric_lite.checkpoint.files import CheckpointError
from fabric_lite.checkpoint.loading import load_file, start_reading
from fabric_lite.rng_state import capture_rng_state, restore_rng_state

if TYPE_CHECKING:
    from fabric_lite.accelerator.accelerator import Accelerator

__all__ = ["load_state", "CHECKPOINT_RE", "TRAINING_STATE", "PER_PROCESS_LOADER_KEYS", "state_problem"]

CHECKPOINT_RE = re.compile(r"checkpoint_(\d+)$")
TRAINING_STATE = "training_state.pt"
#: The parts of a loader's state that are each process's own: the global RNG states recorded when its epoch's
#: order was drawn, its workers' RNG states and its dataset's own state (data/stateful.py). The main process's copy
#: is in the training state; every process's own in its ``rng_<rank>.pt``, taken back when the number of processes
#: is the same (on another number, every saved process's dataset state is handed over as ``source_ranks``).
PER_PROCESS_LOADER_KEYS = ("generator_state", "workers", "source")
_LISTS = ("optimizers", "schedulers", "dataloaders", "custom")


def state_problem(state: Any) -> Optional[str]:
    """What is wrong with the layout of a loaded ``training_state.pt``, or None."""
    if not isinstance(state, dict):
        return f"it holds a {type(state).__name__}, not the training state's map"
    for key in _LISTS:
        if not isinstance(state.get(key), list):
            return f"its {key!r} is {type(state.get(key)).__name__}, not a list"
    if not isinstance(state.get("precision"), dict):
        return "its 'precision' is not a map"
    models = state.get("models", 0)
    if isinstance(models, bool) or not isinstance(models, int) or models < 0:
        return f"its 'models' is {models!r:.40}, not a count"
    if not isinstance(state.get("types", {}), dict):
        return "its 'types' is not a map"
    return None


def _local_problem(local: Any, models: List[Dict[str, torch.Tensor]]) -> Optional[str]:
    """What is wrong with a process's ``rng_<rank>.pt`` (RNG states, objects, partial gradients), or None."""
    if not isinstance(local, dict) or not isinstance(local.get("rng"), dict):
        return "it holds no RNG states"
    if not isinstance(local.get("objects", []), list):
        return "its 'objects' is not a list"
    loaders = local.get("loaders", [])
    if not isinstance(loaders, list) or not all(isinstance(s, dict) for s in loaders):
        return "its 'loaders' is not a list of loader states"
    grads = local.get("partial_grads")
    if grads is None:
        return None
    if not isinstance(grads, list) or len(grads) != len(models):
        return f"its partial gradients are for {len(grads) if isinstance(grads, list) else '?'} model(s), not {len(models)}"
    for i, (saved, params) in enumerate(zip(grads, models)):
        if not isinstance(saved, dict):
            return f"its partial gradients of model {i} are not a map"
        for name, grad in saved.items():  # (a parameter the model no longer has is left out, as strict=False does)
            if not isinstance(grad, torch.Tensor) or (name in params and grad.shape != params[name].shape):
                return f"its partial gradient {name!r:.60} of model {i} does not fit the model"
    return None


def _rng_fits(saved: Dict[str, Any]) -> Optional[str]:
    """Restore the saved RNG states once and put the current ones back: a state that cannot be restored is
    found now, not after the model changed."""
    current = capture_rng_state()
    try:
        restore_rng_state(saved)
    except Exception as err:
        return f"its RNG states cannot be restored ({type(err).__name__}: {str(err)[:120]})"
    finally:
        restore_rng_state(current)
    return None


def _named_parameters(acc: "Accelerator") -> List[Dict[str, torch.Tensor]]:
    return [dict(acc.unwrap_model(m).named_parameters()) for m in acc.models]


def _partial_gradients(url: str, manifest: Dict[str, Any], acc: "Accelerator", own: Optional[Dict[str, Any]],
                       saved_world: Optional[int]) -> Tuple[bool, Optional[List[Dict[str, torch.Tensor]]]]:
    """(whether the checkpoint was saved inside an accumulation window, the gradients this process takes)."""
    world = acc.strategy.world_size
    if own is not None and (saved_world is None or saved_world == world):
        grads = own.get("partial_grads")
        return grads is not None, grads
    # another number of processes: the mean of every saved process's partial gradients, on every process
    files = [f"rng_{r}.pt" for r in range(saved_world or 0)]
    if not files or any(f not in manifest["files"] for f in files):
        return False, None
    params = _named_parameters(acc)
    total: Optional[List[Dict[str, torch.Tensor]]] = None
    for name in files:
        local: Any = own if name == f"rng_{acc.strategy.global_rank}.pt" else \
            load_file(url, name, manifest, weights_only=True)
        problem = _local_problem(local, params)
        if problem:
            raise CheckpointError(f"{url}/{name} is damaged: {problem}. Nothing was loaded.")
        grads = local.get("partial_grads")
        if grads is None:
            return False, None
        if total is None:  # (one file's gradients at a time, summed into the first: host memory for two)
            total = [{k: g.detach().to(torch.float32 if g.is_floating_point() else g.dtype, copy=True)
                      for k, g in model.items()} for model in grads]
            continue
        for acc_model, model in zip(total, grads):
            if set(acc_model) != set(model):
                raise CheckpointError(f"{url}: the saved processes hold partial gradients of different parameters "
                                      f"({name}); the window cannot be spread over {world} process(es). Resume "
                                      f"with {saved_world}, or from a checkpoint saved after an optimizer step.")
            for k, g in model.items():
                acc_model[k] += g
    assert total is not None
    dtypes = [{k: p.dtype for k, p in model.items()} for model in params]
    return True, [{k: (g / len(files)).to(dtypes[i][k]) for k, g in model.items() if k in dtypes[i]}
                  for i, model in enumerate(total)]


def _every_source(url: str, manifest: Dict[str, Any], loaders: List[Any], saved_world: int) -> None:
    """Saved by another number of processes: each loader whose dataset keeps a state of its own gets every saved
    process's (``source_ranks``), from which it works out what is left for this run's processes."""
    wanted = [i for i, saved in enumerate(loaders) if isinstance(saved, dict) and saved.get("source") is not None]
    if not wanted:
        return
    sources: Dict[int, List[Any]] = {i: [] for i in wanted}
    for rank in range(saved_world):
        name = f"rng_{rank}.pt"
        local = load_file(url, name, manifest, weights_only=True) if name in manifest["files"] else None
        own = local.get("loaders", []) if isinstance(local, dict) else []
        for i in wanted:
            sources[i].append(own[i].get("source") if i < len(own) and isinstance(own[i], dict) else None)
    for i in wanted:
        loaders[i] = {**loaders[i], "source_ranks": sources[i]}


def _host_copy(value: Any) -> Any:
    """`value` (a state dict) kept to put back: tensors copied to the host (an EMA model kept on the GPU is not
    doubled there), containers rebuilt, the rest deep-copied."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: _host_copy(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_host_copy(v) for v in value) if type(value) in (list, tuple) else copy.deepcopy(value)
    return copy.deepcopy(value)


class _Applied:
    """The objects changed so far, each with what puts it back."""

    def __init__(self) -> None:
        self.undo: List[Tuple[str, Callable[[], None]]] = []
        self.unkept: List[str] = []  # applied without a way back (their state could not be copied)

    def load(self, what: str, obj: Any, saved: Any) -> None:
        try:
            before = _host_copy(obj.state_dict())
        except Exception:  # a state that cannot be copied (a lock, a handle): loaded all the same, said if needed
            self.unkept.append(what)
        else:
            # kept before loading: an object that fails part-way through its own load_state_dict is put back too
            self.undo.append((what, lambda: obj.load_state_dict(before)))
        obj.load_state_dict(saved)

    def load_optimizer(self, what: str, opt: Any, saved: Any) -> None:
        # load_state_dict gives the optimizer new state and groups; the old ones, kept by reference (this
        # process's own tensors, also a sharded optimizer's), put it back without a copy
        inner = opt.optimizer
        state = inner.state
        groups = [{k: v for k, v in g.items() if k != "params"} for g in inner.param_groups]

        def undo() -> None:
            inner.state = state
            for group, before in zip(inner.param_groups, groups):
                group.update(before)

        self.undo.append((what, undo))
        opt.load_state_dict(saved)

    def roll_back(self) -> List[str]:
        failed = [f"{what} (its state could not be copied to put it back)" for what in self.unkept]
        for what, undo in reversed(self.undo):
            try:
                undo()
            except Exception as err:  # said, not hidden: the caller names what could not be put back
                failed.append(f"{what} ({type(err).__name__}: {err})")
        self.undo.clear()
        self.unkept.clear()
        return failed


def _failure(url: str, applied: _Applied, what: str, err: BaseException, partly: bool = False) -> CheckpointError:
    """Put back what was applied; the error that says what failed and what is left."""
    failed = applied.roll_back()
    kept = (f"could not put back {'; '.join(failed)}" if failed
            else "everything loaded before it was put back as it was")
    if partly:
        kept += f", but {what} may be partly loaded: load a checkpoint again before training on"
    return CheckpointError(f"{url}: loading {what} failed ({type(err).__name__}: {err}); {kept}. Load a checkpoint "
                           f"this run can take (see the error above), or build the run as the one that saved it.")


def _agree(strategy: Any, problem: Optional[str]) -> Optional[str]:
    """Every process's problem (None: none), gathered so that all stop together: a check that fails on one
    process only must not leave the others waiting in the next collective."""
    found = [(rank, p) for rank, p in enumerate(strategy.collectives.all_gather_object(problem)) if p]
    if not found:
        return None
    rank, first = found[0]
    return first if rank == strategy.global_rank or strategy.world_size == 1 else f"(on rank {rank}) {first}"


def _find(acc: "Accelerator", input_dir: Optional[Union[str, os.PathLike]]) -> str:
    if input_dir is not None:
        return os.fspath(input_dir)
    project_dir = acc.project_dir
    if project_dir is None:
        raise ValueError(
            "load_state() without a path needs automatic_checkpoint_naming and a project_dir: "
            "Accelerator(project_config=ProjectConfiguration(project_dir='runs', automatic_checkpoint_naming=True)).")
    root = f"{os.fspath(project_dir).rstrip('/')}/checkpoints"
    found = acc.strategy.collectives.broadcast_object(
        checkpoint_io.newest_whole_checkpoint(root) if acc.strategy.is_global_zero else None)
    match = CHECKPOINT_RE.search(found or "")
    if match is None:
        raise CheckpointError(f"No whole checkpoint under {root} to load.")
    acc.project_configuration.iteration = int(match.group(1)) + 1
    return found


def load_state(acc: "Accelerator", input_dir: Optional[Union[str, os.PathLike]], strict: bool = True,
               weights_only: bool = True, **_: Any) -> str:
    url = _find(acc, input_dir)
    for hook in acc.load_state_pre_hooks.values():
        hook(acc.models, url)
    manifest = checkpoint_io.read_manifest(url)
    strategy = acc.strategy
    # -- reading: nothing of the run changes until everything was read and checked
    rng_name = f"rng_{strategy.global_rank}.pt"
    # this process's files read and checksummed together, on helper threads, while the first ones are parsed
    own = [TRAINING_STATE, *([] if manifest["meta"].get("engine") else
                             [f"model_{i}.pt" for i in range(len(acc.models))]), rng_name]
    started = start_reading(url, own, manifest)
    state = load_file(url, TRAINING_STATE, manifest, weights_only=weights_only, started=started)
    problem = state_problem(state)
    if problem:
        raise CheckpointError(f"{url}/{TRAINING_STATE} is damaged: {problem}. Nothing was loaded.")
    saved_models = [f for f in manifest["files"] if re.fullmatch(r"model_\d+\.pt", f)]
    fmt = strategy.checkpoint_format
    engine = fmt.kind if fmt.engine_owned else None  # (DCP shards and state dicts load into each other)
    saved_as = manifest["meta"].get("engine")
    if saved_as != engine and not (engine is None and saved_as == sharded.ENGINE):
        saved_by = {None: "a strategy that saves state dicts (single, ddp, fsdp with state_dict_type='full')",
                    sharded.ENGINE: "a sharded strategy (fsdp)"}.get(saved_as, saved_as)
        raise CheckpointError(
            f"{url} was written by {saved_by}, but this run uses {type(strategy).__name__}; their model and "
            f"optimizer state are stored differently. Resume with the strategy that saved it, or start this run "
            f"from its weights: `fabric-lite consolidate {url} weights.pt`, then load_state_dict.")
    expected = {"model": (state.get("models", len(saved_models)), acc.models),
                "optimizer": (len(state["optimizers"]), acc.optimizers),
                "scheduler": (len(state["schedulers"]), acc.schedulers),
                "dataloader": (len(state["dataloaders"]), acc.dataloaders),
                "registered object": (len(state["custom"]), acc.registered_objects)}
    for kind, (saved, objects) in expected.items():
        if saved != len(objects):
            raise CheckpointError(
                f"{url} holds {saved} {kind}(s) but this Accelerator prepared {len(objects)}. Prepare (and register) "
                f"the same objects, in the same order, as the run that saved it.")
    apply_engine: Optional[Callable[[], None]]
    if saved_as == sharded.ENGINE:
        apply_engine = sharded.read(url, manifest, strategy, acc.models,
                                    [(opt.module, opt.optimizer) for opt in acc.optimizers], strict)
    else:
        apply_engine = fmt.read_engine_state(url, manifest, strict) if engine else None
    weights = [] if saved_as else [load_file(url, f"model_{i}.pt", manifest, weights_only=weights_only,
                                             started=started) for i in range(len(acc.models))]
    problems: List[str] = []
    for i, model in enumerate(acc.models[:len(weights)]):
        current = strategy.unwrap_module(model).state_dict()
        if not isinstance(weights[i], dict):
            problems.append(f"model {i}: model_{i}.pt holds a {type(weights[i]).__name__}, not a state dict")
            continue
        weights[i] = names.for_module(weights[i], current)  # saved with or without torch.compile
        problems += _model_problems(i, current, weights[i], strict)
    types = state.get("types", {})  # absent in checkpoints of older versions: settings are compared instead
    for i, (opt, saved_state) in enumerate(zip(acc.optimizers, state["optimizers"])):
        if saved_state is not None:  # None: an engine's optimizer, checked by the engine
            problems += fit.optimizer_problems(f"optimizer {i}", opt, saved_state, _nth(types.get("optimizers"), i))
    for i, (sched, saved_state) in enumerate(zip(acc.schedulers, state["schedulers"])):
        problems += fit.scheduler_problems(f"scheduler {i}", sched, saved_state, _nth(types.get("schedulers"), i))
    if problems:
        raise CheckpointError(
            f"{url} does not fit this run; nothing was loaded. {len(problems)} mismatch(es), first: "
            f"{'; '.join(problems[:5])}. Load a checkpoint of these objects (the same model, optimizer and scheduler "
            f"classes, built the same way); strict=False allows missing or unexpected model keys.")
    saved_world = manifest["meta"].get("world_size")
    local, in_window, partial, mine = None, False, None, None
    try:  # each process's own file: checked on every process, then agreed on
        local = load_file(url, rng_name, manifest, weights_only=True, started=started) \
            if rng_name in manifest["files"] else None
        if local is not None:
            problem = _local_problem(local, _named_parameters(acc)) or _rng_fits(local["rng"])
            if problem:
                raise CheckpointError(f"{url}/{rng_name} is damaged: {problem}. Nothing was loaded.")
        in_window, partial = _partial_gradients(url, manifest, acc, local, saved_world)
    except CheckpointError as err:
        mine = str(err)
    problem = _agree(strategy, mine)
    if problem:
        raise CheckpointError(problem)

    if local is not None and saved_world == strategy.world_size:  # this process's own loader streams
        own_loaders = local.get("loaders", [])
        state["dataloaders"] = [{**saved, **own_loaders[i]} if i < len(own_loaders) and isinstance(saved, dict)
                                else saved for i, saved in enumerate(state["dataloaders"])]
    elif saved_world is not None and saved_world != strategy.world_size:
        _every_source(url, manifest, state["dataloaders"], saved_world)

    # -- applying: the objects that judge their own saved state first, so that a refusal changes nothing
    applied = _Applied()
    lists = {"dataloaders": acc.dataloaders, "custom": acc.registered_objects, "schedulers": acc.schedulers}
    labels = {"dataloaders": "dataloader", "custom": "registered object", "schedulers": "scheduler"}
    steps: List[Tuple[str, Callable[[], None]]] = []
    for kind in ("dataloaders", "custom", "schedulers"):
        for i, (obj, saved_state) in enumerate(zip(lists[kind], state[kind])):
            what = f"{labels[kind]} {i} ({type(obj).__name__})"
            steps.append((what, functools.partial(applied.load, what, obj, saved_state)))
    steps.append(("the loss scaler", lambda: applied.load("the loss scaler", strategy.precision, state["precision"])))
    for i, (obj, saved_state) in enumerate(zip(acc.per_process_objects, (local or {}).get("objects", []))):
        what = f"per-process object {i} ({type(obj).__name__})"
        steps.append((what, functools.partial(applied.load, what, obj, saved_state)))
    mine = None
    for what, step in steps:
        try:
            step()
        except Exception as err:
            mine = str(_failure(url, applied, what, err))
            break
    # before optimizers and weights, whose loading may take collectives (a sharded optimizer's full state is
    # scattered): every process goes on, or none
    problem = _agree(strategy, mine)
    if problem:
        if mine is None:
            applied.roll_back()
        raise CheckpointError(problem)
    for i, (opt, saved_state) in enumerate(zip(acc.optimizers, state["optimizers"])):
        if saved_state is not None:  # None: an engine's optimizer, restored with its own files
            what = f"optimizer {i} ({type(opt).__name__})"
            try:
                applied.load_optimizer(what, opt, saved_state)
            except Exception as err:
                raise _failure(url, applied, what, err) from err
    heavy: List[Tuple[str, Callable[[], None]]] = []
    if apply_engine is not None:
        heavy.append((f"the {saved_as} model and optimizer state", apply_engine))
    for i, (model, saved_weights) in enumerate(zip(acc.models, weights)):
        load = functools.partial(strategy.checkpoint_format.load_module_state_dict, model, saved_weights, strict=strict)
        heavy.append((f"model {i}", load))
    for what, step in heavy:
        # checked to fit above; what still fails here (memory, a collective) leaves the weights partly loaded:
        # keeping a copy of every model to put back would cost as much memory again
        try:
            step()
        except Exception as err:
            raise _failure(url, applied, what, err, partly=True) from err
    if local is not None:
        restore_rng_state(local["rng"])
    acc.gradient_state.sync_gradients = not in_window
    for model, saved in zip(acc.models, partial or []):
        for name, p in acc.unwrap_model(model).named_parameters():
            p.grad = saved[name].to(p.device) if name in saved else None
    if saved_world is not None and saved_world != strategy.world_size:
        if strategy.is_global_zero:
            warnings.warn(
                f"{url} was saved by {saved_world} process(es); this run has {strategy.world_size}. Weights, optimizer "
                f"state, the data position (in samples: the epoch goes on with the next unseen sample) and a partial "
                f"accumulation window are restored, but each process's random stream and the batches' grouping "
                f"differ, so training continues correctly but will not repeat the uninterrupted run bit for bit.",
                stacklevel=3)
    elif local is None:
        warnings.warn(
            f"{url} has no random state for rank {strategy.global_rank}; training continues but will not repeat "
            f"the uninterrupted run bit for bit.", stacklevel=3)
    acc.step = int(manifest["meta"].get("step", 0))
    return url


def _model_problems(index: int, current: Dict[str, Any], saved: Dict[str, Any], strict: bool) -> List[str]:
    problem = fit.fit_problem(fit.shapes_of(current), fit.shapes_of(saved), strict)
    problems = [f"model {index}: {problem}"] if problem else []
    kinds = fit.dtype_problems(current, saved)
    if kinds:
        problems.append(f"model {index}: {len(kinds)} tensor(s) hold another kind of number, first: {kinds[:3]}")
    return problems


def _nth(values: Any, i: int) -> Optional[str]:
    return values[i] if isinstance(values, list) and i < len(values) and isinstance(values[i], str) else None
