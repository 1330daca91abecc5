"""A small Llama-style decoder (RMSNorm, rotary attention, SwiGLU feed-forward) and its tensor-parallel plan, laid
out as such models are: the attention's q/k/v and the feed-forward's gate/up projections split by output
(column-wise), their output projections split by input (row-wise), so each block all-reduces twice per forward."""

import math

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotate(x, positions):
    """Rotary position embedding over the last dimension (pairs of features turned by a position's angle)."""
    half = x.shape[-1] // 2
    frequencies = 1.0 / (10000 ** (torch.arange(half, device=x.device, dtype=torch.float32) / half))
    angles = positions[:, None].float() * frequencies[None, :]  # (seq, half)
    cos, sin = angles.cos()[None, :, None, :], angles.sin()[None, :, None, :]
    a, b = x[..., :half], x[..., half:]
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1).type_as(x)


class Attention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.head_dim = dim // heads
        self.wq, self.wk, self.wv = (nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        # (-1 heads: under tensor parallelism each rank holds heads / tp of them)
        q, k, v = (w(x).view(b, s, -1, self.head_dim) for w in (self.wq, self.wk, self.wv))
        positions = torch.arange(s, device=x.device)
        q, k = rotate(q, positions), rotate(k, positions)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.w1, self.w3 = nn.Linear(dim, hidden, bias=False), nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, dim, heads, hidden):
        super().__init__()
        self.attention_norm, self.attention = RMSNorm(dim), Attention(dim, heads)
        self.ffn_norm, self.feed_forward = RMSNorm(dim), FeedForward(dim, hidden)

    def forward(self, x):
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    def __init__(self, vocab=256, dim=64, layers=2, heads=4, hidden=None, seed=0):
        super().__init__()
        hidden = hidden or 4 * dim
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, heads, hidden) for _ in range(layers))
        self.norm = RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)
        # drawn on the CPU whatever the device it is built on (a Trainer builds it on the GPU): the same weights
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in self.parameters():
                if p.dim() == 2 and not p.is_meta:
                    p.copy_(torch.randn(p.shape, generator=g, device="cpu") / math.sqrt(dim))

    def forward(self, tokens):
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x))


def tensor_parallel(model, mesh):
    """Split every block's projections over `mesh` (a 1-D tensor-parallel mesh)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = {"attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(), "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w3": ColwiseParallel(), "feed_forward.w2": RowwiseParallel()}
    for block in model.layers:
        parallelize_module(block, mesh, plan)
    return model


def tokens(n, seq=16, vocab=256, seed=1):
    """`n` random sequences and their next-token targets."""
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, vocab, (n, seq + 1), generator=g)
    return torch.utils.data.TensorDataset(data[:, :-1], data[:, 1:])


def one_by_one_mesh_against_plain_torch(accelerator, steps=5, clip=1.0):
    """Fit the model through the Trainer with ModelParallelStrategy(1, 1) -- a 1 x 1 mesh: tensor parallelism and
    FSDP2 applied on one device -- and the same steps in a plain torch loop; returns (max |weight difference|,
    parameter types of the fitted model)."""
    from torch.utils.data import DataLoader

    from fabric_lite import Trainer, TrainModule
    from fabric_lite.strategies import ModelParallelStrategy

    sizes = {"dim": 64, "layers": 2, "heads": 4}

    class Net(TrainModule):
        def configure_model(self):
            self.model = Llama(**sizes)
            tensor_parallel(self.model, self.device_mesh["tensor_parallel"])

        def training_step(self, batch, batch_idx):
            x, y = batch
            logits = self.model(x)
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    data = tokens(4 * steps)
    trainer = Trainer(strategy=ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1),
                      accelerator=accelerator, devices=1, max_steps=steps, gradient_clip_val=clip, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    module = Net()
    trainer.fit(module, DataLoader(data, batch_size=4))
    kinds = sorted({type(p).__name__ for p in module.model.parameters()})
    fitted = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().float().cpu()
              for k, v in module.model.state_dict().items()}

    device = trainer.strategy.root_device
    reference = Llama(**sizes).to(device)
    optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    for x, y in DataLoader(data, batch_size=4):
        logits = reference(x.to(device))
        F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.to(device).reshape(-1)).backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad()
    diff = max((fitted[k] - v.detach().float().cpu()).abs().max().item() for k, v in reference.state_dict().items())
    return diff, kinds
