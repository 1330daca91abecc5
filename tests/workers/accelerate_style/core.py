"""Accelerate's example scripts, their calls in their order, on data and a model of our own.

`run_core`: the complete_nlp_example / checkpointing / tracking run (Accelerator(log_with=...,
project_dir=...), main_process_first, set_seed, model.to(device), prepare of five objects, a linear warmup
schedule, `batch.to(device)`, manual accumulation, save_state every N steps and every epoch,
gather_for_metrics, accelerator.log, accelerator.print), then on the same Accelerator: multi_process_metrics
(gather + truncation by use_distributed), gradient_accumulation (accumulate with gradient_accumulation_steps
set on the Accelerator, against the doubled batch), early_stopping (set_trigger on one process,
check_trigger), cross_validation (prepare per fold, free_memory), the autoregressive example (gather of a
count, no_sync on all but the last micro-batch, loss scaled by steps and processes, clip_grad_norm_),
and end_training. Then the same script resumed with --resume_from_checkpoint from an epoch and from a step
checkpoint (a new Accelerator, load_state, skip_first_batches), finishing the run."""

import argparse
import contextlib
import copy
import math
import os

import torch
from torch.utils.data import DataLoader

from fabric_lite import Accelerator, DistributedType
from fabric_lite.utils import set_seed

from shared import (EVAL_BATCH_SIZE, TRAIN_SIZE, VALIDATION_SIZE, CountingMetric, PairClassifier, PairDataset,
                    TinyCausalLM, collate_fn, flat_params, end_training, linear_warmup,
                    lm_collate_fn)

CONFIG = {"lr": 1e-2, "num_epochs": 3, "seed": 42, "batch_size": 16}


def get_dataloaders(accelerator, batch_size=16):
    with accelerator.main_process_first():
        train, validation = PairDataset(TRAIN_SIZE, seed=1), PairDataset(VALIDATION_SIZE, seed=2)

    def collate(examples):
        multiple = 8 if accelerator.mixed_precision != "no" else None
        return collate_fn(examples, pad_to_multiple_of=multiple)

    return (DataLoader(train, shuffle=True, collate_fn=collate, batch_size=batch_size),
            DataLoader(validation, shuffle=False, collate_fn=collate, batch_size=EVAL_BATCH_SIZE))


def evaluate(accelerator, model, eval_dataloader):
    metric = CountingMetric()
    model.eval()
    for batch in eval_dataloader:
        batch.to(accelerator.device)
        with torch.no_grad():
            outputs = model(**batch)
        predictions = outputs.logits.argmax(dim=-1)
        predictions, references, idx = accelerator.gather_for_metrics((predictions, batch["labels"], batch["idx"]))
        metric.add_batch(predictions=predictions, references=references, idx=idx)
    return metric.compute()


def build(accelerator, batch_size, num_epochs, gradient_accumulation_steps=1):
    set_seed(CONFIG["seed"])
    train_dataloader, eval_dataloader = get_dataloaders(accelerator, batch_size)
    model = PairClassifier().to(accelerator.device)
    optimizer = torch.optim.AdamW(params=model.parameters(), lr=CONFIG["lr"])
    lr_scheduler = linear_warmup(optimizer, num_warmup_steps=2,
                                 num_training_steps=(len(train_dataloader) * num_epochs) // gradient_accumulation_steps)
    return accelerator.prepare(model, optimizer, train_dataloader, eval_dataloader, lr_scheduler)


def train_nlp(accelerator, args, resume_from=None):
    """complete_nlp_example.py / by_feature/checkpointing.py: returns per-epoch metrics and final weights."""
    num_epochs = CONFIG["num_epochs"]
    checkpointing_steps = args.checkpointing_steps
    if checkpointing_steps is not None and checkpointing_steps.isdigit():
        checkpointing_steps = int(checkpointing_steps)
    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = build(accelerator, CONFIG["batch_size"],
                                                                              num_epochs)
    overall_step, starting_epoch, resume_step = 0, 0, None
    if resume_from:
        accelerator.print(f"Resumed from checkpoint: {resume_from}")
        accelerator.load_state(resume_from)
        training_difference = os.path.splitext(os.path.basename(resume_from))[0]
        if "epoch" in training_difference:
            starting_epoch = int(training_difference.replace("epoch_", "")) + 1
        else:
            resume_step = int(training_difference.replace("step_", ""))
            starting_epoch = resume_step // len(train_dataloader)
            resume_step -= starting_epoch * len(train_dataloader)
    metrics, losses = {}, []
    for epoch in range(starting_epoch, num_epochs):
        model.train()
        total_loss = 0
        if resume_from and epoch == starting_epoch and resume_step is not None:
            active_dataloader = accelerator.skip_first_batches(train_dataloader, resume_step)
            overall_step += resume_step
        else:
            active_dataloader = train_dataloader
        for step, batch in enumerate(active_dataloader):
            batch.to(accelerator.device)
            loss = model(**batch).loss
            total_loss += loss.detach().float()
            accelerator.backward(loss)
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad()
            overall_step += 1
            losses.append(round(loss.item(), 6))
            if isinstance(checkpointing_steps, int) and overall_step % checkpointing_steps == 0:
                accelerator.save_state(os.path.join(args.output_dir, f"step_{overall_step}"))
        eval_metric = evaluate(accelerator, model, eval_dataloader)
        accelerator.print(f"epoch {epoch}:", {k: eval_metric[k] for k in ("accuracy", "samples")})
        metrics[epoch] = eval_metric
        if accelerator.trackers:
            accelerator.log({"accuracy": eval_metric["accuracy"], "train_loss": total_loss.item(),
                             "epoch": epoch}, step=epoch)
        if checkpointing_steps == "epoch" or isinstance(checkpointing_steps, int):
            accelerator.save_state(os.path.join(args.output_dir, f"epoch_{epoch}"))
    return {"metrics": metrics, "final": flat_params(model).tolist(), "steps_per_epoch": len(train_dataloader),
            "overall_step": overall_step, "losses": losses}


def multi_process_metrics(accelerator, model, eval_dataloader):
    metric = CountingMetric()
    samples_seen = 0
    model.eval()
    for step, batch in enumerate(eval_dataloader):
        batch.to(accelerator.device)
        with torch.no_grad():
            predictions = model(**batch).logits.argmax(dim=-1)
        predictions, references, idx = accelerator.gather((predictions, batch["labels"], batch["idx"]))
        if accelerator.use_distributed:
            if step == len(eval_dataloader) - 1:
                predictions = predictions[: len(eval_dataloader.dataset) - samples_seen]
                references = references[: len(eval_dataloader.dataset) - samples_seen]
                idx = idx[: len(eval_dataloader.dataset) - samples_seen]
            else:
                samples_seen += references.shape[0]
        metric.add_batch(predictions=predictions, references=references, idx=idx)
    return metric.compute()


def accumulation_run(accelerator, batch_size, steps):
    """by_feature/gradient_accumulation.py's loop for one epoch; the weights after it."""
    accelerator.gradient_accumulation_steps = steps
    accelerator.free_memory()
    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = build(accelerator, batch_size, 1, steps)
    model.train()
    for batch in train_dataloader:
        batch.to(accelerator.device)
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad()
    return flat_params(model), evaluate(accelerator, model, eval_dataloader)


def early_stopping(accelerator):
    accelerator.free_memory()
    model, optimizer, train_dataloader, _, lr_scheduler = build(accelerator, 8, 1)
    stopped_at, steps_run = None, 0
    for step, batch in enumerate(train_dataloader):
        batch.to(accelerator.device)
        loss = model(**batch).loss
        accelerator.backward(loss)
        optimizer.step()
        lr_scheduler.step()
        optimizer.zero_grad()
        steps_run += 1
        # only the last process decides to stop (its own condition), at its step 1
        if accelerator.process_index == accelerator.num_processes - 1 and step == 1:
            accelerator.set_trigger()
        if accelerator.check_trigger():
            stopped_at = step
            break
    return {"stopped_at": stopped_at, "steps_run": steps_run}


def cross_validation(accelerator, num_folds=2):
    """by_feature/cross_validation.py: a model per fold, predictions on one test set gathered per fold."""
    full = PairDataset(TRAIN_SIZE, seed=1)
    test = PairDataset(VALIDATION_SIZE, seed=2)
    folds, fold_orders, fold_eval = [], [], []
    indices = list(range(len(full)))
    for k in range(num_folds):
        valid_idxs = indices[k::num_folds]
        folds.append(([i for i in indices if i not in valid_idxs], valid_idxs))
    test_predictions = []
    for i, (train_idxs, valid_idxs) in enumerate(folds):
        train_dataloader = DataLoader(torch.utils.data.Subset(full, train_idxs), shuffle=True,
                                      collate_fn=collate_fn, batch_size=16)
        eval_dataloader = DataLoader(torch.utils.data.Subset(full, valid_idxs), shuffle=False,
                                     collate_fn=collate_fn, batch_size=EVAL_BATCH_SIZE)
        test_dataloader = DataLoader(test, shuffle=False, collate_fn=collate_fn, batch_size=EVAL_BATCH_SIZE)
        set_seed(CONFIG["seed"] + i)
        model = PairClassifier().to(accelerator.device)
        optimizer = torch.optim.AdamW(params=model.parameters(), lr=CONFIG["lr"])
        lr_scheduler = linear_warmup(optimizer, 2, len(train_dataloader))
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
            model, optimizer, train_dataloader, eval_dataloader, lr_scheduler)
        model.train()
        for batch in train_dataloader:
            batch.to(accelerator.device)
            accelerator.backward(model(**batch).loss)
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad()
        fold_eval.append(evaluate(accelerator, model, eval_dataloader)["seen"])
        fold_predictions, order = [], []
        for batch in test_dataloader:
            batch.to(accelerator.device)
            with torch.no_grad():
                logits = model(**batch).logits
            logits, references, idx = accelerator.gather_for_metrics((logits, batch["labels"], batch["idx"]))
            fold_predictions.append(logits.cpu())
            order += idx.tolist()
        fold_orders.append(order)
        test_predictions.append(torch.cat(fold_predictions, dim=0))
        accelerator.free_memory()
    preds = torch.stack(test_predictions, dim=0).sum(dim=0).div(num_folds).argmax(dim=-1)
    return {"orders": fold_orders, "fold_eval_seen": fold_eval, "valid_sizes": [len(v) for _, v in folds],
            "n_preds": int(preds.numel())}


class LMDataset(torch.utils.data.Dataset):
    def __init__(self, n):
        g = torch.Generator().manual_seed(5)
        self.rows = [{"input_ids": torch.randint(1, 32, (int(torch.randint(2, 9, (1,), generator=g)),),
                                                 generator=g).tolist(), "idx": i} for i in range(n)]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


def autoregressive(accelerator, gradient_accumulation_steps=2, max_grad_norm=1.0):
    """gradient_accumulation_for_autoregressive_models.py: token-count normalised accumulation. Before each
    optimizer step the gradient is compared with the one of (summed token loss over every sample of this
    update, on every process) / (their label tokens), computed here on a copy of the model."""
    accelerator.gradient_accumulation_steps = gradient_accumulation_steps
    accelerator.free_memory()
    dataset = LMDataset(4 * gradient_accumulation_steps * accelerator.num_processes * 2)
    set_seed(CONFIG["seed"])
    model = TinyCausalLM().to(accelerator.device)
    optimizer = torch.optim.AdamW(params=model.parameters(), lr=1e-2)
    lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    train_dataloader = DataLoader(dataset, shuffle=False, collate_fn=lm_collate_fn, batch_size=2)
    eval_dataloader = DataLoader(LMDataset(10), shuffle=False, collate_fn=lm_collate_fn, batch_size=EVAL_BATCH_SIZE)
    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler)
    num_batches = len(train_dataloader)
    remainder = num_batches % gradient_accumulation_steps or gradient_accumulation_steps
    total_updates = math.ceil(num_batches / gradient_accumulation_steps)
    worst, counts = 0.0, []
    model.train()
    iterator = iter(train_dataloader)
    for update_step in range(total_updates):
        n_batches = gradient_accumulation_steps if update_step != total_updates - 1 else remainder
        batch_samples = [next(iterator) for _ in range(n_batches)]
        local_num_items = sum([(b["labels"].ne(-100)).sum() for b in batch_samples])
        num_items_in_batch = accelerator.gather(local_num_items).sum().item()
        reference_model = copy.deepcopy(accelerator.unwrap_model(model))
        for i, batch in enumerate(batch_samples):
            ctx = model.no_sync if (i < len(batch_samples) - 1 and accelerator.num_processes > 1) \
                else contextlib.nullcontext
            with ctx():
                loss = model(**batch, num_items_in_batch=num_items_in_batch).loss
                loss = loss * gradient_accumulation_steps * accelerator.num_processes
                accelerator.backward(loss)
        # the reference: every sample of this update, from every process
        idx = torch.cat([accelerator.gather(b["idx"]) for b in batch_samples]).tolist()
        ref_batch = lm_collate_fn([dataset[j] for j in idx])
        counts.append((num_items_in_batch, int(ref_batch["labels"].ne(-100).sum())))
        reference_model(**{k: v for k, v in ref_batch.items()}).loss.backward()
        for p, q in zip(accelerator.unwrap_model(model).parameters(), reference_model.parameters()):
            worst = max(worst, float((p.grad - q.grad).abs().max()))
        accelerator.clip_grad_norm_(model.parameters(), max_grad_norm)
        optimizer.step()
        lr_scheduler.step()
        optimizer.zero_grad()
    model.eval()
    losses = []
    for batch in eval_dataloader:
        with torch.no_grad():
            eval_loss = model(**batch).loss
        losses.append(accelerator.gather_for_metrics(eval_loss.repeat(EVAL_BATCH_SIZE)))
    return {"grad_diff": worst, "counts": counts, "updates": total_updates,
            "eval_loss_finite": bool(torch.isfinite(torch.cat(losses).mean()))}


def run_core(args):
    """The complete_nlp_example / checkpointing / tracking run and the examples that share its Accelerator,
    then that script started again with --resume_from_checkpoint: a new Accelerator (no trackers), one run
    per checkpoint named in `args.resume_from_checkpoint` (relative to `args.output_dir`), each saving into
    `args.resumed_output_dir` so that the checkpoints it resumes from stay as the full run wrote them."""
    accelerator = Accelerator(cpu=args.cpu, mixed_precision=args.mixed_precision, log_with=args.log_with,
                              project_dir=args.project_dir)
    accelerator.init_trackers("core", CONFIG)
    result = {"rank": accelerator.process_index, "world": accelerator.num_processes,
              "type": str(accelerator.distributed_type),
              "distributed": accelerator.distributed_type != DistributedType.NO}
    result["nlp"] = train_nlp(accelerator, args)
    model, _, _, eval_dataloader, _ = build(accelerator, 16, 1)
    result["multi_process_metrics"] = multi_process_metrics(accelerator, model, eval_dataloader)
    big, big_eval = accumulation_run(accelerator, 16, 1)
    small, small_eval = accumulation_run(accelerator, 8, 2)
    set_seed(CONFIG["seed"])
    initial = flat_params(PairClassifier())
    result["accumulation"] = {"diff": float((big - small).abs().max()), "moved": float((big - initial).abs().max()),
                              "seen": [big_eval["seen"], small_eval["seen"]]}
    accelerator.gradient_accumulation_steps = 1
    result["early_stopping"] = early_stopping(accelerator)
    result["cross_validation"] = cross_validation(accelerator)
    result["autoregressive"] = autoregressive(accelerator)
    result["trackers"] = [type(t).__name__ for t in accelerator.trackers]
    end_training(accelerator)

    accelerator = Accelerator(cpu=args.cpu, mixed_precision=args.mixed_precision)
    resume_args = argparse.Namespace(**{**vars(args), "output_dir": args.resumed_output_dir})
    result["resumed"] = {}
    for name in args.resume_from_checkpoint:
        accelerator.free_memory()
        result["resumed"][name] = train_nlp(accelerator, resume_args,
                                            resume_from=os.path.join(args.output_dir, name))
    end_training(accelerator)
    return result


def add_arguments(parser):
    parser.add_argument("--checkpointing_steps", default=None)
    parser.add_argument("--output_dir", default=".")
    parser.add_argument("--resumed_output_dir", default="resumed")
    parser.add_argument("--project_dir", default="logs")
    parser.add_argument("--log_with", default="all")
    parser.add_argument("--resume_from_checkpoint", nargs="*", default=())
