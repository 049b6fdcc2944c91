"""Tiny models shared by the integration tests and their multi-process workers: a NaN planted at a
known call of a known module."""
import torch
from torch import nn


class Poison(nn.Module):
    """Identity, except that its call number `at` (0-indexed, counting calls in `mode`: "train" or
    "eval") returns NaN."""

    def __init__(self, at=None, mode="train"):
        super().__init__()
        self.at = at
        self.mode = mode
        self.calls = 0

    def forward(self, x):
        if self.training == (self.mode == "train"):
            hit = self.at is not None and self.calls == self.at
            self.calls += 1
            if hit:
                return x * float("nan")
        return x


class TinyNet(nn.Module):
    """fc1 -> act -> poison -> fc2; with `labels`, returns {"loss", "logits"} like a
    Transformers model."""

    def __init__(self, poison_at=None, mode="train"):
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.act = nn.ReLU()
        self.poison = Poison(poison_at, mode)
        self.fc2 = nn.Linear(8, 1)

    def forward(self, x, labels=None):
        logits = self.fc2(self.poison(self.act(self.fc1(x))))
        if labels is None:
            return {"logits": logits}
        loss = ((logits.squeeze(-1).float() - labels) ** 2).mean()
        return {"loss": loss, "logits": logits}


def samples(n=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    xs = torch.randn(n, 4, generator=g)
    ys = xs.sum(-1) * 0.5
    return [{"x": xs[i], "labels": ys[i]} for i in range(n)]


def lightning_module_class(pl):
    """A LightningModule around TinyNet for the `pl` package given (pytorch_lightning or
    lightning.pytorch); it records each training step's loss in `losses`."""

    class LitNet(pl.LightningModule):
        def __init__(self, poison_at=None, mode="train", lr=0.05):
            super().__init__()
            self.net = TinyNet(poison_at, mode)
            self.lr = lr
            self.losses = []

        def forward(self, x):
            return self.net(x)["logits"]

        def training_step(self, batch, batch_idx):
            loss = ((self(batch["x"]).squeeze(-1).float() - batch["labels"]) ** 2).mean()
            self.losses.append(float(loss.detach()))
            return loss

        def validation_step(self, batch, batch_idx):
            return ((self(batch["x"]).squeeze(-1).float() - batch["labels"]) ** 2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=self.lr)

    return LitNet


def loader(n=32, batch_size=4, seed=0):
    return torch.utils.data.DataLoader(samples(n, seed), batch_size=batch_size, shuffle=False)
