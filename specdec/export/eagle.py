"""EAGLE heads: trained by specdec on the target's own answers (`specdec distill-data`), exported as one ONNX graph.

The head is one decoder layer of the target's shape. Its entry at position s is
    x_s = fc(concat(rms_norm(f_s) * g_f, embed(t_{s+1}))) + b
where f_s is the target's residual stream before the final norm at s (or, while drafting, the head's own
prediction of it) and t_{s+1} the next token; its output residual r_s is the prediction of f_{s+1}, read out by
the target's frozen final norm and the LM head rows of a draft vocabulary (the data's most written tokens).

Training unrolls the drafting chain (EAGLE's lesson: a head trained one step ahead drifts on its own features):
step j feeds the features step j-1 predicted, and its attention sees exactly what drafting sees, namely the
real context's entries up to where the chain started and the chain's own entries after it. Loss per step:
KL(target || head) over the draft vocabulary plus a smooth-L1 term on the normed features (EAGLE's regression
loss), steps weighted down geometrically.

The result is a heads file (npz, fp16 weights) pinned to its target by a fingerprint of the target's weights;
`specdec export --drafter eagle --heads FILE` builds the head's graph from it. Heads for the default model ship
inside specdec (specdec/export/heads/), so that export needs no training.
"""
from __future__ import annotations

import gc
import hashlib
import json
import math
import os
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable

import numpy as np

from specdec.errors import SpecdecError
from specdec.export.graph import DecoderWeights, FeatureEntry, LayerWeights
from specdec.runtime.manifest import ModelConfig

HEADS_FORMAT = "specdec-eagle-heads"
HEADS_VERSION = 1
SHIPPED_HEADS = Path(__file__).parent / "heads"
# Draft vocabulary: as for LayerSkip's exit head (export/layerskip.py), 8192 rows cost 1/6 of SmolLM2's head
# to read and cover ~97% of what it writes; FACTS' first EAGLE experiment lost nothing from the restriction.
DRAFT_VOCAB = 8192
# The features' regression term, relative to the KL term (EAGLE weighs its L1 term 1 and its CE 0.1 on raw
# features; on normed features the two are of similar size, and the KL term is what acceptance depends on).
FEATURE_LOSS_WEIGHT = 0.5
STEP_DECAY = 0.8  # weight of unrolled step j: STEP_DECAY**(j-1)
HELD_OUT_FRACTION = 0.05  # of the sequences, for the agreement figures (never trained on)
CHECKPOINT_EVERY_S = 120.0  # a killed training loses at most this much work


@dataclass(frozen=True)
class EagleConfig:
    unroll: int = 3  # drafting steps trained per position (1 = one step ahead only)
    epochs: int = 2
    lr: float = 1e-3  # peak AdamW learning rate (warm-up then cosine decay)
    batch_tokens: int = 2048  # padded positions per optimizer step (~130 steps per 270k-token epoch)
    max_seq: int = 512  # longer ones lose prompt first (_window): reading tasks keep ~300 tokens of their document
    max_tokens: int | None = None  # use at most this many tokens of the data (None: all)
    draft_vocab: int = DRAFT_VOCAB
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("unroll", "epochs", "batch_tokens", "max_seq", "draft_vocab"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise SpecdecError(f"eagle training: {name} must be an integer >= 1, got {value!r}")
        if not (isinstance(self.lr, (int, float)) and math.isfinite(self.lr) and self.lr > 0):
            raise SpecdecError(f"eagle training: lr must be a finite number > 0, got {self.lr!r}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise SpecdecError(f"eagle training: max_tokens must be >= 1 or None, got {self.max_tokens!r}")


def target_fingerprint(w: DecoderWeights) -> str:
    """A short digest of the target's weights: heads trained for one target are refused by another."""
    h = hashlib.sha256()
    for arr in (w.final_norm, w.embed[:64], w.layers[0].qkv[:64], w.layers[-1].down[:64]):
        h.update(np.ascontiguousarray(arr, dtype=np.float32).tobytes())
    return h.hexdigest()[:32]


# ----------------------------------------------------------------------------------------------- data

def data_folders(data) -> list[Path]:
    """One distill-data folder or several (`--data A --data B`), as a list."""
    return [Path(data)] if isinstance(data, (str, os.PathLike)) else [Path(d) for d in data]


def _window(start: int, end: int, n_prompt: int, max_seq: int) -> tuple[int, int, int]:
    """The part of one sequence [start, end) to train on, at most max_seq long: a long prompt (a document to
    summarize) loses its beginning first, as the answer is what is scored; then the answer loses its end.
    Returns (start, end, prompt tokens kept); at least one prompt token stays (its state starts the chain)."""
    cut = max(0, min(n_prompt - 1, (end - start) - max_seq))
    start, n_prompt = start + cut, n_prompt - cut
    return start, min(end, start + max_seq), n_prompt


def load_sequences(data, hidden_size: int, vocab_size: int, max_seq: int,
                   max_tokens: int | None = None) -> list[tuple[np.ndarray, int, np.ndarray]]:
    """(tokens [n] int64, prompt length, pre-norm states [n, D] fp16) per sequence of one or more distill-data
    folders, taken in turn."""
    seqs, total = [], 0
    for folder in data_folders(data):
        shards = sorted(folder.glob("shard-*.npz"))
        if not (folder / "distill.json").is_file() or not shards:
            raise SpecdecError(f"{folder} holds no distillation data", "make it with `specdec distill-data -o DIR`")
        for path in shards:
            try:
                with np.load(path) as d:
                    tokens, starts, prompt_len, hidden = d["tokens"], d["starts"], d["prompt_len"], d["hidden"]
            except (OSError, KeyError, ValueError) as e:
                raise SpecdecError(f"distillation shard {path} is unreadable ({e})",
                                   "delete it and rerun the same `specdec distill-data` command to remake it") from None
            if hidden.shape[1] != hidden_size or (len(tokens) and int(tokens.max()) >= vocab_size):
                raise SpecdecError(f"{path} was made by another model (hidden size {hidden.shape[1]}, target's "
                                   f"{hidden_size})", "make the data with this target")
            for i in range(len(prompt_len)):
                a, b, n_prompt = _window(int(starts[i]), int(starts[i + 1]), int(prompt_len[i]), max_seq)
                if b - a > n_prompt + 1:  # at least two answer tokens: one drafted position
                    seqs.append((tokens[a:b].astype(np.int64), n_prompt, hidden[a:b]))
                    total += b - a
            if max_tokens is not None and total >= max_tokens:
                break
        if max_tokens is not None and total >= max_tokens:
            break
    if len(seqs) < 2:
        raise SpecdecError(f"{', '.join(map(str, data_folders(data)))} hold {len(seqs)} usable answers: "
                           "too few to train and hold out")
    return seqs


def draft_vocab(seqs, size: int, vocab_size: int, special: list[int]) -> np.ndarray:
    """The `size` ids the target writes most in the data's answers, special tokens always in, sorted."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for tokens, n_prompt, _ in seqs:
        counts += np.bincount(tokens[n_prompt:], minlength=vocab_size)[:vocab_size]
    order = np.lexsort((np.arange(vocab_size), -counts))  # by count, then by id (BPE ids ~ frequency order)
    chosen = list(dict.fromkeys([t for t in special if 0 <= t < vocab_size] + [int(t) for t in order]))
    return np.sort(np.asarray(chosen[:min(size, vocab_size)], dtype=np.int64))


def training_setup(model_path, data: "Path | list[Path]", max_seq: int, max_tokens: int | None, n_vocab: int, seed: int,
                   step: Callable[[str], object]):
    """What every head's training starts from: the target (source, config, weights, fingerprint), the data's
    sequences split into held-out and training ones (by seed), and the draft vocabulary from the training ones."""
    from specdec.export.graph import model_config_from_hf, weights_from_torch
    from specdec.export.source import load_source

    step("loading target")
    source = load_source(model_path)
    model_cfg = model_config_from_hf(source.hf_config)
    w = weights_from_torch(source.model)
    fingerprint = target_fingerprint(w)
    # Heads read the embedding, the final norm, the head and the last layer (their initial values): the torch
    # model and the other layers go, so a 1.5B target is held once, not twice, while the head trains.
    source = replace(source, model=None)
    w = w.with_layers(w.layers[-1:])
    gc.collect()
    step("reading distillation data")
    seqs = load_sequences(data, model_cfg.hidden_size, model_cfg.vocab_size, max_seq, max_tokens)
    order = np.random.default_rng(seed).permutation(len(seqs))
    n_held = max(1, round(HELD_OUT_FRACTION * len(seqs)))
    held, train = [seqs[i] for i in order[:n_held]], [seqs[i] for i in order[n_held:]]
    special = [int(t) for t in source.tokenizer.all_special_ids if t is not None]
    vocab = draft_vocab(train, n_vocab, model_cfg.vocab_size, special)
    return source, model_cfg, w, fingerprint, seqs, held, train, vocab


# ----------------------------------------------------------------------------------------------- model

def module_from_heads(cfg: ModelConfig, w: DecoderWeights, heads: "EagleHeads"):
    """The torch module of a saved head (fp16 weights widened): what the ONNX graph computes, for checks."""
    import torch

    head, rms = _module(cfg, w, heads.vocab)
    with np.load(heads.path) as d:
        state = {name: torch.tensor(d[name].astype(np.float32)) for name, _ in head.named_parameters()}
    head.load_state_dict(state, strict=False)
    return head.eval(), rms


def _module(cfg: ModelConfig, w: DecoderWeights, vocab: np.ndarray):
    """The head as a torch module; the target's embedding, final norm, head rows and rotary tables frozen."""
    import torch
    from torch import nn

    D, Nh, KV, H = cfg.hidden_size, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    eps = float(cfg.rms_eps)
    init = w.layers[-1]  # the target's last layer writes into the space the head reads and predicts

    def rms(x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)

    def param(a):
        return nn.Parameter(torch.tensor(np.asarray(a, dtype=np.float32)))

    class Head(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.feat_norm = param(w.final_norm)
            fc = np.concatenate([np.eye(D), np.random.default_rng(0).normal(0, 0.02, (D, D))]).astype(np.float32)
            self.fc, self.fc_bias = param(fc), param(np.zeros(D))  # starts as "the next feature is this one"
            self.input_norm, self.qkv, self.o_proj = param(init.input_norm), param(init.qkv), param(init.o_proj)
            self.qkv_bias = None if init.qkv_bias is None else param(init.qkv_bias)
            self.post_norm, self.gate, self.up, self.down = (param(init.post_norm), param(init.gate), param(init.up),
                                                              param(init.down))
            full = w.embed.T if w.lm_head is None else w.lm_head
            self.register_buffer("embed", torch.tensor(w.embed, dtype=torch.float32), persistent=False)
            self.register_buffer("final_norm", torch.tensor(w.final_norm, dtype=torch.float32), persistent=False)
            self.register_buffer("head", torch.tensor(np.ascontiguousarray(full[:, vocab]), dtype=torch.float32),
                                 persistent=False)  # [D, N]
            self.register_buffer("head_vocab", torch.tensor(vocab, dtype=torch.int64), persistent=False)  # [N]
            self.inv_freq, self.rope_scale = torch.tensor(w.inv_freq, dtype=torch.float32), float(w.rope_scale)

        def readout(self, r):
            return (rms(r) * self.final_norm) @ self.head  # [B,n,N]

        def entry(self, feats, ids):
            x = torch.cat([rms(feats) * self.feat_norm, self.embed[ids]], dim=-1)  # [B,n,2D]
            return x @ self.fc + self.fc_bias  # [B,n,D]

        def qkv_of(self, x):
            B, n, _ = x.shape
            qkv = (rms(x) * self.input_norm) @ self.qkv  # [B,n,(Nh+2KV)H]
            if self.qkv_bias is not None:
                qkv = qkv + self.qkv_bias
            q, k, v = qkv.split([Nh * H, KV * H, KV * H], dim=-1)
            ang = torch.arange(n, dtype=torch.float32)[:, None] * self.inv_freq[None, :]  # [n, H/2]
            cos, sin = torch.cos(ang) * self.rope_scale, torch.sin(ang) * self.rope_scale

            def rope(t, heads):
                t = t.view(B, n, heads, H).transpose(1, 2)  # [B,heads,n,H]
                a, b = t[..., :H // 2], t[..., H // 2:]
                return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)

            rep = Nh // KV
            k, v = rope(k, KV), v.view(B, n, KV, H).transpose(1, 2)
            return rope(q, Nh), k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)  # [B,Nh,n,H] each

        def rest(self, x, attn):
            B, _, n, _ = attn.shape
            r1 = x + attn.transpose(1, 2).reshape(B, n, Nh * H) @ self.o_proj
            h = rms(r1) * self.post_norm
            return r1 + (torch.nn.functional.silu(h @ self.gate) * (h @ self.up)) @ self.down  # [B,n,D]

    return Head(), rms


def _shift(t, d: int):
    """t[..., s, :] -> t[..., s-d, :] along the position axis (-2), zeros for s < d."""
    import torch

    if d == 0:
        return t
    pad = torch.zeros_like(t[..., :d, :])
    return torch.cat([pad, t[..., :-d, :]], dim=-2)


def unrolled(head, feats, ids, steps: int):
    """Run the drafting chain `steps` deep at every position at once. feats [B,n,D] real features, ids [B,n] the
    next tokens. Returns per step j (1-based) the output residuals [B,n,D]: entry s of step j is the j-th draft
    step of a chain whose first step ran at position s-j+1, i.e. it predicts the feature of position s+1."""
    import torch

    n = ids.shape[1]
    keys, values, outs = [], [], []
    pos = torch.arange(n)
    inp = feats
    for j in range(1, steps + 1):
        x = head.entry(inp, ids)
        q, k, v = head.qkv_of(x)
        keys.append(k)
        values.append(v)
        d = q.shape[-1] ** -0.5
        # Real context: step 1's entries up to where this chain started (s - j + 1).
        main = (q @ keys[0].transpose(-1, -2)) * d  # [B,Nh,n,n]
        allowed = pos[None, :] <= pos[:, None] - (j - 1)  # [n,n]
        main = main.masked_fill(~allowed, float("-inf"))
        # The chain's own entries: step m's at position s-(j-m), m = 2..j.
        diag = [((q * _shift(keys[m - 1], j - m)).sum(-1) * d).masked_fill(pos < j - m, float("-inf"))
                for m in range(2, j + 1)]  # each [B,Nh,n]
        scores = torch.cat([main, torch.stack(diag, -1)], dim=-1) if diag else main
        p = torch.softmax(scores, dim=-1)
        p = torch.nan_to_num(p)  # rows with nothing allowed (s < j-1 at step 1 cannot happen; padding rows)
        attn = p[..., :n] @ values[0]
        for i, m in enumerate(range(2, j + 1)):
            attn = attn + p[..., n + i, None] * _shift(values[m - 1], j - m)
        r = head.rest(x, attn)
        outs.append(r)
        inp = _shift(r.detach(), 1)  # step j+1 at s reads what step j predicted at s-1 (the feature of s)
        inp = inp + (pos < 1)[None, :, None] * feats  # position 0 has no prediction; its rows are never scored
    return outs


# ----------------------------------------------------------------------------------------------- training

def _batches(lengths: list[int], batch_tokens: int, rng: np.random.Generator) -> list[list[int]]:
    order = np.argsort(lengths, kind="stable")
    batches, cur, width = [], [], 0
    for i in order:
        width = max(width, lengths[i])
        if cur and width * (len(cur) + 1) > batch_tokens:
            batches.append(cur)
            cur, width = [], lengths[i]
        cur.append(int(i))
    if cur:
        batches.append(cur)
    rng.shuffle(batches)
    return batches


def _collate(seqs, idx: list[int]):
    import torch

    n = max(len(seqs[i][0]) for i in idx)
    B = len(idx)
    tokens = np.zeros((B, n), dtype=np.int64)
    feats = np.zeros((B, n, seqs[idx[0]][2].shape[1]), dtype=np.float32)
    scored = np.zeros((B, n), dtype=bool)  # entry s is scored if it predicts an answer token s+2 that exists
    for b, i in enumerate(idx):
        t, n_prompt, h = seqs[i]
        tokens[b, :len(t)], feats[b, :len(t)] = t, h
        scored[b, max(n_prompt - 1, 0):len(t) - 2] = True
    return torch.from_numpy(tokens), torch.from_numpy(feats), torch.from_numpy(scored)


def _step_losses(head, rms, tokens, feats, scored, steps: int):
    """Per step: (loss, n_scored, n_top1_equal_to_the_target's_token)."""
    import torch

    ids = torch.roll(tokens, -1, dims=1)  # entry s takes token s+1
    outs = unrolled(head, feats, ids, steps)
    with torch.no_grad():
        target_feat = rms(torch.roll(feats, -1, dims=1)) * head.final_norm  # [B,n,D] normed f_{s+1}
        teacher = torch.log_softmax(target_feat @ head.head, dim=-1)  # [B,n,N]
        next_next = torch.roll(tokens, -2, dims=1)  # the target's token at s+2 (greedy data)
    results = []
    pos = torch.arange(tokens.shape[1])
    for j, r in enumerate(outs, start=1):
        mask = scored & (pos >= j - 1)[None, :]
        logp = torch.log_softmax(head.readout(r), dim=-1)
        kl = (teacher.exp() * (teacher - logp)).sum(-1)  # [B,n]
        feat = torch.nn.functional.smooth_l1_loss(rms(r) * head.final_norm, target_feat, reduction="none").mean(-1)
        m = mask.float()
        count = m.sum().clamp(min=1)
        loss = ((kl + FEATURE_LOSS_WEIGHT * feat) * m).sum() / count
        results.append((loss, mask, logp.argmax(-1), next_next))
    return results


def train_eagle(model_path, data: "Path | list[Path]", out: Path, cfg: EagleConfig, step: Callable[[str], object] | None = None,
                progress: Callable[[int, int, float], object] | None = None, init: Path | None = None) -> dict:
    """Train a head for the target at `model_path` on the distill-data folder `data`; write the heads file `out`.
    `init`: a heads file of this target to continue from (its draft vocabulary is kept).

    Resumable: a checkpoint beside `out` (`out`.ckpt) is written every CHECKPOINT_EVERY_S seconds and picked up
    by the same command. `progress(done_steps, total_steps, loss)` after each optimizer step.
    """
    import torch

    step = step or (lambda _desc: None)
    out = Path(out)
    source, model_cfg, w, fingerprint, seqs, held, train, vocab = training_setup(
        model_path, data, cfg.max_seq, cfg.max_tokens, cfg.draft_vocab, cfg.seed, step)
    torch.manual_seed(cfg.seed)
    if init is not None:
        start = load_heads(init, model_cfg, fingerprint)
        head, rms = module_from_heads(model_cfg, w, start)
        head.train()
        vocab = start.vocab
    else:
        head, rms = _module(model_cfg, w, vocab)
    opt = torch.optim.AdamW(head.parameters(), lr=cfg.lr, weight_decay=0.0)
    lengths = [len(s[0]) for s in train]
    per_epoch = len(_batches(lengths, cfg.batch_tokens, np.random.default_rng(0)))
    total = per_epoch * cfg.epochs
    warmup = max(1, total // 20)

    def lr_at(i: int) -> float:
        return cfg.lr * min(1.0, (i + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(i / total, 1.0)))

    ckpt = out.with_name(out.name + ".ckpt")
    settings = {"config": asdict(cfg), "fingerprint": fingerprint, "data": _data_digest(data),
                "init": None if init is None else hashlib.sha256(Path(init).read_bytes()).hexdigest()[:16]}
    done, losses = 0, []
    if ckpt.is_file():
        state = torch.load(ckpt, weights_only=False)
        if state["settings"] == settings:
            head.load_state_dict(state["head"])
            opt.load_state_dict(state["opt"])
            done, losses = state["done"], state["losses"]
            step(f"resuming training at step {done} of {total}")
    step("measuring the untrained head on held-out answers")
    before = evaluate(head, rms, held, cfg)
    step(f"training ({total} steps over {sum(lengths)} tokens, unroll {cfg.unroll})")
    t0, last_ckpt = time.perf_counter(), time.perf_counter()
    head.train()
    for epoch in range(cfg.epochs):
        batches = _batches(lengths, cfg.batch_tokens, np.random.default_rng(cfg.seed + 1 + epoch))
        for b_i, idx in enumerate(batches):
            i = epoch * per_epoch + b_i
            if i < done:
                continue
            tokens, feats, scored = _collate(train, idx)
            results = _step_losses(head, rms, tokens, feats, scored, cfg.unroll)
            loss = sum(STEP_DECAY ** j * r[0] for j, r in enumerate(results))
            for g in opt.param_groups:
                g["lr"] = lr_at(i)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
            opt.step()
            done = i + 1
            losses.append(loss.item())
            if progress is not None:
                progress(done, total, losses[-1])
            if time.perf_counter() - last_ckpt > CHECKPOINT_EVERY_S:
                _save_checkpoint(ckpt, head, opt, done, losses, settings)
                last_ckpt = time.perf_counter()
    training_s = time.perf_counter() - t0
    head.eval()
    step("measuring the trained head on held-out answers")
    after = evaluate(head, rms, held, cfg)
    report = {
        "kind": "eagle", "target": str(source.path), "target_fingerprint": fingerprint,
        "data": [str(f) for f in data_folders(data)],
        "sequences": len(seqs), "train_tokens": sum(lengths),
        "continued_from": None if init is None else start.meta.get("report"),
        "train_answer_tokens": sum(len(t) - p for t, p, _ in train),
        "held_out_sequences": len(held), "draft_vocab": len(vocab), "config": asdict(cfg),
        "steps": total, "training_s": round(training_s, 1),
        "first_loss": round(float(np.mean(losses[:max(1, len(losses) // 10)])), 4) if losses else None,
        "last_loss": round(float(np.mean(losses[-max(1, len(losses) // 10):])), 4) if losses else None,
        "held_out_before": before, "held_out_after": after,
        "vocab_coverage": after["coverage"],
    }
    save_heads(out, head, vocab, model_cfg, fingerprint, report)
    ckpt.unlink(missing_ok=True)
    return report


def _data_digest(data) -> str:
    h = hashlib.sha256()
    for folder in data_folders(data):
        names = sorted(p.name for p in folder.glob("shard-*.npz"))
        h.update(((folder / "distill.json").read_text() + "\n".join(names)).encode())
    return h.hexdigest()[:16]


def _save_checkpoint(path: Path, head, opt, done: int, losses: list, settings: dict) -> None:
    import torch

    tmp = path.with_name(path.name + ".tmp")
    torch.save({"head": head.state_dict(), "opt": opt.state_dict(), "done": done, "losses": losses,
                "settings": settings}, tmp)
    os.replace(tmp, path)


def evaluate(head, rms, seqs, cfg: EagleConfig) -> dict:
    """Top-1 agreement with the target's next token per unrolled step (step j given steps < j on the target's
    tokens), the draft vocabulary's coverage of the answers, and the chain's expected tokens per verification."""
    import torch

    hits = np.zeros(cfg.unroll)
    counts = np.zeros(cfg.unroll)
    covered = total = 0
    with torch.no_grad():
        for idx in _batches([len(s[0]) for s in seqs], cfg.batch_tokens, np.random.default_rng(0)):
            tokens, feats, scored = _collate(seqs, idx)
            for j, (_, mask, top, truth) in enumerate(_step_losses(head, rms, tokens, feats, scored, cfg.unroll)):
                vocab = head.head_vocab
                hits[j] += int(((vocab[top] == truth) & mask).sum())
                counts[j] += int(mask.sum())
                if j == 0:
                    covered += int((torch.isin(truth, vocab) & mask).sum())
                    total += int(mask.sum())
    agree = [float(h / max(c, 1)) for h, c in zip(hits, counts)]
    # Expected tokens per verification of a k-chain, a_j the conditional agreement (the last for deeper steps).
    def tau(k: int) -> float:
        p, t = 1.0, 1.0
        for i in range(k):
            p *= agree[min(i, len(agree) - 1)]
            t += p
        return t

    return {"agreement_by_step": [round(a, 4) for a in agree], "positions": int(counts[0]),
            "coverage": round(covered / max(total, 1), 4), "expected_tau_k4": round(tau(4), 3)}


# ----------------------------------------------------------------------------------------------- heads file + graph

def save_heads(out: Path, head, vocab: np.ndarray, model_cfg: ModelConfig, fingerprint: str, report: dict) -> None:
    arrays = {name: p.detach().numpy().astype(np.float16) for name, p in head.named_parameters()}
    meta = {"format": HEADS_FORMAT, "version": HEADS_VERSION, "target_fingerprint": fingerprint,
            "hidden_size": model_cfg.hidden_size, "vocab_size": model_cfg.vocab_size, "report": report}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp.npz")
    np.savez(tmp, vocab=vocab.astype(np.int64), meta=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8), **arrays)
    os.replace(tmp, out)


@dataclass(frozen=True)
class EagleHeads:
    entry: FeatureEntry
    layer: LayerWeights
    vocab: np.ndarray  # [N]
    meta: dict
    path: Path


def load_heads(path: Path, model_cfg: ModelConfig, fingerprint: str) -> EagleHeads:
    """Read a heads file and check it was trained for this target."""
    path = Path(path)
    try:
        with np.load(path) as d:
            a = {k: d[k] for k in d.files}
        meta = json.loads(a.pop("meta").tobytes().decode())
    except (OSError, ValueError, KeyError) as e:
        raise SpecdecError(f"cannot read EAGLE heads {path}: {e}", "train them with `specdec train-drafter --kind eagle`") from None
    if meta.get("format") != HEADS_FORMAT or meta.get("version") != HEADS_VERSION:
        raise SpecdecError(f"{path} is not a specdec EAGLE heads file (version {HEADS_VERSION})")
    if meta["hidden_size"] != model_cfg.hidden_size or meta["vocab_size"] != model_cfg.vocab_size:
        raise SpecdecError(f"EAGLE heads {path} are for a model of hidden size {meta['hidden_size']} and vocabulary "
                           f"{meta['vocab_size']}; this target has {model_cfg.hidden_size} and {model_cfg.vocab_size}",
                           "train heads for this target with `specdec train-drafter --kind eagle`")
    if meta["target_fingerprint"] != fingerprint:
        raise SpecdecError(f"EAGLE heads {path} were trained for another target (weights fingerprint differs)",
                           "train heads for this target with `specdec train-drafter --kind eagle`")
    f32 = {k: v.astype(np.float32) for k, v in a.items() if k != "vocab"}
    layer = LayerWeights(input_norm=f32["input_norm"], qkv=f32["qkv"], qkv_bias=f32.get("qkv_bias"),
                         o_proj=f32["o_proj"], post_norm=f32["post_norm"], gate=f32["gate"], up=f32["up"],
                         down=f32["down"])
    return EagleHeads(FeatureEntry(norm=f32["feat_norm"], fc=f32["fc"], fc_bias=f32["fc_bias"]), layer,
                      a["vocab"].astype(np.int64), meta, path)


def shipped_heads(fingerprint: str, fmt: str = HEADS_FORMAT) -> Path | None:
    """The heads file (of format `fmt`: EAGLE's or Medusa's) shipped with specdec for this target, if any."""
    for path in sorted(SHIPPED_HEADS.glob("*.npz")):
        try:
            with np.load(path) as d:
                meta = json.loads(d["meta"].tobytes().decode())
        except (OSError, ValueError, KeyError):
            continue
        if meta.get("target_fingerprint") == fingerprint and meta.get("format") == fmt:
            return path
    return None


def head_model_config(model_cfg: ModelConfig, n_vocab: int) -> ModelConfig:
    """The head's graph as a decoder: one layer of the target's shape, logits over the draft vocabulary."""
    from dataclasses import replace

    return replace(model_cfg, n_layers=1, vocab_size=n_vocab)


def write_eagle(partial: Path, model_cfg: ModelConfig, w: DecoderWeights, heads: EagleHeads, dtype=np.float32,
                int8: bool = False):
    """Write eagle.onnx (embedding and rotary tables pointing into target.onnx's weight file) and draft_vocab.npy;
    `int8` quantizes the head's matmuls (weight-only, int8-activation kernels). `w`: the target's DecoderWeights,
    or a streamed target's LazyWeights (export/streamed.py: its embedding as the target graph stores it, GGUF codes
    included, and its head's draft-vocabulary rows read alone). Returns (GraphSpec, DrafterSpec fields)."""
    from specdec.export.graph import (CONTROL_INPUTS, FEATURES, build_decoder_graph, kv_input_names, kv_output_names,
                                      save_graph_sharing)
    from specdec.runtime.manifest import GraphSpec

    cfg = head_model_config(model_cfg, len(heads.vocab))
    hw = w.with_layers([heads.layer])
    graph = build_decoder_graph(cfg, hw, hidden_layers=(1,), dtype=dtype, features=heads.entry, head_vocab=heads.vocab)
    quant = {}
    if int8:
        from specdec.quant.weight_only import SELF_DRAFT_PRESETS, quantize_weights

        graph = quantize_weights(graph, SELF_DRAFT_PRESETS["self-int8"])
        quant = SELF_DRAFT_PRESETS["self-int8"].to_dict()
    save_graph_sharing(graph, partial / "eagle.onnx", partial / "target.onnx")
    np.save(partial / "draft_vocab.npy", heads.vocab)
    precision = "int8" if int8 else "fp16" if np.dtype(dtype) == np.float16 else "fp32"
    spec = GraphSpec(file="eagle.onnx", model=cfg, precision=precision, n_layers=1, quant=quant,
                     activations="fp16" if np.dtype(dtype) == np.float16 else None,
                     inputs=CONTROL_INPUTS + (FEATURES,) + tuple(kv_input_names(1)),
                     outputs=("logits", *kv_output_names(1), "hidden.1"), hidden_layers=(1,))
    return spec, {"draft_vocab": "draft_vocab.npy", "calibration": heads.meta.get("report", {})}
