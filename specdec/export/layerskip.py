"""`specdec export --drafter layerskip`: split the target at an exit layer E for self-speculation.

Writes graph "exit" (layers [0, E), ending at the residual stream), graph "tail" (layers [E, L) + final norm +
LM head), both pointing into the target's own weight file (no copy), and a small exit head: an optional
low-rank adapter, the final norm and the LM head's rows for a reduced draft vocabulary.

E is chosen from a short calibration on answers the target itself writes to specdec's own prompts: per exit
layer, how often the exit's top token equals the target's, against what drafting from that layer costs.
Models not trained with layer dropout (SmolLM2 is not) exit poorly, so the adapter is trained on the same
answers (KL to the target's next-token distribution) and kept only if it helps on held-out answers.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from specdec.errors import SpecdecError
from specdec.export.graph import MS, OPSET, DecoderWeights
from specdec.runtime.manifest import ModelConfig

# Draft vocabulary of the exit head: the target's most frequent output tokens. The full head of SmolLM2
# (49k x 576 fp32 = 113 MB) costs as much to read as 7 of its 30 layers, every draft step; 8192 rows cost
# 19 MB and cover ~97% of what it writes on specdec's prompts (the coverage is measured and recorded).
DRAFT_VOCAB = 8192
ADAPTER_RANK = 64
# Expected speed-up of a draft length k at per-token acceptance a, against plain decoding, in units of one
# target forward (bytes read: decoding a small model on a CPU is memory-bound). Longest k considered:
K_MAX = 8


@dataclass(frozen=True)
class LayerSkipConfig:
    exit_layer: int | None = None  # None: chosen by the calibration
    adapter: bool = True  # train a low-rank exit adapter (kept only if it raises held-out agreement)
    draft_vocab: int = DRAFT_VOCAB
    adapter_rank: int = ADAPTER_RANK
    prompts: int = 160  # calibration/training prompts (specdec's own, export/prompts.py)
    new_tokens: int = 96  # answer tokens per prompt
    epochs: int = 6
    # Exit layers an adapter is trained for while choosing E (spread over the upper half of the model, where
    # early exits agree with the last layer at all); each costs one adapter training (~20 s for SmolLM2).
    adapter_candidates: int = 6
    seed: int = 0

    def __post_init__(self) -> None:
        if self.exit_layer is not None and self.exit_layer < 1:
            raise SpecdecError(f"--exit-layer must be >= 1, got {self.exit_layer}")
        for name in ("draft_vocab", "adapter_rank", "prompts", "new_tokens", "epochs", "adapter_candidates"):
            if getattr(self, name) < 1:
                raise SpecdecError(f"layerskip {name} must be >= 1, got {getattr(self, name)}")

    def check_against(self, n_layers: int) -> None:
        if self.exit_layer is not None and not 1 <= self.exit_layer < n_layers:
            raise SpecdecError(f"--exit-layer {self.exit_layer} is out of range for a model of {n_layers} layers",
                               f"choose 1..{n_layers - 1}, or 'auto'")


@dataclass
class Adapter:
    """x + up(down(rmsnorm(x) * norm)) on the residual stream after layer E: [D] -> [D]."""

    norm: np.ndarray  # [D]
    down: np.ndarray  # [D, r]
    up: np.ndarray  # [r, D]


@dataclass
class Calibration:
    exit_layer: int
    vocab: np.ndarray  # [N] int64, sorted
    adapter: Adapter | None
    report: dict = field(default_factory=dict)


def draft_cost(w: DecoderWeights, exit_layer: int, n_vocab: int) -> float:
    """Bytes one draft step reads (E layers + the draft head), in units of one full target forward."""
    layer = [sum(a.nbytes for a in (lw.qkv, lw.o_proj, lw.gate, lw.up, lw.down)) for lw in w.layers]
    head = w.embed.nbytes  # the head's [D, V] (tied or not, the same size)
    return (sum(layer[:exit_layer]) + head * n_vocab / w.embed.shape[0]) / (sum(layer) + head)


def best_draft_len(acceptance: float, cost: float) -> tuple[int, float]:
    """(k, expected speed-up): k draft steps of `cost` and one verification (~ one forward; the exit slice of
    the last draft and the tail together are the full model) per round of (1 - a^(k+1)) / (1 - a) tokens."""
    a = min(acceptance, 0.999)
    rates = [((1 - a ** (k + 1)) / (1 - a)) / (k * cost + 1.0) for k in range(K_MAX + 1)]
    k = int(np.argmax(rates))
    return k, float(rates[k])


def calibrate(model, tokenizer, w: DecoderWeights, cfg: LayerSkipConfig,
              step: Callable[[str], object]) -> Calibration:
    """Generate answers with the target, choose E and the draft vocabulary, train the adapter."""
    import torch

    from specdec.export.prompts import instruction_prompts, target_answers

    torch.manual_seed(cfg.seed)
    L = len(w.layers)
    cfg.check_against(L)
    t0 = time.perf_counter()
    step(f"layerskip: the target answers {cfg.prompts} calibration prompts")
    seqs = target_answers(model, tokenizer, instruction_prompts(cfg.prompts, seed=cfg.seed), cfg.new_tokens)
    t_gen = time.perf_counter() - t0
    step("layerskip: collecting hidden states")
    hidden, final, nxt = _hidden_states(model, seqs)  # [L+1, n, D] fp16, [n, D] fp32 (normed), [n]
    n = len(nxt)
    n_train = int(n * 0.8)  # by position order = by prompt: the held-out fifth is other prompts' answers
    vocab = _draft_vocab(np.concatenate([s[0] for s in seqs]), nxt[:n_train], cfg.draft_vocab, tokenizer)
    coverage = float(np.isin(nxt[n_train:], vocab).mean())

    head = torch.from_numpy(np.ascontiguousarray(w.embed[vocab]))  # [N, D]: rows of the (tied) head
    if w.lm_head is not None:
        head = torch.from_numpy(np.ascontiguousarray(w.lm_head[:, vocab].T))
    g_final = torch.from_numpy(w.final_norm)
    eps = float(model.config.rms_norm_eps)
    pos = {int(t): i for i, t in enumerate(vocab)}
    target_idx = torch.tensor([pos.get(int(t), -1) for t in nxt])  # [n]; -1: outside the draft vocabulary

    def agreement(h: "torch.Tensor", rows: slice, adapter=None) -> float:
        x = h[rows].float()
        if adapter is not None:
            x = adapter(x)
        pred = (_rms(x, eps) * g_final) @ head.T  # [m, N]
        return float((pred.argmax(-1) == target_idx[rows]).float().mean())

    held = slice(n_train, n)
    curve = {}
    with torch.no_grad():
        for E in range(1, L):
            acc = agreement(torch.from_numpy(hidden[E]), held)
            cost = draft_cost(w, E, len(vocab))
            k, speed = best_draft_len(acc, cost)
            curve[E] = {"exit_layer": E, "agreement": round(acc, 4), "draft_cost": round(cost, 4),
                        "best_k": k, "predicted_speedup": round(speed, 3)}
    report = {"prompts": cfg.prompts, "answer_tokens": n, "generation_s": round(t_gen, 1),
              "draft_vocab": len(vocab), "draft_vocab_coverage": round(coverage, 4),
              "exit_layer_chosen_by": "--exit-layer" if cfg.exit_layer else "calibration"}
    adapters = {}
    if cfg.adapter:
        candidates = [cfg.exit_layer] if cfg.exit_layer else \
            sorted({int(round(x)) for x in np.linspace(L // 2, L - 1, cfg.adapter_candidates)})
        for E in candidates:
            step(f"layerskip: training the exit adapter for layer {E}")
            t1 = time.perf_counter()
            module = _train_adapter(torch.from_numpy(hidden[E][:n_train]), torch.from_numpy(final[:n_train]),
                                    head, g_final, eps, cfg)
            with torch.no_grad():
                acc = agreement(torch.from_numpy(hidden[E]), held, module)
            k, speed = best_draft_len(acc, curve[E]["draft_cost"])
            curve[E].update(agreement_adapter=round(acc, 4), best_k_adapter=k, predicted_speedup_adapter=round(speed, 3),
                            adapter_train_s=round(time.perf_counter() - t1, 1))
            if acc > curve[E]["agreement"]:  # kept only where it helps on held-out answers
                adapters[E] = module

    def agreement_of(c: dict) -> float:
        return max(c["agreement"], c.get("agreement_adapter", 0.0) if c["exit_layer"] in adapters else 0.0)

    def predicted(c: dict) -> float:
        return best_draft_len(agreement_of(c), c["draft_cost"])[1]

    def one_draft(c: dict) -> float:  # expected speed of k=1: below 1 where drafting does not pay
        return (1 + agreement_of(c)) / (1 + c["draft_cost"])

    # Best predicted speed-up; where nothing is predicted to pay (a model not trained for early exit), the exit
    # that comes closest with one draft token, preferring (within 1%) the one whose drafts are accepted most,
    # so that `specdec bench` shows what the method gives on this model.
    top = max(one_draft(c) for c in curve.values())
    E = cfg.exit_layer or max(curve.values(), key=lambda c: (round(predicted(c), 3), one_draft(c) >= top - 0.01,
                                                              agreement_of(c)))["exit_layer"]
    report["curve"] = list(curve.values())
    report["predicted_speedup"] = predicted(curve[E])
    adapter = None
    if E in adapters:
        module = adapters[E]
        adapter = Adapter(norm=module.norm.detach().numpy().copy(), down=module.down.weight.detach().numpy().T.copy(),
                          up=module.up.weight.detach().numpy().T.copy())
    if cfg.adapter:
        report["adapter"] = {"rank": cfg.adapter_rank, "train_tokens": n_train, "epochs": cfg.epochs,
                             "held_out_agreement_without": curve[E]["agreement"],
                             "held_out_agreement_with": curve[E].get("agreement_adapter"), "kept": adapter is not None}
    return Calibration(exit_layer=E, vocab=vocab, adapter=adapter, report=report)


def _rms(x, eps: float):
    import torch

    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _hidden_states(model, seqs) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Teacher-forced residual streams at answer positions: every layer's [L+1, n, D] (fp16, to bound memory),
    the target's final normed state [n, D] and its next token [n] (= the greedy answer's next token)."""
    import torch

    per_layer, finals, nexts = [], [], []
    with torch.no_grad():
        for ids, n_prompt in seqs:
            if len(ids) <= n_prompt:
                continue
            out = model(torch.from_numpy(ids)[None], output_hidden_states=True)
            rows = slice(n_prompt - 1, len(ids) - 1)  # positions whose next token is an answer token
            hs = out.hidden_states  # L+1 of [1, T, D]; the last is already final-normed
            per_layer.append(torch.stack([h[0, rows] for h in hs[:-1]]).half().numpy())  # [L, m, D]
            finals.append(hs[-1][0, rows].numpy())
            nexts.append(out.logits[0, rows].argmax(-1).numpy())
    hidden = np.concatenate(per_layer, axis=1)  # [L, n, D]
    return hidden, np.concatenate(finals), np.concatenate(nexts)


def _draft_vocab(all_ids: np.ndarray, answer_ids: np.ndarray, size: int, tokenizer) -> np.ndarray:
    """The `size` ids the target writes most (answers count 4x the prompts), topped up with the lowest ids
    (BPE assigns ids in merge order, roughly by frequency), always with the special tokens."""
    V = len(tokenizer)
    counts = np.bincount(all_ids, minlength=V)[:V] + 4 * np.bincount(answer_ids, minlength=V)[:V]
    special = [int(t) for t in tokenizer.all_special_ids if t is not None and 0 <= t < V]
    size = min(size, V)
    order = np.lexsort((np.arange(V), -counts))  # by count, then by id
    chosen = list(dict.fromkeys(special + [int(t) for t in order]))[:size]
    return np.sort(np.asarray(chosen, dtype=np.int64))


def _train_adapter(h_E, final, head, g_final, eps: float, cfg: LayerSkipConfig):
    """KL(target || exit) over the draft vocabulary, on the target's own answers."""
    import torch

    D = h_E.shape[1]

    class LowRank(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = torch.nn.Parameter(torch.ones(D))
            self.down = torch.nn.Linear(D, cfg.adapter_rank, bias=False)
            self.up = torch.nn.Linear(cfg.adapter_rank, D, bias=False)
            torch.nn.init.zeros_(self.up.weight)  # starts as the identity: never worse than no adapter at step 0

        def forward(self, x):
            return x + self.up(self.down(_rms(x, eps) * self.norm))

    module = LowRank()
    opt = torch.optim.AdamW(module.parameters(), lr=2e-3, weight_decay=0.0)
    n, batch = h_E.shape[0], 256
    g = torch.Generator().manual_seed(cfg.seed)
    steps = cfg.epochs * ((n + batch - 1) // batch)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=2e-3, total_steps=max(steps, 1), pct_start=0.1)
    for _ in range(cfg.epochs):
        for idx in torch.randperm(n, generator=g).split(batch):
            with torch.no_grad():
                teacher = torch.log_softmax(final[idx] @ head.T, dim=-1)  # [b, N]
            student = torch.log_softmax((_rms(module(h_E[idx].float()), eps) * g_final) @ head.T, dim=-1)
            loss = torch.nn.functional.kl_div(student, teacher, log_target=True, reduction="batchmean")
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
    return module.eval()


def build_exit_head(cfg: ModelConfig, w: DecoderWeights, vocab: np.ndarray, adapter: Adapter | None) -> onnx.ModelProto:
    """hidden [B,T,D] (residual after layer E) -> logits [B,T,N] over `vocab`."""
    eps = float(cfg.rms_eps)
    head = (w.embed[vocab].T if w.lm_head is None else w.lm_head[:, vocab]).astype(np.float32)  # [D, N]
    inits = [numpy_helper.from_array(np.ascontiguousarray(head), "exit_head.weight"),
             numpy_helper.from_array(w.final_norm.astype(np.float32), "final_norm")]
    nodes, x = [], "hidden"
    if adapter is not None:
        inits += [numpy_helper.from_array(adapter.norm.astype(np.float32), "adapter.norm"),
                  numpy_helper.from_array(adapter.down.astype(np.float32), "adapter.down"),
                  numpy_helper.from_array(adapter.up.astype(np.float32), "adapter.up")]
        nodes += [helper.make_node("SimplifiedLayerNormalization", ["hidden", "adapter.norm"], ["a_norm"], axis=-1, epsilon=eps),
                  helper.make_node("MatMul", ["a_norm", "adapter.down"], ["a_down"]),  # [B,T,r]
                  helper.make_node("MatMul", ["a_down", "adapter.up"], ["a_up"]),  # [B,T,D]
                  helper.make_node("Add", ["hidden", "a_up"], ["adapted"])]
        x = "adapted"
    nodes += [helper.make_node("SimplifiedLayerNormalization", [x, "final_norm"], ["normed"], axis=-1, epsilon=eps),
              helper.make_node("MatMul", ["normed", "exit_head.weight"], ["logits"])]  # [B,T,N]
    graph = helper.make_graph(
        nodes, "specdec_exit_head",
        [helper.make_tensor_value_info("hidden", TensorProto.FLOAT, ["batch", "seq", cfg.hidden_size])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", "seq", len(vocab)])], initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(MS, 1)],
                              producer_name="specdec")
    model.ir_version = 10
    return model


def write_layerskip(partial: Path, model_cfg: ModelConfig, weights: DecoderWeights, calib: Calibration,
                    precision: str, build: Callable[..., "onnx.ModelProto"]) -> tuple[dict, dict]:
    """Write exit.onnx and tail.onnx (sharing target.onnx's weight file), exit_head.onnx and draft_vocab.npy.
    `build(**slice)` writes a slice of the target at its `precision` (bundle.target_graph). Returns (graph specs
    by name, DrafterSpec fields)."""
    from specdec.export.graph import control_inputs, kv_input_names, kv_output_names, save_graph, save_graph_sharing
    from specdec.runtime.manifest import GraphSpec

    E, L = calib.exit_layer, model_cfg.n_layers
    save_graph_sharing(build(n_layers=E, logits=False), partial / "exit.onnx", partial / "target.onnx")
    save_graph_sharing(build(first_layer=E), partial / "tail.onnx", partial / "target.onnx")
    graphs = {
        "exit": GraphSpec(file="exit.onnx", model=model_cfg, precision=precision, n_layers=E,
                          inputs=control_inputs(0) + tuple(kv_input_names(E)),
                          outputs=(*kv_output_names(E), f"hidden.{E}"), hidden_layers=(E,)),
        "tail": GraphSpec(file="tail.onnx", model=model_cfg, precision=precision, n_layers=L, first_layer=E,
                          inputs=control_inputs(E) + tuple(kv_input_names(L, E)),
                          outputs=("logits", *kv_output_names(L, E))),
    }
    save_graph(build_exit_head(model_cfg, weights, calib.vocab, calib.adapter), partial / "exit_head.onnx")
    np.save(partial / "draft_vocab.npy", calib.vocab)
    drafter = {"exit_layer": E, "exit_head": "exit_head.onnx", "draft_vocab": "draft_vocab.npy",
               "calibration": calib.report}
    return graphs, drafter


def check_split(partial: Path, graphs: dict, vocab_size: int, n: int = 48, seed: int = 0) -> float:
    """Max |logit difference| between the split target (exit + tail) and the full target graph on the same
    random ids: a prefill and a verification-shaped step. ~0 for a correct split (same arithmetic)."""
    from specdec.runtime.decoder import Decoder
    from specdec.runtime.kv import KVCache
    from specdec.runtime.session import RuntimeOptions
    from specdec.runtime.split import SplitTarget

    opts = RuntimeOptions(allow_cpu_fp16=True)
    ids = np.random.default_rng(seed).integers(0, vocab_size, size=(1, n))

    def kv(g):
        return KVCache.for_graph(g, 1, n)

    full = Decoder(partial / graphs["target"].file, graphs["target"], graphs["target"].model, kv(graphs["target"]), opts)
    exit_slice = Decoder(partial / graphs["exit"].file, graphs["exit"], graphs["exit"].model, kv(graphs["exit"]), opts)
    split = SplitTarget(exit_slice, Decoder(partial / graphs["tail"].file, graphs["tail"], graphs["tail"].model,
                                            exit_slice.kv, opts))
    worst = 0.0
    for dec in (full, split):
        dec.prefill(ids[:, :n - 8])
    a, b = full.forward(ids[:, n - 8:]), split.forward(ids[:, n - 8:])
    worst = max(worst, float(np.abs(a.astype(np.float32) - b.astype(np.float32)).max()))
    return worst
