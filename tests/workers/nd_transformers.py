"""A transformers model loaded already tensor-parallel (`from_pretrained(..., tp_plan="auto", device_mesh=...)`) on
the Accelerator's tp dimension: prepare keeps its layout, and three steps with clipping give the unsharded model's
losses."""

import torch

from common import parse, write_result
from fabric_lite import Accelerator, ParallelismConfig

args = parse({"--tp": {"type": int, "default": 2}})
acc = Accelerator(cpu=True, parallelism_config=ParallelismConfig(tp_size=args.tp))
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=32)
path = f"{args.out}/model"
if acc.is_main_process:
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
acc.wait_for_everyone()
ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
plain = LlamaForCausalLM.from_pretrained(path)  # the same steps on the whole model, in this process alone
plain_optimizer = torch.optim.AdamW(plain.parameters(), lr=1e-3)
reference = []
for _ in range(3):
    loss = plain(input_ids=ids, labels=ids).loss
    loss.backward()
    torch.nn.utils.clip_grad_norm_(plain.parameters(), 1.0)
    plain_optimizer.step()
    plain_optimizer.zero_grad()
    reference.append(float(loss))
from transformers.distributed import DistributedConfig  # noqa: E402

model = LlamaForCausalLM.from_pretrained(path, distributed_config=DistributedConfig(tp_plan="auto"),
                                         device_mesh=acc.torch_device_mesh["tp"])
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
model, optimizer = acc.prepare(model, optimizer)
losses = []
for _ in range(3):
    loss = model(input_ids=ids, labels=ids).loss
    acc.backward(loss)
    acc.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad()
    losses.append(float(loss))
weight = dict(model.named_parameters())["model.layers.0.self_attn.q_proj.weight"]
write_result(args.out, acc.process_index, {"reference": reference, "losses": losses,
                                          "placements": str(getattr(weight, "placements", None))})
acc.end_training()
