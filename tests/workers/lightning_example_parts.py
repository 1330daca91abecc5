"""Small modules written the way Lightning's basic examples write theirs (autoencoder, backbone classifier,
language model, profiled classifier, bug report), on tiny random data. Shared by
tests/trainer/test_lightning_examples.py and its 2-process worker; the domain templates' modules are in
lightning_template_parts.py."""

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset, random_split

from fabric_lite import DataModule, TrainModule, callbacks

FEATURES = 64  # images of 1x8x8


def image_set(n: int, classes: int = 10, seed: int = 0, shape=(1, 8, 8)) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.rand(n, *shape, generator=g), torch.randint(classes, (n,), generator=g))


def flat_weights(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


# -- autoencoder: a datamodule built in __init__, on_step logging in every stage, a sampling callback --------------

class SampleImages(callbacks.Callback):
    """Reads the datamodule through the trainer at each epoch end and runs the module on a few samples."""

    def __init__(self, num_samples: int = 3) -> None:
        super().__init__()
        self.num_samples = num_samples
        self.shapes = []

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if not trainer.is_global_zero:
            return
        images, _ = next(iter(DataLoader(trainer.datamodule.val_set, batch_size=self.num_samples)))
        with torch.no_grad():
            pl_module.eval()
            generated = pl_module(images.view(images.size(0), -1).to(pl_module.device))
            pl_module.train()
        self.shapes.append(tuple(generated.shape))


class AutoEncoder(TrainModule):
    def __init__(self, hidden_dim: int = 16, learning_rate: float = 1e-2) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.encoder = nn.Sequential(nn.Linear(FEATURES, hidden_dim), nn.ReLU(), nn.Linear(hidden_dim, 3))
        self.decoder = nn.Sequential(nn.Linear(3, hidden_dim), nn.ReLU(), nn.Linear(hidden_dim, FEATURES))
        self.losses = {"train": [], "val": [], "test": []}

    def forward(self, x):
        return self.decoder(self.encoder(x))

    def training_step(self, batch, batch_idx):
        return self._common_step(batch, "train")

    def validation_step(self, batch, batch_idx):
        self._common_step(batch, "val")

    def test_step(self, batch, batch_idx):
        self._common_step(batch, "test")

    def predict_step(self, batch, batch_idx, dataloader_idx=None):
        return self(self._flat(batch))

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.hparams.learning_rate)

    @staticmethod
    def _flat(batch):
        x, _ = batch
        return x.view(x.size(0), -1)

    def _common_step(self, batch, stage: str):
        x = self._flat(batch)
        loss = F.mse_loss(x, self(x))
        self.log(f"{stage}_loss", loss, on_step=True)
        self.losses[stage].append(loss.item())
        return loss


class ImagesData(DataModule):
    def __init__(self, batch_size: int = 32) -> None:
        super().__init__()
        full = image_set(40, seed=1)
        self.test_set = image_set(8, seed=2)
        self.train_set, self.val_set = random_split(full, [32, 8], generator=torch.Generator().manual_seed(42))
        self.batch_size = batch_size

    def train_dataloader(self):
        return DataLoader(self.train_set, batch_size=self.batch_size)

    def val_dataloader(self):
        return DataLoader(self.val_set, batch_size=self.batch_size)

    def test_dataloader(self):
        return DataLoader(self.test_set, batch_size=self.batch_size)

    def predict_dataloader(self):
        return DataLoader(self.test_set, batch_size=self.batch_size)


# -- backbone classifier: a module around a backbone, hyperparameters saved without it ------------------------------

class Backbone(nn.Module):
    def __init__(self, hidden_dim: int = 16) -> None:
        super().__init__()
        self.l1 = nn.Linear(FEATURES, hidden_dim)
        self.l2 = nn.Linear(hidden_dim, 10)

    def forward(self, x):
        return torch.relu(self.l2(torch.relu(self.l1(x.view(x.size(0), -1)))))


class BackboneClassifier(TrainModule):
    def __init__(self, backbone: Optional[Backbone] = None, learning_rate: float = 1e-3) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["backbone"])
        self.backbone = backbone if backbone is not None else Backbone()
        self.losses = {"train": [], "valid": [], "test": []}

    def forward(self, x):
        return self.backbone(x)

    def _loss(self, batch, stage):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.losses[stage].append(loss.item())
        return loss

    def training_step(self, batch, batch_idx):
        loss = self._loss(batch, "train")
        self.log("train_loss", loss, on_epoch=True)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("valid_loss", self._loss(batch, "valid"), on_step=True)

    def test_step(self, batch, batch_idx):
        self.log("test_loss", self._loss(batch, "test"))

    def predict_step(self, batch, batch_idx, dataloader_idx=None):
        return self(batch[0])

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.hparams.learning_rate)


# -- language model: `import fabric_lite as L`, L.LightningModule, prog_bar metrics ----------------------------------

class TokenPairs(Dataset):
    def __init__(self, n: int = 48, block: int = 6, vocab: int = 20) -> None:
        g = torch.Generator().manual_seed(3)
        self.seqs = torch.randint(vocab, (n, block + 1), generator=g)
        self.vocab_size = vocab

    def __len__(self):
        return len(self.seqs)

    def __getitem__(self, i):
        return self.seqs[i, :-1], self.seqs[i, 1:]


class TinyLM(nn.Module):
    def __init__(self, vocab_size: int, dim: int = 8) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, dim)
        self.decoder = nn.Linear(dim, vocab_size)

    def forward(self, tokens):
        return torch.log_softmax(self.decoder(self.embedding(tokens)), -1).view(-1, self.decoder.out_features)


def language_model_class():
    """The module class, derived from `fabric_lite.LightningModule` as `import lightning as L` code derives it."""
    import fabric_lite as L

    class LanguageModel(L.LightningModule):
        def __init__(self, vocab_size):
            super().__init__()
            self.model = TinyLM(vocab_size)

        def _loss(self, batch):
            inputs, target = batch
            return F.nll_loss(self.model(inputs), target.view(-1))

        def training_step(self, batch, batch_idx):
            loss = self._loss(batch)
            self.log("train_loss", loss, prog_bar=True)
            return loss

        def validation_step(self, batch, batch_idx):
            loss = self._loss(batch)
            self.log("val_loss", loss, prog_bar=True)
            return loss

        def test_step(self, batch, batch_idx):
            loss = self._loss(batch)
            self.log("test_loss", loss, prog_bar=True)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=2.0)

    return LanguageModel


# -- profiled classifier: training_step chosen in __init__, automatic or manual optimization -------------------------

class ProfiledClassifier(TrainModule):
    def __init__(self, automatic_optimization: bool = True) -> None:
        super().__init__()
        self.model = Backbone(8)
        self.criterion = nn.CrossEntropyLoss()
        self.automatic_optimization = automatic_optimization
        self.training_step = self.automatic_step if automatic_optimization else self.manual_step

    def automatic_step(self, batch, batch_idx):
        inputs, labels = batch
        loss = self.criterion(self.model(inputs), labels)
        self.log("train_loss", loss)
        return loss

    def manual_step(self, batch, batch_idx):
        opt = self.optimizers()
        opt.zero_grad()
        inputs, labels = batch
        loss = self.criterion(self.model(inputs), labels)
        self.log("train_loss", loss)
        self.manual_backward(loss)
        opt.step()

    def validation_step(self, batch, batch_idx):
        inputs, labels = batch
        self.log("val_loss", self.criterion(self.model(inputs), labels))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)


class TwoLoaders(DataModule):
    """Loaders built inside the *_dataloader methods, batch size 2."""

    def train_dataloader(self, *args, **kwargs):
        return DataLoader(image_set(16, seed=4), batch_size=2, shuffle=True)

    def val_dataloader(self, *args, **kwargs):
        return DataLoader(image_set(8, seed=5), batch_size=2, shuffle=True)


# -- bug report: the boring model ---------------------------------------------------------------------------------

class RandomVectors(Dataset):
    def __init__(self, size: int, length: int, seed: int) -> None:
        self.data = torch.randn(length, size, generator=torch.Generator().manual_seed(seed))

    def __getitem__(self, index):
        return self.data[index]

    def __len__(self):
        return len(self.data)


class BoringModel(TrainModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(32, 2)

    def forward(self, x):
        return self.layer(x)

    def training_step(self, batch, batch_idx):
        loss = self(batch).sum()
        self.log("train_loss", loss)
        return {"loss": loss}

    def validation_step(self, batch, batch_idx):
        self.log("valid_loss", self(batch).sum())

    def test_step(self, batch, batch_idx):
        self.log("test_loss", self(batch).sum())

    def configure_optimizers(self):
        return torch.optim.SGD(self.layer.parameters(), lr=0.1)
