"""Medusa heads: K small heads on the target's last hidden state, head k guessing the token k+1 places past the
target's own next token. One run of all heads drafts K tokens (no autoregressive draft steps).

Head k: u = rms_norm(f) * g_final (the normed state the LM head reads), u_k = u + SiLU(u W_k + b_k) (Medusa's
residual block), logits = u_k @ the target's LM head rows of the draft vocabulary (shared by all heads, frozen;
W_k starts at 0, so every head starts as the target's own next-token guess). Trained on `specdec distill-data`
output by KL to the target's distribution k+1 positions later; exported as one small graph, hidden [B,T,D] ->
logits [B,T,K,N].
"""
from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from specdec.errors import SpecdecError
from specdec.export.eagle import DRAFT_VOCAB, data_folders, training_setup
from specdec.export.graph import MS, OPSET, DecoderWeights
from specdec.runtime.manifest import ModelConfig

HEADS_FORMAT = "specdec-medusa-heads"
HEADS_VERSION = 1


@dataclass(frozen=True)
class MedusaConfig:
    n_heads: int = 4  # drafts per round; Medusa's paper uses 4-5, later heads are rarely right on a small target
    epochs: int = 2
    lr: float = 1e-3
    batch_tokens: int = 2048  # the teacher and student rows are [batch, K, N] floats each: ~270 MB at K=4, N=8192
    max_seq: int = 320
    max_tokens: int | None = None
    draft_vocab: int = DRAFT_VOCAB
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("n_heads", "epochs", "batch_tokens", "max_seq", "draft_vocab"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise SpecdecError(f"medusa training: {name} must be an integer >= 1, got {value!r}")
        if not (isinstance(self.lr, (int, float)) and math.isfinite(self.lr) and self.lr > 0):
            raise SpecdecError(f"medusa training: lr must be a finite number > 0, got {self.lr!r}")


def _rows(seqs, K: int):
    """Every answer position s with the K later targets: (state index rows, target rows [n, K]) into one flat
    array of states; a target past the sequence's end is -1 (not scored)."""
    starts = np.cumsum([0] + [len(t) for t, _, _ in seqs])
    src, tgt = [], []
    for (tokens, n_prompt, _), a in zip(seqs, starts[:-1]):
        n = len(tokens)
        s = np.arange(max(n_prompt - 1, 0), n - 1)  # positions whose next token is an answer token
        offs = s[:, None] + 1 + np.arange(1, K + 1)[None, :]  # [m, K] state index whose distribution head k learns
        src.append(a + s)
        tgt.append(np.where(offs < n, a + offs - 1, -1))  # the target's state at s+k predicts token s+k+1
    return np.concatenate(src), np.concatenate(tgt)


def train_medusa(model_path, data: "Path | list[Path]", out: Path, cfg: MedusaConfig, step: Callable[[str], object] | None = None,
                 progress: Callable[[int, int, float], object] | None = None) -> dict:
    import torch

    step = step or (lambda _desc: None)
    source, model_cfg, w, fingerprint, _, held, train, vocab = training_setup(
        model_path, data, cfg.max_seq, cfg.max_tokens, cfg.draft_vocab, cfg.seed, step)
    D, K, eps = model_cfg.hidden_size, cfg.n_heads, float(model_cfg.rms_eps)
    full = w.embed.T if w.lm_head is None else w.lm_head
    head = torch.tensor(np.ascontiguousarray(full[:, vocab]), dtype=torch.float32)  # [D, N]
    g = torch.tensor(w.final_norm, dtype=torch.float32)
    torch.manual_seed(cfg.seed)
    W = torch.nn.Parameter(torch.zeros(K, D, D))
    b = torch.nn.Parameter(torch.zeros(K, D))

    def normed(h):
        return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * g

    def logits_of(u):  # u [n, D] -> [n, K, N]
        x = u[:, None, :]
        return (x + torch.nn.functional.silu(torch.einsum("nd,kde->nke", u, W) + b)) @ head

    def flat(part):
        return torch.from_numpy(np.concatenate([h for _, _, h in part]).astype(np.float32)), _rows(part, K)

    train_h, (train_src, train_tgt) = flat(train)
    held_h, (held_src, held_tgt) = flat(held)
    held_tokens = np.concatenate([t for t, _, _ in held])
    opt = torch.optim.AdamW([W, b], lr=cfg.lr, weight_decay=0.0)
    per_epoch = math.ceil(len(train_src) / cfg.batch_tokens)
    total = per_epoch * cfg.epochs

    def evaluate() -> list[float]:
        hits, counts = np.zeros(K), np.zeros(K)
        with torch.no_grad():
            for lo in range(0, len(held_src), cfg.batch_tokens):
                src, tgt = held_src[lo:lo + cfg.batch_tokens], held_tgt[lo:lo + cfg.batch_tokens]
                top = vocab[logits_of(normed(held_h[src])).argmax(-1).numpy()]  # [n, K]
                ok = tgt >= 0
                truth = held_tokens[np.where(ok, tgt + 1, 0)]  # the greedy data's token after the target state
                hits += ((top == truth) & ok).sum(0)
                counts += ok.sum(0)
        return [round(float(h / max(c, 1)), 4) for h, c in zip(hits, counts)]

    before = evaluate()
    step(f"training {K} Medusa heads ({total} steps over {len(train_src)} answer positions)")
    t0, losses = time.perf_counter(), []
    for epoch in range(cfg.epochs):
        perm = np.random.default_rng(cfg.seed + 1 + epoch).permutation(len(train_src))
        for i, lo in enumerate(range(0, len(perm), cfg.batch_tokens)):
            idx = perm[lo:lo + cfg.batch_tokens]
            src, tgt = train_src[idx], train_tgt[idx]
            ok = torch.from_numpy(tgt >= 0)
            with torch.no_grad():
                teacher = torch.log_softmax(normed(train_h[np.maximum(tgt, 0)]) @ head, dim=-1)  # [n, K, N]
            logp = torch.log_softmax(logits_of(normed(train_h[src])), dim=-1)  # [n, K, N]
            kl = (teacher.exp() * (teacher - logp)).sum(-1)  # [n, K]
            loss = (kl * ok).sum() / ok.sum().clamp(min=1)
            step_i = epoch * per_epoch + i
            for group in opt.param_groups:
                group["lr"] = cfg.lr * 0.5 * (1 + math.cos(math.pi * step_i / total))
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
            if progress is not None:
                progress(step_i + 1, total, losses[-1])
    training_s = time.perf_counter() - t0
    after = evaluate()
    report = {"kind": "medusa", "target": str(source.path), "target_fingerprint": fingerprint, "data": [str(f) for f in data_folders(data)],
              "n_heads": K, "train_answer_positions": int(len(train_src)), "held_out_sequences": len(held),
              "draft_vocab": len(vocab), "config": asdict(cfg), "steps": total, "training_s": round(training_s, 1),
              "first_loss": round(float(np.mean(losses[:max(1, len(losses) // 10)])), 4),
              "last_loss": round(float(np.mean(losses[-max(1, len(losses) // 10):])), 4),
              "held_out_agreement_before": before, "held_out_agreement_after": after}
    meta = {"format": HEADS_FORMAT, "version": HEADS_VERSION, "target_fingerprint": fingerprint,
            "hidden_size": D, "vocab_size": model_cfg.vocab_size, "report": report}
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp.npz")
    np.savez(tmp, vocab=vocab, W=W.detach().numpy().astype(np.float16), b=b.detach().numpy().astype(np.float16),
             meta=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8))
    os.replace(tmp, out)
    return report


@dataclass(frozen=True)
class MedusaHeads:
    W: np.ndarray  # [K, D, D]
    b: np.ndarray  # [K, D]
    vocab: np.ndarray  # [N]
    meta: dict


def load_medusa(path: Path, model_cfg: ModelConfig, fingerprint: str) -> MedusaHeads:
    path = Path(path)
    try:
        with np.load(path) as d:
            a = {k: d[k] for k in d.files}
        meta = json.loads(a["meta"].tobytes().decode())
    except (OSError, ValueError, KeyError) as e:
        raise SpecdecError(f"cannot read Medusa heads {path}: {e}", "train them with `specdec train-drafter --kind medusa`") from None
    if meta.get("format") != HEADS_FORMAT or meta.get("version") != HEADS_VERSION:
        raise SpecdecError(f"{path} is not a specdec Medusa heads file (version {HEADS_VERSION})")
    if meta["hidden_size"] != model_cfg.hidden_size or meta["vocab_size"] != model_cfg.vocab_size \
            or meta["target_fingerprint"] != fingerprint:
        raise SpecdecError(f"Medusa heads {path} were trained for another target",
                           "train heads for this target with `specdec train-drafter --kind medusa`")
    return MedusaHeads(a["W"].astype(np.float32), a["b"].astype(np.float32), a["vocab"].astype(np.int64), meta)


def build_medusa_graph(cfg: ModelConfig, w: DecoderWeights, heads: MedusaHeads) -> onnx.ModelProto:
    """hidden [B,T,D] (the target's residual stream before its final norm) -> logits [B,T,K,N]."""
    K, D = heads.W.shape[:2]
    full = w.embed.T if w.lm_head is None else w.lm_head
    inits = [numpy_helper.from_array(np.ascontiguousarray(full[:, heads.vocab], dtype=np.float32), "draft_head.weight"),
             numpy_helper.from_array(w.final_norm.astype(np.float32), "final_norm"),
             numpy_helper.from_array(np.ascontiguousarray(heads.W.transpose(1, 0, 2).reshape(D, K * D)), "medusa.W"),
             numpy_helper.from_array(heads.b.reshape(K * D).astype(np.float32), "medusa.b"),
             numpy_helper.from_array(np.array([0, 0, K, D], dtype=np.int64), "split_shape"),
             numpy_helper.from_array(np.array([0, 0, 1, D], dtype=np.int64), "one_shape")]
    nodes = [
        helper.make_node("SimplifiedLayerNormalization", ["hidden", "final_norm"], ["u"], axis=-1, epsilon=float(cfg.rms_eps)),
        helper.make_node("MatMul", ["u", "medusa.W"], ["uw"]),  # [B,T,K*D]
        helper.make_node("Add", ["uw", "medusa.b"], ["z"]),
        helper.make_node("Sigmoid", ["z"], ["z_sig"]),
        helper.make_node("Mul", ["z", "z_sig"], ["act"]),  # SiLU
        helper.make_node("Reshape", ["act", "split_shape"], ["act4"]),  # [B,T,K,D]
        helper.make_node("Reshape", ["u", "one_shape"], ["u4"]),  # [B,T,1,D]
        helper.make_node("Add", ["u4", "act4"], ["uk"]),  # [B,T,K,D]
        helper.make_node("MatMul", ["uk", "draft_head.weight"], ["logits"]),  # [B,T,K,N]
    ]
    graph = helper.make_graph(
        nodes, "specdec_medusa",
        [helper.make_tensor_value_info("hidden", TensorProto.FLOAT, ["batch", "seq", D])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", "seq", K, len(heads.vocab)])],
        initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(MS, 1)],
                              producer_name="specdec")
    model.ir_version = 10
    return model
