"""Sharded checkpoints: model and optimizer state written by every process through
torch.distributed.checkpoint (DCP), inside fabric_lite's checkpoint layout.

Each process writes the shards it holds (``__<rank>_<n>.distcp``), rank 0 the index (``.metadata``);
the files sit in the checkpoint directory next to ``training_state.pt`` and the ``rng_<rank>.pt``
files, are checksummed into the manifest, and are published with the rest (staged, manifest last,
moved into place). The manifest records the format as ``"engine": "dcp"``.

Keys are the user's parameter names (``model_<i>.<name>``, ``optimizer_<j>.state.<name>.<key>``),
whatever wraps the module, so such a checkpoint loads into any strategy that hands out state
dicts, on any number of processes: DCP reads into whatever tensors the loading run holds (its
shards under FSDP, whole tensors under DDP or on one device). `consolidate` assembles the whole
weights without a process group (`fabric-lite consolidate`).
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Type

import torch

from fabric_lite.checkpoint import checksums as digests
from fabric_lite.checkpoint import dcp_reading
from fabric_lite.checkpoint import files as checkpoint_io
from fabric_lite.checkpoint.checksums import is_local
from fabric_lite.checkpoint.files import CheckpointError, CheckpointWriter
from fabric_lite.checkpoint.fit import fit_problem, shapes_of
from fabric_lite.checkpoint.names import canonical, canonical_state, for_module

__all__ = ["ENGINE", "save", "local_state", "write", "read", "consolidate", "is_shard_file", "optimizer_state_by_name"]

ENGINE = "dcp"
METADATA = ".metadata"


def is_shard_file(name: str) -> bool:
    """Whether a manifest entry is one of DCP's files."""
    return name == METADATA or (name.startswith("__") and name.endswith(".distcp"))


def _writer(fs: Any, path: str) -> Any:
    import torch.distributed.checkpoint as dcp

    if is_local(fs):
        return dcp.FileSystemWriter(path, sync_files=False)
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    return FsspecWriter(fs.unstrip_protocol(path), sync_files=False)


def _reader(fs: Any, path: str, metadata: Any) -> Any:
    """DCP's reader over a verified checkpoint, given the index read safely (`dcp_reading`)."""
    return dcp_reading.reader(is_local(fs), path if is_local(fs) else fs.unstrip_protocol(path), metadata)


def _checksum(fs: Any, path: str, algorithm: str = digests.CHECKSUM) -> str:
    value = digests.digest(algorithm)
    with fs.open(path, "rb") as f:
        for chunk in iter(lambda: f.read(digests.CHUNK), b""):
            value.update(chunk)
    return value.hexdigest()


def parameter_names(module: torch.nn.Module) -> Dict[int, str]:
    """id(parameter) -> its canonical name (the module's state-dict key without wrapper segments)."""
    return {id(v): canonical(k) for k, v in module.state_dict(keep_vars=True).items()}


def optimizer_state_by_name(module: Optional[torch.nn.Module], optimizer: torch.optim.Optimizer) -> Dict[str, Any]:
    """`optimizer.state_dict()` keyed by parameter name instead of position (tensors left as they are)."""
    names = parameter_names(module) if module is not None else {}
    params = [p for group in optimizer.param_groups for p in group["params"]]
    keys = [names.get(id(p), f"param_{i}") for i, p in enumerate(params)]
    sd = optimizer.state_dict()
    positions = [i for group in sd["param_groups"] for i in group["params"]]
    by_position = dict(zip(positions, keys))
    groups = [{**g, "params": [by_position[i] for i in g["params"]]} for g in sd["param_groups"]]
    return {"state": {by_position[i]: s for i, s in sd["state"].items()}, "param_groups": groups}


def _by_position(optimizer: torch.optim.Optimizer, state: Dict[str, Any], keys: List[str]) -> Dict[str, Any]:
    positions = {k: i for i, k in enumerate(keys)}
    groups = [{**g, "params": [positions[k] for k in g["params"]]} for g in state["param_groups"]]
    return {"state": {positions[k]: s for k, s in state["state"].items()}, "param_groups": groups}


def _initialize_state(optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor]) -> None:
    """Create the state tensors of `params` that have none (one step with zero gradients for them alone, at
    learning rate 0, which changes no weight and no other parameter's state) so that DCP has tensors, of
    the right shards, to read into."""
    needing = {id(p) for p in params if p not in optimizer.state}
    if not needing:
        return
    saved_grads = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            saved_grads.append((p, p.grad))
            p.grad = torch.zeros_like(p) if id(p) in needing else None  # (frozen parameters too)
    saved_lrs = [(group, group["lr"]) for group in optimizer.param_groups if "lr" in group]
    for group, lr in saved_lrs:
        group["lr"] = torch.zeros_like(lr) if isinstance(lr, torch.Tensor) else 0.0
    try:
        optimizer.step()
    except Exception as err:
        raise CheckpointError(
            f"{type(optimizer).__name__}'s state cannot be restored from a sharded checkpoint: creating its state "
            f"tensors (one step at learning rate 0) failed: {err}. Save its checkpoints with "
            f"state_dict_type='full' instead.") from err
    finally:
        for group, lr in saved_lrs:
            group["lr"] = lr
        for p, grad in saved_grads:
            p.grad = grad


def _blank(value: Any) -> Any:
    """A copy of `value`'s structure with new tensors of the same shapes and shards, for DCP to read into: it
    writes in place, so a load that fails part-way must not have written into the model or the optimizer."""
    if isinstance(value, torch.Tensor):
        return torch.empty_like(value)
    if isinstance(value, dict):
        return {k: _blank(v) for k, v in value.items()}
    return value


def _summary(err: BaseException) -> str:
    """DCP's exception carries every rank's traceback: keep the distinct error lines."""
    lines = [line.strip() for line in str(err).splitlines() if "Error:" in line]
    distinct = list(dict.fromkeys(lines))
    return "; ".join(distinct[:3]) if distinct else str(err)


def _dcp_errors() -> Tuple[Type[BaseException], ...]:
    """What DCP raises: its CheckpointException derives from BaseException, not Exception."""
    from torch.distributed.checkpoint.api import CheckpointException

    return (Exception, CheckpointException)


@contextlib.contextmanager
def _quiet_lone_process() -> Any:
    """DCP warns that it assumes one process whenever it runs without a process group; that is the intent here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def _gather(strategy: Any, value: Any) -> List[Any]:
    return strategy.collectives.all_gather_object(value)


def local_state(strategy: Any, models: Sequence[torch.nn.Module],
                optimizers: Sequence[Tuple[Optional[torch.nn.Module], torch.optim.Optimizer]]) -> Dict[str, Any]:
    """This process's part of every model and optimizer, keyed by name (sharded tensors as they are: DTensors)."""
    state: Dict[str, Any] = {f"model_{i}": canonical_state(strategy.unwrap_module(m).state_dict())
                             for i, m in enumerate(models)}
    for j, (module, optimizer) in enumerate(optimizers):
        state[f"optimizer_{j}"] = optimizer_state_by_name(
            strategy.unwrap_module(module) if module is not None else None, optimizer)
    return state


def _planner() -> Any:
    """DCP's planner, keeping the plan of the last save: where no process's layout changed (the same tensors,
    shapes and shards as last time), the processes skip sending their plans and DCP reuses the global plan."""
    from torch.distributed.checkpoint import DefaultSavePlanner

    try:
        return DefaultSavePlanner(enable_plan_caching=True)
    except TypeError:  # pragma: no cover (a torch without plan caching)
        return DefaultSavePlanner()


def write(writer: CheckpointWriter, state: Dict[str, Any], strategy: Any, group: Any = None) -> None:
    """Every rank: write `state` (`local_state`, or a host copy of it) into `writer`'s staging dir, agreeing over
    `group` (None: the training group). A rank whose state could not be taken passes {}: it still takes part,
    so that no other rank waits for it (its error aborts the save)."""
    import torch.distributed.checkpoint as dcp

    try:
        with _quiet_lone_process():
            dcp.save(state, storage_writer=_writer(writer.fs, writer.staging), planner=_planner(),
                     process_group=group, no_dist=strategy.world_size == 1)
    except _dcp_errors() as err:  # an Exception, so that save_state reports it from every rank and aborts
        raise CheckpointError(f"writing the shards failed: {_summary(err)}") from err
    rank = strategy.global_rank
    writer.fs.invalidate_cache(writer.staging)  # (an object store's listing may predate the writes)
    for entry in writer.fs.ls(writer.staging, detail=False):
        name = entry.rstrip("/").rsplit("/", 1)[-1]
        if name.startswith(f"__{rank}_") or (name == METADATA and rank == 0):
            writer.checksums[name] = _checksum(writer.fs, entry)


def save(writer: CheckpointWriter, strategy: Any, models: Sequence[torch.nn.Module],
         optimizers: Sequence[Tuple[Optional[torch.nn.Module], torch.optim.Optimizer]]) -> None:
    """Every rank: write this process's shards of every model and optimizer into `writer`'s staging dir."""
    write(writer, local_state(strategy, models, optimizers), strategy)


def _verify(url: str, manifest: Dict[str, Any], strategy: Any) -> Any:
    """Every rank checks its share of the shard files against the manifest (any bad file stops all) and reads
    DCP's index safely; returns the index."""
    fs, path = checkpoint_io.filesystem(url)
    names = sorted(n for n in manifest["files"] if is_shard_file(n))
    if METADATA not in names:
        raise CheckpointError(f"{url} records the {ENGINE} format but has no {METADATA}; it is damaged.")
    algorithm = manifest.get("checksum", "sha256")
    digests.digest(algorithm)  # an unknown algorithm is refused: no file goes unchecked
    errors = []
    for name in names[strategy.global_rank::strategy.world_size]:
        if name == METADATA:
            continue  # every rank reads and checks the index below
        try:  # (every problem is gathered: a rank that raised alone would leave the others waiting)
            full = checkpoint_io.member_path(fs, path, name, url)
            if not fs.exists(full):
                errors.append(f"{name} is missing")
            elif _checksum(fs, full, algorithm) != manifest["files"][name]:
                errors.append(f"{name} does not match its checksum (corrupt)")
        except (CheckpointError, OSError) as err:
            errors.append(f"{name}: {err}")
    index = None
    try:
        # read once, and what was checked is what is parsed
        with fs.open(checkpoint_io.member_path(fs, path, METADATA, url), "rb") as f:
            index = f.read()
    except FileNotFoundError:
        errors.append(f"{METADATA} is missing")
    except (CheckpointError, OSError) as err:
        errors.append(f"{METADATA}: {err}")
    if index is not None and digests.checksum_of(index, manifest["files"][METADATA], algorithm) != manifest["files"][METADATA]:
        errors.append(f"{METADATA} does not match its checksum (corrupt)")
    found = [e for part in _gather(strategy, errors) for e in part]
    if found or index is None:  # (a missing index is among the errors found)
        raise CheckpointError(f"{url}: {'; '.join(found[:5])}. Nothing was loaded. Load an earlier checkpoint.")
    return dcp_reading.read_metadata(index, {n for n in names if n != METADATA}, url)


def _tensor_shapes(metadata: Any) -> Dict[str, Tuple[int, ...]]:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    return {k: tuple(m.size) for k, m in metadata.state_dict_metadata.items() if isinstance(m, TensorStorageMetadata)}


def _check_model(url: str, index: int, current: Dict[str, Any], saved: Dict[str, Tuple[int, ...]], strict: bool) -> None:
    prefix = f"model_{index}."
    mine = {k[len(prefix):]: shape for k, shape in saved.items() if k.startswith(prefix)}
    problem = fit_problem(shapes_of(current), mine, strict)
    if problem:
        raise CheckpointError(f"{url} does not fit model {index}: {problem}. Nothing was loaded. Load a checkpoint "
                              f"of this model (strict=False allows missing or unexpected keys).")


def read(url: str, manifest: Dict[str, Any], strategy: Any, models: Sequence[torch.nn.Module],
         optimizers: Sequence[Tuple[Optional[torch.nn.Module], torch.optim.Optimizer]], strict: bool) -> Callable[[], None]:
    """Verify the shard files and check they fit the models now; return what loads them (every rank)."""
    metadata = _verify(url, manifest, strategy)
    fs, path = checkpoint_io.filesystem(url)
    saved = _tensor_shapes(metadata)
    states = [canonical_state(strategy.unwrap_module(m).state_dict()) for m in models]
    for i, current in enumerate(states):
        _check_model(url, i, current, saved, strict)

    def apply() -> None:
        import torch.distributed.checkpoint as dcp

        target: Dict[str, Any] = {}
        for i, current in enumerate(states):
            target[f"model_{i}"] = {k: _blank(v) for k, v in current.items() if f"model_{i}.{k}" in saved}
        layouts = []
        before = [{p: dict(s) for p, s in optimizer.state.items()} for _, optimizer in optimizers]
        try:
            for j, (module, optimizer) in enumerate(optimizers):
                owner = strategy.unwrap_module(module) if module is not None else None
                prefix = f"optimizer_{j}.state."
                # the parameters with saved state (a key is <prefix><parameter name>.<state name>)
                stored = {k[len(prefix):].rsplit(".", 1)[0] for k in saved if k.startswith(prefix)}
                params = [p for group in optimizer.param_groups for p in group["params"]]
                keys = [k for g in optimizer_state_by_name(owner, optimizer)["param_groups"] for k in g["params"]]
                _initialize_state(optimizer, [p for p, k in zip(params, keys) if k in stored])
                by_name = optimizer_state_by_name(owner, optimizer)
                by_name["state"] = {k: _blank(v) for k, v in by_name["state"].items() if k in stored}
                target[f"optimizer_{j}"] = by_name
                layouts.append(keys)
            with _quiet_lone_process():
                dcp.load(target, storage_reader=_reader(fs, path, metadata), planner=dcp_reading.safe_load_planner(),
                         no_dist=strategy.world_size == 1)
        except _dcp_errors() as err:
            for (_, optimizer), state in zip(optimizers, before):  # nothing made up for the load stays behind
                optimizer.state.clear()
                optimizer.state.update(state)
            if isinstance(err, CheckpointError):
                raise
            raise CheckpointError(f"{url} could not be read into this run: {_summary(err)}. Nothing was kept of "
                                  f"it in the optimizers. Build the model and optimizers as the run that saved it "
                                  f"did (an optimizer with other settings keeps other state).") from err
        for i, m in enumerate(models):
            module = strategy.unwrap_module(m)
            module.load_state_dict(for_module(target[f"model_{i}"], module.state_dict()), strict=strict)
        for j, (_, optimizer) in enumerate(optimizers):
            # state only for the parameters that had it when saved, as a full checkpoint's load_state_dict gives
            optimizer.load_state_dict(_by_position(optimizer, target[f"optimizer_{j}"], layouts[j]))

    return apply


def consolidate(url: str, manifest: Dict[str, Any], model_index: int = 0) -> Dict[str, torch.Tensor]:
    """The whole weights of model `model_index` of a sharded checkpoint, in one process, without a process group."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    class _Lone:
        """A strategy's stand-in for one process without a process group (what `_verify` asks of it)."""

        global_rank, world_size = 0, 1

        class collectives:
            @staticmethod
            def all_gather_object(value: Any) -> List[Any]:
                return [value]

    metadata = _verify(url, manifest, _Lone)
    fs, path = checkpoint_io.filesystem(url)
    prefix = f"model_{model_index}."
    target = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype)
              for k, m in metadata.state_dict_metadata.items()
              if k.startswith(prefix) and isinstance(m, TensorStorageMetadata)}
    if not target:
        models = sorted({k.split(".", 1)[0] for k in metadata.state_dict_metadata if k.startswith("model_")})
        raise CheckpointError(f"{url} holds no model_{model_index}; it holds {models or 'no model weights'}.")
    try:
        with _quiet_lone_process():
            dcp.load(target, storage_reader=_reader(fs, path, metadata), planner=dcp_reading.safe_load_planner(),
                     no_dist=True)
    except _dcp_errors() as err:
        if isinstance(err, CheckpointError):
            raise
        raise CheckpointError(f"{url} could not be read: {_summary(err)}. Nothing was written.") from None
    return {k[len(prefix):]: v for k, v in target.items()}
