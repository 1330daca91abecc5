"""One process per GPU over NCCL: collectives, gather_for_metrics and a checkpoint round trip."""

import os

import torch
import torch.distributed as dist

from common import make_model, parse, write_result

from fabric_lite import Accelerator


def main():
    args = parse()
    acc = Accelerator(strategy="ddp")
    rank = acc.process_index
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = acc.prepare(model, optimizer)
    x = torch.randn(8, 4, device=acc.device)
    acc.backward(model(x).pow(2).mean())
    optimizer.step()
    optimizer.zero_grad()

    gathered = acc.gather_for_metrics(torch.arange(10, device=acc.device) + 10 * rank)
    reduced = acc.reduce(torch.tensor(float(rank), device=acc.device), reduction="sum")
    ckpt = os.path.join(args.out, "ckpt")
    acc.save_state(ckpt)
    before = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    acc.load_state(ckpt)
    restored = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    write_result(args.out, rank, {
        "backend": dist.get_backend(), "gathered": gathered.cpu().tolist(), "reduced": reduced.item(),
        "restored_equal": restored, "device": str(acc.device),
    })
    acc.end_training()


if __name__ == "__main__":
    main()
