"""What the Llama-family oracles share (llama_training_oracle.py, llama_lora_oracle.py): a small
perturbed model, JSONL data as train_llm reads it, and the PyTorch steps train_llm takes."""
import json
import os

import torch
from transformers.optimization import get_cosine_with_min_lr_schedule_with_warmup

from common import fail


def perturb(model):
    """Moves every parameter off its initial value (norms and biases too), in place."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * (0.2 if p.dim() == 1 else 0.02))


def write_rows(path, vocab, rows, seq, seed):
    """`rows` random sequences of `seq` ids, as train_llm's JSONL; returns them [rows, seq]."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (rows, seq), generator=g)
    with open(path, "w") as f:
        for row in ids.tolist():
            f.write(json.dumps({"input_ids": row}) + "\n")
    return ids


def train_like_train_llm(model, params, ids, steps, global_batch, lr, weight_decay, clip,
                         routed=None):
    """train_llm's steps in PyTorch: batches in order (epoch after epoch), AdamW, one warm-up step
    then cosine decay to 10% (transformers' schedule), gradient clipping; fails when the clipping
    never bound (the check would not see a wrong global norm). Returns each step's gradient norm
    before clipping. `routed` (a list): appends, per step, each sparse layer's top-k choices per
    expert (transformers' routers return (logits, scores, indices))."""
    hooks = []
    if routed is not None:
        def count(module, inputs, output):
            experts = module.weight.shape[0]
            routed[-1].append(torch.bincount(output[2].reshape(-1), minlength=experts).tolist())
        hooks = [m.register_forward_hook(count) for m in model.modules()
                 if type(m).__name__.endswith("TopKRouter")]
    model.train()
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    sched = get_cosine_with_min_lr_schedule_with_warmup(opt, num_warmup_steps=1,
                                                        num_training_steps=steps, min_lr_rate=0.1)
    clipped = 0
    norms = []
    n = ids.shape[0]
    for step in range(steps):
        if routed is not None:
            routed.append([])
        b = ids[(step * global_batch) % n:(step * global_batch) % n + global_batch]
        model(input_ids=b, labels=b).loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(params, clip).item())
        clipped += int(norms[-1] > clip)
        opt.step()
        sched.step()
        opt.zero_grad()
    for h in hooks:
        h.remove()
    if routed is not None and not any(routed):
        fail("no router of the model was seen: transformers' MoE routers have another name")
    if clipped == 0:
        fail("the clipping never bound: the check would not see a wrong global norm")
    return norms
