"""Can end-to-end tuning lift int4 blocks of 128 past 90% top-1 agreement? (Checked in session 19, not built.)

GPTQ with act-order (asymmetric blocks of 128) on the default model's fp32 weights, in torch, then the
quantized model trained against the fp32 one by KL on the target's own greedy answers to specdec's prompts
(never Spec-Bench): trainable are each block's scale and offset, the latent weights behind the 4-bit codes
(straight-through rounding, so a code moves once its weight crosses a rounding boundary: EfficientQAT's
block-then-end-to-end idea in one stage) and the RMSNorm gains (fp32 in a bundle, free at run time). Measured:
teacher-forced top-1 agreement and KL on the 13 Spec-Bench answers (96 tokens, one question per category:
quant-report's set, 1,072 tokens) and on 32 held-out answers to own prompts. Answers and Gram matrices are
cached in WORK so that runs with other settings start at the training.

    .venv/bin/python bench/experiments/int4_e2e_tuning.py --work /tmp/e2e --steps 60 --tag a \
        --out bench/results/quant/int4_e2e_tuning_a.json
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from specdec.export.distill import _batches, _collate, _kl, _log_probs, evaluate
from specdec.export.prompts import instruction_prompts, target_answers
from specdec.export.source import load_source
from specdec.quant.weight_only import _pad, gptq
from specdec.spec_bench import DEFAULT_QUESTIONS, load_spec_bench

LINEARS = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
HELD_OUT = 32  # last own answers, not trained on


def answers(model, tok, work: Path, n_prompts: int) -> tuple[list, list]:
    def save(name, seqs):
        np.save(work / name, np.array([np.concatenate([[k], s]) for s, k in seqs], dtype=object), allow_pickle=True)

    def load(name):
        return [(a[1:].astype(np.int64), int(a[0])) for a in np.load(work / name, allow_pickle=True)]

    if not (work / "eval.npy").exists():
        bench = load_spec_bench(DEFAULT_QUESTIONS, limit_per_category=1)
        save("eval.npy", target_answers(model, tok, [p.messages for p in bench], 96, batch=13))
    if not (work / "train.npy").exists():
        save("train.npy", target_answers(model, tok, instruction_prompts(n_prompts, seed=11), 128, batch=32))
    return load("eval.npy"), load("train.npy")


def grams_of(model, seqs) -> dict:
    grams, hooks = {}, []
    for li, layer in enumerate(model.model.layers):
        for name in LINEARS:
            def hook(_m, inp, _out, key=f"{li}.{name}"):
                x = inp[0].reshape(-1, inp[0].shape[-1]).double()
                grams[key] = grams.get(key, 0) + x.T @ x
            hooks.append(layer.get_submodule(name).register_forward_hook(hook))
    with torch.no_grad():
        for s, _ in seqs:
            model(input_ids=torch.from_numpy(s)[None])
    for h in hooks:
        h.remove()
    return grams


class QLinear(torch.nn.Module):
    """y = x W^T, W = scale * code + offset per block of `bs` inputs; code = clamp(round((latent - offset) /
    scale), 0, 15), rounded straight-through. Starts at GPTQ's grid (latent = its dequantized weights)."""

    def __init__(self, grid, K: int):
        super().__init__()
        q, scale, offset = (torch.from_numpy(np.asarray(a, dtype=np.float32)) for a in grid)  # [N,nb,bs], [N,nb] x2
        self.K = K
        self.latent = torch.nn.Parameter(q * scale[..., None] + offset[..., None])
        self.scale, self.offset = torch.nn.Parameter(scale), torch.nn.Parameter(offset)
        self.register_buffer("q0", q)

    def codes(self):
        x = (self.latent - self.offset[..., None]) / self.scale[..., None]
        return torch.clamp(x + (x.round() - x).detach(), 0, 15)

    def forward(self, x):
        w = self.codes() * self.scale[..., None] + self.offset[..., None]  # [N,nb,bs]
        return F.linear(x, w.reshape(w.shape[0], -1)[:, :self.K])


def agreement(teacher, student, seqs) -> dict:
    r = evaluate(teacher, student, seqs, batch_tokens=2048)
    return {"kl": round(r["kl"], 4), "top1_agreement": round(r["agreement"], 4), "tokens": r["tokens"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--train-prompts", type=int, default=512)
    ap.add_argument("--calib", type=int, default=128, help="answers whose activations GPTQ sees")
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--lr-latent", type=float, default=5e-5)
    ap.add_argument("--lr-grid", type=float, default=1e-5)
    ap.add_argument("--lr-norms", type=float, default=1e-4)
    ap.add_argument("--batch-tokens", type=int, default=2048)
    ap.add_argument("--eval-every", type=int, default=20)
    ap.add_argument("--tag", default="run")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    torch.set_num_threads(2)
    torch.manual_seed(0)
    args.work.mkdir(parents=True, exist_ok=True)

    src = load_source(None)
    teacher = src.model.eval().requires_grad_(False)
    bench, own = answers(teacher, src.tokenizer, args.work, args.train_prompts)
    held, train = own[-HELD_OUT:], own[:-HELD_OUT]
    gram_file = args.work / f"grams_{args.calib}.pt"
    if not gram_file.exists():
        torch.save(grams_of(teacher, train[:args.calib]), gram_file)
    grams = torch.load(gram_file)
    grid_file = args.work / f"gptq_b{args.block_size}_{args.calib}.pt"
    if not grid_file.exists():
        grids = {}
        for li, layer in enumerate(teacher.model.layers):
            for name in LINEARS:
                W, H = layer.get_submodule(name).weight.numpy().T, grams[f"{li}.{name}"].numpy()  # [K,N], [K,K]
                pad = -W.shape[0] % args.block_size
                grids[f"{li}.{name}"] = gptq(_pad(W, args.block_size), np.pad(H, ((0, pad), (0, pad))), 4,
                                             args.block_size, symmetric=False, act_order=True)
        torch.save(grids, grid_file)
    grids = torch.load(grid_file, weights_only=False)

    student = copy.deepcopy(teacher)
    for li, layer in enumerate(student.model.layers):
        for name in LINEARS:
            parent, child = name.split(".")
            K = layer.get_submodule(name).in_features
            setattr(layer.get_submodule(parent), child, QLinear(grids[f"{li}.{name}"], K))
    qlinears = [m for m in student.modules() if isinstance(m, QLinear)]
    record = {"settings": vars(args) | {"work": str(args.work), "out": str(args.out)},
              "train_tokens": int(sum(len(s) for s, _ in train)), "evals": []}

    def report(step: int, seconds: float) -> None:
        r = {"step": step, "train_s": round(seconds), "spec_bench": agreement(teacher, student, bench),
             "held_out_own": agreement(teacher, student, held),
             "codes_changed": sum(int((m.codes().detach() != m.q0).sum()) for m in qlinears)}
        record["evals"].append(r)
        print(r, flush=True)
        args.out.write_text(json.dumps(record, indent=1) + "\n")

    report(0, 0.0)
    student.requires_grad_(False)
    norms = [p for n, p in student.named_parameters() if "norm" in n]
    groups = [{"params": [m.latent for m in qlinears], "lr": args.lr_latent},
              {"params": [p for m in qlinears for p in (m.scale, m.offset)], "lr": args.lr_grid},
              {"params": norms, "lr": args.lr_norms}]
    for g in groups:
        for p in g["params"]:
            p.requires_grad_(True)
    opt = torch.optim.AdamW(groups, weight_decay=0.0)
    peak = [g["lr"] for g in opt.param_groups]
    order = torch.Generator().manual_seed(0)
    plan: list = []
    while len(plan) < args.steps:
        plan += _batches(train, args.batch_tokens, torch.randperm(len(train), generator=order).tolist())
    t0 = time.perf_counter()
    for i, idx in enumerate(plan[:args.steps]):
        factor = min(1.0, (i + 1) / 10) * 0.5 * (1 + math.cos(math.pi * i / args.steps))  # warm-up, cosine
        for g, lr in zip(opt.param_groups, peak):
            g["lr"] = lr * factor
        ids, attn, rows = _collate(train, idx)
        with torch.no_grad():
            target_lp = _log_probs(teacher, ids, attn, rows)
        loss = _kl(_log_probs(student, ids, attn, rows), target_lp, "batchmean")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if (i + 1) % args.eval_every == 0 or i + 1 == args.steps:
            report(i + 1, time.perf_counter() - t0)


if __name__ == "__main__":
    main()
