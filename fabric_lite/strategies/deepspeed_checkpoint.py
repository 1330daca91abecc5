"""DeepSpeed's own checkpoint files, kept inside fabric_lite checkpoints.

The engine still decides what each rank saves (its module states, its ZeRO partition of the
optimizer), but every file goes through a `CheckpointWriter`: streamed to any fsspec URL with a
checksum, staged and published with the rest of the checkpoint, so top-k pruning, `latest`,
crash-safety and exact resume work as for any other strategy. Loading reads each file through
`checkpoint.loading.load_file` (checksum verified, `weights_only=True` with DeepSpeed's few plain-data
classes allowed) before the engine applies anything.

Files are named ``deepspeed_<engine's file name>`` at the top of the checkpoint directory.
"""

from __future__ import annotations

import contextlib
import fnmatch
import os
import re
import tempfile
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional

import torch
from torch import nn

from fabric_lite.checkpoint.files import CheckpointError, CheckpointWriter
from fabric_lite.checkpoint.loading import load_file
from fabric_lite.strategies.checkpoint_format import CheckpointFormat

if TYPE_CHECKING:
    from fabric_lite.strategies.deepspeed import DeepSpeedStrategy

__all__ = ["DeepSpeedCheckpointFormat", "save_engine_state", "stage_engine_state", "read_engine_state", "consolidate",
           "match_module_keys", "PREFIX", "ENGINE"]

ENGINE = "deepspeed"
PREFIX = "deepspeed_"
_TAG = "engine"
# A path the engine believes it writes under; nothing is created there (the adapter maps it to the writer).
_ROOT = os.path.join(tempfile.gettempdir(), "fabric-lite-deepspeed-checkpoint")


def _safe_classes() -> List[Any]:
    """DeepSpeed classes found in its optimizer files: plain data, safe to rebuild under weights_only."""
    found: List[Any] = []
    for module_name, names in (
        ("deepspeed.runtime.fp16.loss_scaler", ("LossScaler", "DynamicLossScaler")),
        ("deepspeed.runtime.zero.config", ("ZeroStageEnum",)),
        ("deepspeed.utils.tensor_fragment", ("fragment_address",)),
    ):
        try:
            module = __import__(module_name, fromlist=list(names))
        except ImportError:
            continue
        found.extend(getattr(module, n) for n in names if hasattr(module, n))
    return found


@contextlib.contextmanager
def _allow_deepspeed_classes() -> Any:
    with torch.serialization.safe_globals(_safe_classes()):
        yield


def _adapter(save: Optional[Callable[[str, Any], None]] = None, load: Optional[Callable[[str], Any]] = None) -> Any:
    from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointEngine

    class _CheckpointIOEngine(CheckpointEngine):
        """DeepSpeed's checkpoint-engine interface over a CheckpointWriter (save) or a verified reader (load)."""

        def __init__(self) -> None:
            super().__init__()
            self.name = "fabric_lite"

        def create(self, info: Any) -> None:
            pass

        def makedirs(self, path: str, exist_ok: bool = False) -> None:
            pass

        def save(self, state_dict: Any, path: str) -> None:
            assert save is not None
            save(os.path.basename(path), state_dict)

        def load(self, path: str, map_location: Any = None) -> Any:
            assert load is not None
            return load(os.path.basename(path))

        def commit(self, info: Any) -> bool:
            return True

    return _CheckpointIOEngine()


@contextlib.contextmanager
def _engine_io(engine: Any, adapter: Any) -> Any:
    saved_engine = engine.checkpoint_engine
    engine.checkpoint_engine = adapter
    try:
        yield
    finally:
        engine.checkpoint_engine = saved_engine


@contextlib.contextmanager
def _shadow_directory(manifest: Dict[str, Any]) -> Any:
    """Empty stand-ins for the engine's files: the engine finds files by glob and checks that they
    exist before it asks its checkpoint engine (our adapter) for their content."""
    with tempfile.TemporaryDirectory(prefix="fabric-lite-deepspeed-") as root:
        os.makedirs(os.path.join(root, _TAG))
        for name in manifest["files"]:
            if name.startswith(PREFIX):
                open(os.path.join(root, _TAG, name[len(PREFIX):]), "wb").close()
        yield root


def save_engine_state(strategy: "DeepSpeedStrategy", writer: CheckpointWriter) -> None:
    """Every rank: the engine writes its files (module states, this rank's ZeRO partition) through `writer`."""
    engine = strategy.engine
    failures: List[BaseException] = []

    def save(name: str, obj: Any) -> None:
        # A failed write must not leave this rank out of the engine's barriers (the others would wait
        # there for ever): note it, let the engine finish, and raise after; save_state then reports
        # every rank's failure together.
        try:
            writer.write(PREFIX + name, obj)
        except Exception as err:
            failures.append(err)

    with _engine_io(engine, _adapter(save=save)):
        engine.save_checkpoint(_ROOT, tag=_TAG, client_state={}, save_latest=False)
    if failures:
        raise failures[0]


def stage_engine_state(strategy: "DeepSpeedStrategy", keep: Callable[[Any], Any]) -> Dict[str, Any]:
    """Every rank: the files the engine would write (module states, this rank's ZeRO partition), named as
    `save_engine_state` names them, each passed through `keep` as the engine hands it over, nothing written.

    The engine's own save runs here, on the training thread, with its barriers on the training group; only its
    writes are taken out (the adapter keeps each object instead). `keep` copies the tensors to host memory at
    once, so what the engine does after handing a file over (its checkpoint epilogue) cannot change the copy;
    the background thread then writes these objects as the engine would have (`torch.save` through the writer)."""
    engine = strategy.engine
    staged: Dict[str, Any] = {}

    def save(name: str, obj: Any) -> None:
        staged[PREFIX + name] = keep(obj)

    with _engine_io(engine, _adapter(save=save)):
        engine.save_checkpoint(_ROOT, tag=_TAG, client_state={}, save_latest=False)
    return staged


def _module_keys(state: Dict[str, Any]) -> List[str]:
    return list(state.get("module") or {})


def read_engine_state(strategy: "DeepSpeedStrategy", url: str, manifest: Dict[str, Any], strict: bool) -> Callable[[], None]:
    """Read and verify this rank's engine files now; return the function that loads them into the engine."""
    engine = strategy.engine
    if manifest["meta"].get("engine") != ENGINE:
        raise CheckpointError(
            f"{url} was not written by the DeepSpeed strategy, so it holds no engine state for it. Load it with the "
            f"strategy that wrote it, or take its weights (`fabric-lite consolidate {url} weights.pt`) into a fresh run."
        )
    saved_world = manifest["meta"].get("world_size")
    if saved_world is not None and saved_world != strategy.world_size:
        raise CheckpointError(
            f"{url} was saved by {saved_world} DeepSpeed process(es); this run has {strategy.world_size}. ZeRO keeps "
            f"one optimizer partition per process, so resume with {saved_world} processes, or start from the "
            f"consolidated weights (`fabric-lite consolidate {url} weights.pt`)."
        )
    cache: Dict[str, Any] = {}

    def load(name: str) -> Any:
        if name not in cache:
            with _allow_deepspeed_classes():
                cache[name] = load_file(url, PREFIX + name, manifest, weights_only=True)
        return cache[name]

    own = [os.path.basename(p) for p in _own_files(engine, manifest)]
    for name in own:
        load(name)
    # Checked with strict=False too: ZeRO restores its optimizer partitions by position, so a model with
    # other parameters would be half loaded, or silently loaded into the wrong places.
    current = set(engine.module.state_dict())
    for name in own:
        if name.endswith("_model_states.pt"):
            saved = set(_module_keys(cache[name]))
            missing, unexpected = sorted(current - saved), sorted(saved - current)
            if missing or unexpected:
                raise CheckpointError(
                    f"{url}/{PREFIX}{name} does not fit this model: missing keys: {missing[:10] or 'none'}; "
                    f"unexpected keys: {unexpected[:10] or 'none'}. Nothing was loaded. A DeepSpeed checkpoint "
                    f"resumes the same model only (even with strict=False); to start another model from its "
                    f"weights, consolidate it (`fabric-lite consolidate`) and load_state_dict(..., strict=False)."
                )

    def apply() -> None:
        with _shadow_directory(manifest) as root, _engine_io(engine, _adapter(load=load)):
            path, _ = engine.load_checkpoint(root, tag=_TAG, load_module_strict=strict, load_optimizer_states=True,
                                             load_lr_scheduler_states=False)
        cache.clear()
        if path is None:
            raise CheckpointError(f"DeepSpeed found no engine state in {url}.")

    return apply


def _own_files(engine: Any, manifest: Dict[str, Any]) -> List[str]:
    """The engine files this rank reads: the module states it matches, and its own ZeRO partition."""
    pattern = os.path.basename(engine._get_ckpt_name(_ROOT, _TAG, mp_placeholder="*"))
    names = [n[len(PREFIX):] for n in manifest["files"] if n.startswith(PREFIX)]
    wanted = [n for n in names if fnmatch.fnmatch(n, pattern)]
    if engine.zero_optimization():
        zero = os.path.basename(engine._get_zero_ckpt_name(_ROOT, _TAG))
        wanted += [n for n in names if n == zero]
    return wanted


def consolidate(url: str, manifest: Dict[str, Any]) -> Dict[str, torch.Tensor]:
    """One fp32 state dict from a DeepSpeed checkpoint of any ZeRO stage and world size (needs deepspeed).

    Every engine file is read verified and under weights_only first; DeepSpeed's merge then runs on
    those re-serialized copies in a temporary directory.
    """
    names = sorted(n for n in manifest["files"] if n.startswith(PREFIX))
    if not names:
        raise CheckpointError(f"{url} has no DeepSpeed engine files.")
    with tempfile.TemporaryDirectory(prefix="fabric-lite-consolidate-") as tmp:
        folder = os.path.join(tmp, _TAG)
        os.makedirs(folder)
        loaded: Dict[str, Any] = {}
        with _allow_deepspeed_classes():
            for name in names:
                loaded[name[len(PREFIX):]] = obj = load_file(url, name, manifest, weights_only=True)
                torch.save(obj, os.path.join(folder, name[len(PREFIX):]))
        try:
            module_keys = next((_module_keys(obj) for n, obj in loaded.items() if n.endswith("_model_states.pt")), [])
            if any(re.search(r"optim_states\.pt$", n) for n in loaded):
                from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

                state = dict(get_fp32_state_dict_from_zero_checkpoint(tmp, tag=_TAG))
            else:  # ZeRO stage 0 in fp32: the module states hold the whole model
                model_states = next(obj for n, obj in loaded.items() if n.endswith("_model_states.pt"))
                state = {k: v.float() if v.is_floating_point() else v for k, v in model_states["module"].items()}
            state = match_module_keys(state, module_keys)
            return {k: v.detach().clone() for k, v in state.items()}
        except (KeyError, IndexError, TypeError, AttributeError, ValueError, StopIteration) as err:
            # files that verified and loaded safely, but are not what DeepSpeed writes
            raise CheckpointError(f"{url} holds DeepSpeed files of another layout ({type(err).__name__}: {err}); "
                                  f"nothing was written. Load an earlier checkpoint.") from None


def match_module_keys(state: Dict[str, Any], module_keys: Any) -> Dict[str, Any]:
    """Name `state` (built from named parameters) the way the module's own `state_dict` names it.

    The Trainer's engine wraps the TrainModule one level down, so parameter names carry one more
    component than the module's keys; a state that already matches is returned as it is."""
    keys = set(module_keys)
    if not keys or set(state) == keys:
        return state
    stripped = {k.split(".", 1)[1]: v for k, v in state.items() if "." in k}
    return stripped if set(stripped) == keys else state


class DeepSpeedCheckpointFormat(CheckpointFormat):
    """DeepSpeed's own per-rank files: written, read and consolidated by the functions above. The engine keeps
    partial gradients in its own buffers. Full state dicts are the engine module's (gathered from every rank at
    ZeRO stage 3); the optimizer state stays partitioned, in the engine's files only."""

    stages_engine_files = True

    def __init__(self, strategy: "DeepSpeedStrategy") -> None:
        super().__init__(strategy, ENGINE, partial_gradients=False)

    def module_state_dict(self, module: nn.Module) -> Dict[str, Any]:
        """The full weights in the engine's dtype (gathered from every rank at stage 3); valid on rank 0."""
        strategy = self.strategy
        engine = strategy.engine
        if strategy.stage == 3:
            state = engine._zero3_consolidated_16bit_state_dict() or {}
            return match_module_keys(state, engine.module.state_dict()) if state else {}
        return engine.module.state_dict()

    def load_module_state_dict(self, module: nn.Module, state: Dict[str, Any], strict: bool = True) -> None:
        strategy = self.strategy
        engine = strategy.engine
        if strategy.stage == 3:
            import deepspeed

            params = list(engine.module.parameters())
            with deepspeed.zero.GatheredParameters(params, modifier_rank=0):
                if strategy.is_global_zero:
                    engine.module.load_state_dict(state, strict=strict)
        else:
            engine.module.load_state_dict(state, strict=strict)
        if hasattr(engine.optimizer, "refresh_fp32_params"):
            engine.optimizer.refresh_fp32_params()  # the optimizer's fp32 master copy follows the weights

    def optimizer_state_dict(self, module: Optional[nn.Module], optimizer: Any) -> Dict[str, Any]:
        raise RuntimeError("DeepSpeed's optimizer state is partitioned across processes; save it with "
                           "save_state(), which writes every rank's part.")

    def save_engine_state(self, writer: Any) -> None:
        save_engine_state(self.strategy, writer)

    def stage_engine_state(self, keep: Callable[[Any], Any]) -> Dict[str, Any]:
        return stage_engine_state(self.strategy, keep)

    def read_engine_state(self, url: str, manifest: Dict[str, Any], strict: bool) -> Callable[[], None]:
        return read_engine_state(self.strategy, url, manifest, strict)

    @classmethod
    def consolidate(cls, url: str, manifest: Dict[str, Any]) -> Dict[str, Any]:
        return consolidate(url, manifest)
