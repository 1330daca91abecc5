"""The Trainer's prediction loop, and every process's predictions gathered back in dataset order.

Each process predicts its own shard (see `data/loader.py`): the loop records the dataset indices of each of
its batches, which a `BasePredictionWriter` is told and `gather_in_dataset_order` puts the pieces back by.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any, Dict, List, Mapping, Optional

import torch

from fabric_lite.trainer.loops import batch_limit, loader_length, takes_dataloader_idx
from fabric_lite.trainer.module import TrainModule

if TYPE_CHECKING:
    from fabric_lite.trainer.trainer import Trainer

__all__ = ["PredictionState", "run_predict", "gather_in_dataset_order", "split_samples", "join_samples"]


class PredictionState:
    """What a prediction run holds (`trainer.predict_loop`, Lightning's names): the batch indices a writer is
    told, and this process's predictions."""

    def __init__(self) -> None:
        #: The dataset indices of the batch being predicted (None where the loader cannot tell them).
        self.current_batch_indices: Optional[List[int]] = None
        #: Per loader, the dataset indices of each batch predicted so far (kept for epoch-end writers).
        self.epoch_batch_indices: List[List[Any]] = []
        #: Per loader, this process's batch outputs (on the CPU), kept when returned or written at epoch end.
        self.outputs: List[List[Any]] = []

    @property
    def predictions(self) -> List[Any]:
        """The kept outputs as `Trainer.predict` returns them: a list of batch outputs for one loader, a list of
        such lists for several."""
        return self.outputs[0] if len(self.outputs) == 1 else self.outputs


def run_predict(trainer: "Trainer", loaders: List[Any], return_predictions: bool = True) -> Optional[List[Any]]:
    """Predict over every loader in turn, calling the hooks where Lightning calls them; returns the
    predictions (see `PredictionState.predictions`) when `return_predictions`, else None."""
    from fabric_lite.callbacks.base import Callback, overrides
    from fabric_lite.callbacks.prediction_writer import BasePredictionWriter
    from fabric_lite.data.loader import DataLoaderShard
    from fabric_lite.data.transfer import move_to_device

    module, model = trainer.module, trainer.eval_model
    assert module is not None and model is not None  # (predict() set them up)
    state = trainer.predict_loop
    instrument = trainer.events.instrument  # (a profiler: the calls below are timed; None: called as they are)
    forward, callbacks, module_hooks = model, trainer.callbacks, module
    if instrument is not None:
        forward = instrument.wrap(f"[Strategy]{type(trainer.strategy).__name__}.predict_step", model)
        callbacks, module_hooks = trainer.timed_callbacks(), instrument.timed(module, "TrainModule", TrainModule)
    writers = [cb for cb in trainer.callbacks if isinstance(cb, BasePredictionWriter)]
    on_epoch = any(w.interval.on_epoch for w in writers)
    keep = return_predictions or on_epoch or trainer.gathers_predictions
    wants_indices = bool(writers) or trainer.gathers_predictions
    starts = [getattr(timed, "on_predict_batch_start") for cb, timed in zip(trainer.callbacks, callbacks)
              if overrides(cb, "on_predict_batch_start", Callback)]
    ends = [getattr(timed, "on_predict_batch_end") for cb, timed in zip(trainer.callbacks, callbacks)
            if overrides(cb, "on_predict_batch_end", Callback)]
    own_start = module_hooks.on_predict_batch_start if overrides(module, "on_predict_batch_start", TrainModule) \
        else None
    own_end = module_hooks.on_predict_batch_end if overrides(module, "on_predict_batch_end", TrainModule) else None
    step_takes_idx = len(loaders) > 1 and takes_dataloader_idx(module.predict_step)
    transfer = trainer.batch_transfer
    state.epoch_batch_indices = [[] for _ in loaders]
    state.outputs = [[] for _ in loaders]
    modes = [(m, m.training) for m in module.modules()]
    module_hooks.on_predict_model_eval()
    trainer.call_hook("on_predict_start")
    trainer.call_hook("on_predict_epoch_start")
    cpu = torch.device("cpu")
    trainer.metric_store.fx = "predict_step"  # (self.log is refused while predicting, as in Lightning)
    with trainer.evaluation_context():
        for dataloader_idx, loader in enumerate(loaders):
            extra = (dataloader_idx,) if len(loaders) > 1 else ()
            shard = loader if isinstance(loader, DataLoaderShard) else None  # (a prepared loader knows its indices)
            seen = shard.record_batch_indices() if wants_indices and shard is not None else None
            if wants_indices and seen is None:
                warnings.warn(f"The batch indices of predict loader {dataloader_idx} ({type(loader).__name__}) "
                              f"are unknown (it has no sampler of indices: an IterableDataset?); prediction "
                              f"writers are told None.", UserWarning, stacklevel=3)
            limit = batch_limit(trainer.limits["predict"], loader_length(loader))
            batches = loader if instrument is None else instrument.iterate("predict_dataloader_next", loader)
            for batch_idx, batch in enumerate(batches):
                if limit is not None and batch_idx >= limit:
                    break
                if transfer is not None:
                    batch = transfer(batch, dataloader_idx)
                indices = None
                if seen is not None:
                    indices = seen[batch_idx]
                    indices = list(indices) if isinstance(indices, (list, tuple)) else [int(indices)]
                    state.epoch_batch_indices[dataloader_idx].append(indices)
                state.current_batch_indices = indices
                for hook in starts:
                    hook(trainer, module, batch, batch_idx, *extra)
                if own_start is not None:
                    own_start(batch, batch_idx, *extra)
                out = forward(batch, batch_idx, "predict", *(extra if step_takes_idx else ()))
                for hook in ends:
                    hook(trainer, module, out, batch, batch_idx, *extra)
                if own_end is not None:
                    own_end(out, batch, batch_idx, *extra)
                if keep:
                    state.outputs[dataloader_idx].append(move_to_device(out, cpu))
            del batches
            if shard is not None and seen is not None:
                shard.record_batch_indices(False)
    trainer.metric_store.fx = None
    trainer.call_hook("on_predict_epoch_end")
    results = state.predictions if return_predictions else None
    if trainer.gathers_predictions:
        results = [gather_in_dataset_order(trainer, outs, idx, _batch_size(loader, idx))
                   for outs, idx, loader in zip(state.outputs, state.epoch_batch_indices, loaders)]
        results = results[0] if len(results) == 1 else results
    if not return_predictions:
        state.outputs = []
    state.epoch_batch_indices = []
    trainer.call_hook("on_predict_end")
    for m, training in modes:
        m.training = training
    return results


def _batch_size(loader: Any, indices: List[List[int]]) -> int:
    size = getattr(loader, "batch_size", None)
    if isinstance(size, int) and size > 0:
        return size
    return max((len(i) for i in indices), default=1)


def split_samples(output: Any, n: int) -> List[Any]:
    """A batch's output cut into its `n` samples: tensors along their first dimension, dicts and tuples/lists of
    tensors key by key, a list of `n` plain values item by item."""
    if isinstance(output, torch.Tensor):
        if output.ndim == 0 or output.shape[0] != n:
            raise ValueError(f"A prediction of shape {tuple(output.shape)} cannot be cut into the batch's {n} "
                             f"samples: gathering in dataset order needs outputs whose first dimension is the batch.")
        return list(output.unbind(0))
    if isinstance(output, Mapping):
        parts = {k: split_samples(v, n) for k, v in output.items()}
        return [{k: parts[k][i] for k in parts} for i in range(n)]
    if isinstance(output, (list, tuple)):
        if any(isinstance(v, (torch.Tensor, Mapping, list, tuple)) for v in output):
            columns = [split_samples(v, n) for v in output]
            kind = list if isinstance(output, list) else tuple
            return [kind(c[i] for c in columns) for i in range(n)]
        if len(output) == n:
            return list(output)
    raise TypeError(f"A prediction of type {type(output).__name__} cannot be cut into the batch's {n} samples: "
                    f"gathering in dataset order needs tensors (first dimension: the batch), dicts or tuples of "
                    f"them, or a list with one item per sample.")


def join_samples(samples: List[Any]) -> Any:
    """The samples of `split_samples` made one batch output again (tensors stacked along a new first dimension)."""
    first = samples[0]
    if isinstance(first, torch.Tensor):
        return torch.stack(samples)
    if isinstance(first, Mapping):
        return {k: join_samples([s[k] for s in samples]) for k in first}
    if isinstance(first, (list, tuple)) and any(isinstance(v, (torch.Tensor, Mapping, list, tuple)) for v in first):
        return type(first)(join_samples([s[j] for s in samples]) for j in range(len(first)))
    return list(samples)


def gather_in_dataset_order(trainer: "Trainer", predictions: List[Any], batch_indices: List[List[int]],
                            batch_size: int) -> List[Any]:
    """Every process's predictions of one loader, put back in dataset order on every process: each sample once
    (the repeats that pad the last step are dropped), in batches of `batch_size` -- with a sequential sampler,
    exactly what one process predicting the whole loader returns.

    `predictions` and `batch_indices`: this process's batch outputs and their dataset indices (what
    `write_on_epoch_end` is given for one loader). A collective: every process calls it."""
    if len(predictions) != len(batch_indices):
        raise ValueError(f"{len(predictions)} batch outputs but {len(batch_indices)} batches of indices: gathering "
                         f"needs the predictions kept (return_predictions=True) and their indices recorded.")
    mine: Dict[int, Any] = {}
    for out, indices in zip(predictions, batch_indices):
        for index, sample in zip(indices, split_samples(out, len(indices))):
            mine.setdefault(int(index), sample)
    everyone: Dict[int, Any] = {}
    for part in trainer.strategy.collectives.all_gather_object(list(mine.items())):
        for index, sample in part:
            everyone.setdefault(index, sample)
    ordered = [everyone[i] for i in sorted(everyone)]
    return [join_samples(ordered[i:i + batch_size]) for i in range(0, len(ordered), batch_size)]
