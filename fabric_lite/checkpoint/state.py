"""What `Accelerator.save_state` / `load_state` / `save_model` write, on top of checkpoint_io.

Layout of a state checkpoint (a directory, any fsspec URL):
``model_{i}.pt`` (the weights of each prepared model) and ``training_state.pt`` (optimizers,
schedulers, dataloader positions, registered objects, loss scaler) from the main process;
``rng_{rank}.pt`` (random states, partial accumulation gradients) from every process;
``manifest.json`` (checksums, format version, step counters) written last.

A strategy whose `checkpoint_format` is "dcp" (FSDP) writes model and optimizer state shard by shard
instead of ``model_{i}.pt`` (see `sharded.py`; the manifest says ``"engine": "dcp"``); one whose format
is an engine's (DeepSpeed) lets its engine write them. Which of the three a checkpoint
holds is read from its manifest, so a run loads whichever it is given where that can work: state
dicts and sharded checkpoints load into every strategy but an engine's, at any world size.

Few files on purpose: each file costs a serialization and a write (~0.3 ms on a local disk, a
request on an object store), and frequent small checkpoints are common.
"""

from __future__ import annotations

import json
import os
import re
import time
import warnings
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch

from fabric_lite.checkpoint import files as checkpoint_io
from fabric_lite.checkpoint import fit, locks, names, sharded
from fabric_lite.checkpoint.files import CheckpointError, CheckpointWriter
from fabric_lite.checkpoint.engines import engine_format
from fabric_lite.checkpoint.loading import load_file
from fabric_lite.checkpoint.restore import CHECKPOINT_RE, PER_PROCESS_LOADER_KEYS, TRAINING_STATE, load_state
from fabric_lite.checkpoint.saver import SaveJob, Snapshot
from fabric_lite.rng_state import capture_rng_state

if TYPE_CHECKING:
    from fabric_lite.accelerator.accelerator import Accelerator

__all__ = ["save_state", "load_state", "save_object", "save_model_weights", "read_weights", "parse_size",
           "export_weights", "TRAINING_STATE"]

_CHECKPOINT_RE = CHECKPOINT_RE


def parse_size(size: Union[int, str]) -> int:
    """'10GB' -> bytes (decimal units, as Accelerate's max_shard_size)."""
    if isinstance(size, int):
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B)\s*", str(size).upper())
    if not match:
        raise ValueError(f"max_shard_size={size!r} is not a size; write e.g. '500MB', '10GB' or a number of bytes.")
    value, unit = float(match.group(1)), match.group(2)
    factor = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
              "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}[unit]
    return int(value * factor)


def save_object(obj: Any, url: str, safe_serialization: bool = False) -> None:
    if safe_serialization:
        from safetensors.torch import save as st_save

        checkpoint_io.save_bytes(st_save(_unshare(obj)), url)
    else:
        checkpoint_io.save_file(obj, url)


def _unshare(state: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """safetensors refuses tensors sharing storage (tied weights): give each its own contiguous copy."""
    seen: set = set()
    out = {}
    for name, tensor in state.items():
        tensor = tensor.detach().cpu()
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset())
        out[name] = tensor.clone().contiguous() if key in seen or not tensor.is_contiguous() else tensor
        seen.add(key)
    return out


def save_model_weights(state: Dict[str, torch.Tensor], directory: str, max_shard_size: Union[int, str],
                       safe_serialization: bool) -> None:
    """Write weights as one file, or as shards plus an index above `max_shard_size` (Hugging Face layout)."""
    if "://" not in directory and os.path.isfile(directory):
        raise ValueError(f"save_model() needs a directory, but {directory} is a file.")
    limit = parse_size(max_shard_size)
    ext, stem = ("safetensors", "model") if safe_serialization else ("bin", "pytorch_model")
    shards: List[Dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > limit:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    fs, path = checkpoint_io.filesystem(directory)
    fs.makedirs(path, exist_ok=True)
    if len(shards) == 1:
        save_object(shards[0], f"{directory.rstrip('/')}/{stem}.{ext}", safe_serialization)
        return
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        name = f"{stem}-{i:05d}-of-{len(shards):05d}.{ext}"
        save_object(shard, f"{directory.rstrip('/')}/{name}", safe_serialization)
        weight_map.update({k: name for k in shard})
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in state.values())},
             "weight_map": weight_map}
    with fs.open(f"{path.rstrip('/')}/{stem}.{ext}.index.json", "w") as f:
        json.dump(index, f, indent=2, sort_keys=True)


def read_weights(source: str) -> Dict[str, torch.Tensor]:
    """Full weights from a .safetensors/.pt/.bin file, a `save_model` directory (one file or shards with an
    index), or a fabric_lite checkpoint (its model 0); tensors load safely (weights_only)."""
    fs, path = checkpoint_io.filesystem(source)
    if fs.isdir(path):
        if fs.exists(f"{path.rstrip('/')}/{checkpoint_io.MANIFEST}"):
            import tempfile

            with tempfile.TemporaryDirectory(prefix="fabric-lite-weights-") as tmp:
                export_weights(source, f"{tmp}/weights.pt")
                return torch.load(f"{tmp}/weights.pt", weights_only=True)
        names = [e.rstrip("/").rsplit("/", 1)[-1] for e in fs.ls(path, detail=False)]
        for stem in ("model.safetensors", "pytorch_model.bin"):
            if stem in names:
                return read_weights(f"{source.rstrip('/')}/{stem}")
            if f"{stem}.index.json" in names:
                with fs.open(f"{path.rstrip('/')}/{stem}.index.json", "r") as f:
                    shards = sorted(set(json.load(f)["weight_map"].values()))
                state: Dict[str, torch.Tensor] = {}
                for shard in shards:
                    state.update(read_weights(f"{source.rstrip('/')}/{shard}"))
                return state
        raise ValueError(f"{source} holds no weights this can read (model.safetensors, pytorch_model.bin, their "
                         f"sharded index, or a fabric_lite checkpoint); it holds {sorted(names)[:10]}.")
    if not fs.exists(path):
        raise FileNotFoundError(f"No weights at {source}.")
    with fs.open(path, "rb") as f:
        data = f.read()
    if path.endswith(".safetensors"):
        from safetensors.torch import load as st_load

        return st_load(data)
    import io

    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


def _checkpoints_root(acc: "Accelerator") -> str:
    if acc.project_dir is None:
        raise ValueError(
            "save_state()/load_state() without a path need automatic_checkpoint_naming and a project_dir: "
            "Accelerator(project_config=ProjectConfiguration(project_dir='runs', automatic_checkpoint_naming=True))."
        )
    return f"{os.fspath(acc.project_dir).rstrip('/')}/checkpoints"


def _numbered_checkpoints(root: str) -> List[tuple]:
    fs, path = checkpoint_io.filesystem(root)
    if not fs.exists(path):
        return []
    found = []
    for entry in fs.ls(path, detail=False):
        match = _CHECKPOINT_RE.search(entry.rstrip("/"))
        if match:
            found.append((int(match.group(1)), f"{root}/checkpoint_{match.group(1)}"))
    return sorted(found)


def save_state(acc: "Accelerator", output_dir: Optional[Union[str, os.PathLike]], update_latest: bool = False,
               meta: Optional[Dict[str, Any]] = None, blocking: bool = True, if_busy: str = "wait",
               durable: bool = False, after_commit: Sequence[Callable[[], None]] = ()) -> Optional[str]:
    """Save a checkpoint (every process, together); returns its URL, or None when skipped (``if_busy="skip"``
    while a background save is still running). `blocking=False` returns once the state is copied (the rest
    runs on a background thread, see `saver.py`); `after_commit` runs on the main process once it is published."""
    blocked_since = time.perf_counter()
    project = acc.project_configuration
    automatic = project.automatic_checkpoint_naming
    if automatic:  # as in Accelerate, automatic naming decides the location
        output_dir = f"{_checkpoints_root(acc)}/checkpoint_{project.iteration}"
    elif output_dir is None:
        raise ValueError(
            "save_state() needs a directory, or automatic naming: Accelerator(project_config="
            "ProjectConfiguration(project_dir='runs', automatic_checkpoint_naming=True))."
        )
    url = os.fspath(output_dir)
    fs, path = checkpoint_io.filesystem(url)
    if fs.isfile(path):  # a checkpoint is a directory: publishing one here would delete the file
        raise FileExistsError(f"save_state({url!r}): a file exists at that path, and a checkpoint is a directory. "
                              f"Save to another path, or move the file away; it was left as it was.")
    saver = acc.checkpoint_saver
    if not saver.make_room(if_busy):
        return None
    strategy = acc.strategy
    token = strategy.collectives.broadcast_object(os.urandom(6).hex())
    engine = strategy.checkpoint_format.engine  # None (state dicts), "dcp" (sharded) or the engine's name
    reason = None if blocking else saver.why_blocking()
    if reason is not None:
        saver.warn_once(reason)
    background = not blocking and reason is None
    job = SaveJob(url, token, update_latest=update_latest or automatic, durable=durable,
                  after_commit=list(after_commit))
    mesh = strategy.device_mesh  # (an N-D layout is recorded: "layout": {"dp": 2, "tp": 2})
    job.meta = {"step": acc.step, "world_size": strategy.world_size, "iteration": project.iteration,
                **({"engine": engine} if engine else {}),
                **({"layout": dict(zip(mesh.names, mesh.sizes))} if len(mesh.names) > 1 else {}), **(meta or {})}
    shards: Optional[Dict[str, Any]] = {} if engine == sharded.ENGINE else None
    if shards is not None:  # (set first: a rank whose state could not be taken still takes part in DCP's write)
        job.write_more = lambda writer, group: sharded.write(writer, shards or {}, strategy, group)  # noqa: E731
    elif engine is not None and not background:
        job.write_more = lambda writer, group: strategy.checkpoint_format.save_engine_state(writer)  # noqa: E731
    taken = Snapshot(saver.buffers) if background else None
    try:
        # the training thread's part: this process's state (and, in the background, a host copy of it)
        files = _collect(acc, url, engine)
        if shards is not None:
            optimizers = [(opt.module, opt.optimizer) for opt in acc.optimizers]
            shards = sharded.local_state(strategy, acc.models, optimizers)
        if taken is not None:
            files = taken.copy(files)
            if engine is not None and shards is None:  # an engine hands over its files, each copied at once
                files.update(strategy.checkpoint_format.stage_engine_state(taken.copy))
            if shards is not None:
                shards = taken.copy(shards)
            job.ready = taken.finish()
        job.files = files
    except Exception as err:  # reported through the job: the other processes must not wait for this one
        job.error = err
        shards = {}
        if taken is not None and job.ready is None:
            try:
                job.ready = taken.finish()  # (the copies already queued end before the buffers are reused)
            except Exception:
                pass
    if automatic and project.total_limit is not None:
        root, limit = _checkpoints_root(acc), project.total_limit

        def prune() -> None:
            """deleting numbered checkpoints beyond total_limit"""
            _prune(root, limit)

        job.after_commit.append(prune)
    saver.run(job, background, blocked_since)  # a blocking save that fails raises here
    if automatic:
        project.iteration += 1  # (a background save takes its name now, whatever becomes of it)
    saver.raise_deferred(url)  # the save before this one failed: said now that this one is under way
    return url


def _prune(root: str, limit: int) -> None:
    """Delete the oldest numbered checkpoints beyond `limit` (main process, after a publish)."""
    fs, path = checkpoint_io.filesystem(root)
    with locks.publishing(fs, path):  # another run pruning the same directory waits
        existing = _numbered_checkpoints(root)
        for _, old in existing[: max(0, len(existing) - limit)]:
            fs.rm(checkpoint_io.filesystem(old)[1], recursive=True)


def _collect(acc: "Accelerator", url: str, engine: Optional[str]) -> Dict[str, Any]:
    """This process's files (name -> object): model and optimizer state only where they are state dicts (a
    sharded checkpoint's shards and an engine's files are written by `sharded.write` and the engine)."""
    strategy = acc.strategy
    if engine is None:
        # State dicts are built on every rank: sharded strategies need all ranks to assemble them.
        weights = [names.canonical_state(strategy.checkpoint_format.module_state_dict(model)) for model in acc.models]
    else:
        weights = []
    for hook in acc.save_state_pre_hooks.values():
        hook(acc.models, weights, url)
    files: Dict[str, Any] = {f"model_{i}.pt": w for i, w in enumerate(weights)}
    loaders = [loader.state_dict() for loader in acc.dataloaders]
    files[TRAINING_STATE] = {
        "models": len(acc.models),
        "optimizers": [None if engine else opt.state_dict() for opt in acc.optimizers],
        "schedulers": [sched.state_dict() for sched in acc.schedulers],
        "dataloaders": loaders,
        "custom": [obj.state_dict() for obj in acc.registered_objects],
        "precision": strategy.precision.state_dict(),
        # checked on load, before anything changes (fit.py)
        "types": {"optimizers": [fit.type_name(opt) for opt in acc.optimizers],
                  "schedulers": [fit.type_name(sched) for sched in acc.schedulers]},
    }
    if not strategy.is_global_zero:
        files = {}
    files[f"rng_{strategy.global_rank}.pt"] = _process_local_state(acc, loaders)
    return files


def _process_local_state(acc: "Accelerator", loaders: List[Dict[str, Any]]) -> Dict[str, Any]:
    """What differs between processes: RNG states, each loader's random streams (the global RNG states recorded
    when its epoch was drawn, its workers' states), and mid-accumulation gradients (not yet all-reduced)."""
    state: Dict[str, Any] = {"rng": capture_rng_state(), "objects": [o.state_dict() for o in acc.per_process_objects],
                             "loaders": [{k: s[k] for k in PER_PROCESS_LOADER_KEYS if k in s} for s in loaders]}
    if not acc.gradient_state.sync_gradients and not acc.strategy.checkpoint_format.partial_gradients:
        warnings.warn(
            f"save_state inside a gradient accumulation window: {type(acc.strategy).__name__} keeps "
            f"the window's partial gradients in its own buffers, which are not saved. A run resumed from this "
            f"checkpoint steps with the rest of the window only. Save after an optimizer step to resume exactly.",
            stacklevel=4,
        )
    elif not acc.gradient_state.sync_gradients:
        state["partial_grads"] = [
            {name: p.grad for name, p in acc.unwrap_model(m).named_parameters() if p.grad is not None}
            for m in acc.models
        ]
    return state


def export_weights(checkpoint: Union[str, os.PathLike], out: Union[str, os.PathLike],
                   model_index: int = 0) -> Tuple[int, str]:
    """Write the weights of model `model_index` of a checkpoint as one file (safetensors if `out`
    ends in .safetensors, else torch.save; an existing directory gets ``model_{index}.pt`` inside).
    Checks the checksum first; returns the number of tensors and the file written."""
    url = os.fspath(checkpoint)
    manifest = checkpoint_io.read_manifest(url)
    out = os.fspath(out)
    fs, out_path = checkpoint_io.filesystem(out)
    if out.endswith(("/", os.sep)) or fs.isdir(out_path):
        out = f"{out.rstrip('/').rstrip(os.sep)}/model_{model_index}.pt"
    return _export(url, manifest, out, model_index), out


def _export(url: str, manifest: Dict[str, Any], out: str, model_index: int) -> int:
    engine = manifest["meta"].get("engine")
    if engine == sharded.ENGINE:
        state = sharded.consolidate(url, manifest, model_index)
        save_object(state, out, safe_serialization=out.endswith(".safetensors"))
        return len(state)
    if engine:  # written by a strategy's own engine: that strategy consolidates it
        owner = engine_format(engine)
        if owner is None:
            raise CheckpointError(f"{url} was written by the {engine!r} checkpoint engine, which no registered "
                                  f"strategy provides; register the strategy that wrote it.")
        if model_index != 0:
            raise CheckpointError(f"{url} is a {engine} checkpoint, which holds one model; model_index must be 0.")
        state = owner.consolidate(url, manifest)
        save_object(state, out, safe_serialization=out.endswith(".safetensors"))
        return len(state)
    name = f"model_{model_index}.pt"
    if name not in manifest["files"]:
        models = sorted(f for f in manifest["files"] if re.fullmatch(r"model_\d+\.pt", f))
        raise CheckpointError(f"{url} has no {name}; it holds {models or 'no model weights'}.")
    state = load_file(url, name, manifest, weights_only=True)
    save_object(state, out, safe_serialization=out.endswith(".safetensors"))
    return len(state)
