"""fit() with a training loader that yields no batches warns, naming the loader, instead of returning silently."""

import warnings

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from test_trainer import Regressor, make_trainer, regression_data


def fit_and_catch(tmp_path, train, **kwargs):
    module = Regressor()
    trainer = make_trainer(tmp_path, enable_model_summary=False, logger=False, **kwargs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, train)
    return trainer, [str(w.message) for w in caught if "no training step ran" in str(w.message)]


def test_an_empty_dataset_warns_once_naming_the_loader(tmp_path):
    empty = DataLoader(TensorDataset(torch.zeros(0, 4), torch.zeros(0, 1)), batch_size=4)
    trainer, found = fit_and_catch(tmp_path, empty, max_epochs=3)
    assert trainer.global_step == 0
    assert len(found) == 1, found
    assert "The training dataloader given to fit()" in found[0] and "0 samples" in found[0], found[0]
    assert "TensorDataset" in found[0] and "epoch 0" in found[0]


def test_drop_last_dropping_every_batch_is_named(tmp_path):
    short = DataLoader(regression_data(n=3), batch_size=4, drop_last=True)
    _, found = fit_and_catch(tmp_path, short, max_epochs=1)
    assert len(found) == 1 and "drop_last=True" in found[0] and "3 samples" in found[0], found


def test_an_iterable_loader_without_length_that_yields_nothing_warns(tmp_path):
    class Nothing(IterableDataset):
        def __iter__(self):
            return iter(())

    _, found = fit_and_catch(tmp_path, DataLoader(Nothing(), batch_size=4), max_epochs=1)
    assert len(found) == 1 and "Nothing" in found[0], found


@pytest.mark.parametrize("kwargs", [{}, {"limit_train_batches": 0}], ids=["normal", "limit_0"])
def test_no_warning_where_the_loader_has_batches_or_none_were_asked_for(tmp_path, kwargs):
    trainer, found = fit_and_catch(tmp_path, DataLoader(regression_data(n=8), batch_size=4), max_epochs=1, **kwargs)
    assert found == []
    assert trainer.global_step == (0 if kwargs else 2)
