"""`specdec train-drafter --kind draft-model`: distil a small draft model from the target.

The student is the target's own architecture, tokenizer and hidden size with fewer layers (and optionally
narrower MLPs). It starts as a copy of the target: embedding, final norm and head, and layers taken from evenly
spaced target layers (the first and the last always among them). Its layers and final norm are then trained to
match the target's next-token distribution, KL(target || student), on answers the target itself writes to
specdec's own prompts (export/prompts.py; never the Spec-Bench questions drafters are measured on).

The student is saved as a Hugging Face checkpoint and exported by `export_bundle` as an ordinary bundle, so
`specdec export TARGET --drafter model:PATH` takes it like any other draft bundle. The training report is
written into the bundle as distill_report.json and listed, with its checksum, in the manifest.
"""
from __future__ import annotations

import json
import math
import re
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from specdec.errors import SpecdecError

REPORT_NAME = "distill_report.json"
# The last tenth of the sequences (answers to other prompts than the training ones: the prompts are drawn
# independently) is held out to measure top-1 agreement with the target before and after training.
HELD_OUT_FRACTION = 0.1
# Learning-rate warm-up, as a fraction of all steps: the copied layers start next to neighbours they were not
# trained with, and full-size Adam steps on their first (large, noisy) gradients would undo the copy.
WARMUP_FRACTION = 0.1
# Gradient-norm clip: Hugging Face Trainer's default, a guard against a rare batch throwing the copy far off.
MAX_GRAD_NORM = 1.0


@dataclass(frozen=True)
class DistillConfig:
    # SmolLM2-135M (the default target) has 30 layers; a forward of 4 of them plus the head the student must
    # keep (same vocabulary, 28M of the 42M parameters it reads) reads ~1/3 of the target's bytes. Fewer
    # layers barely lower that (the head dominates) while each one dropped costs agreement.
    n_layers: int = 4
    # None: the target's MLP width. Narrower MLPs keep each layer's strongest channels (see _mlp_channels).
    intermediate_size: int | None = None
    # Up to 400 x 128 = 51k answer tokens: 2.5x layerskip's 160 prompts, since whole layers train here rather
    # than a rank-64 adapter, over specdec's 53 topics x 28 tasks; batched greedy generation of that many
    # tokens by the 135M default target is estimated (not measured) at minutes on a CPU.
    prompts: int = 400
    # `specdec bench` measures 128-token answers: train on positions as deep into an answer as it will draft.
    new_tokens: int = 128
    # The teacher's distributions are recomputed every epoch (storing them for 50k tokens x 49k vocabulary
    # would take 10 GB), so an epoch costs a target forward over ~70k tokens (~19 TFLOP) plus the student's
    # forward and backward (~12 TFLOP): two epochs are an estimated ~20 minutes at ~50 GFLOP/s (2 AVX2 cores).
    epochs: int = 2
    # Peak AdamW learning rate: the layers start from trained weights (fine-tuning, not training from scratch).
    lr: float = 5e-4
    # Tokens (padded) per step: ~12 answers of ~170 tokens; the [tokens, 49k] fp32 logits of teacher and
    # student are 400 MB each, a few GB at peak with the backward pass.
    batch_tokens: int = 2048
    seed: int = 0  # prompts drawn, data order
    # KV length the draft bundle's runtime allocates by default; None: export's default (2048), capped at the
    # model's positions. A target loading it as its drafter allocates the draft KV at its own length anyway.
    max_len: int | None = None
    force: bool = False  # replace an existing output folder

    def __post_init__(self) -> None:
        def require(ok: bool, message: str) -> None:
            if not ok:
                raise SpecdecError(f"draft-model training: {message}")

        def is_int(value) -> bool:
            return isinstance(value, int) and not isinstance(value, bool)

        # Both the first and the last target layer are copied (the first reads the embeddings, the last writes
        # into the space the head reads), so the student needs at least two.
        require(is_int(self.n_layers) and self.n_layers >= 2, f"n_layers must be an integer >= 2, got {self.n_layers!r}")
        require(self.intermediate_size is None or (is_int(self.intermediate_size) and self.intermediate_size >= 1),
                f"intermediate_size must be None (the target's) or an integer >= 1, got {self.intermediate_size!r}")
        # At least one answer to train on and one held out to measure on.
        require(is_int(self.prompts) and self.prompts >= 2, f"prompts must be an integer >= 2, got {self.prompts!r}")
        for name in ("new_tokens", "epochs", "batch_tokens"):
            value = getattr(self, name)
            require(is_int(value) and value >= 1, f"{name} must be an integer >= 1, got {value!r}")
        require(isinstance(self.lr, (int, float)) and not isinstance(self.lr, bool) and math.isfinite(self.lr)
                and self.lr > 0, f"lr must be a finite number > 0, got {self.lr!r}")
        require(is_int(self.seed) and self.seed >= 0, f"seed must be an integer >= 0, got {self.seed!r}")
        require(self.max_len is None or (is_int(self.max_len) and self.max_len >= 1),
                f"max_len must be None or an integer >= 1, got {self.max_len!r}")

    def check_against(self, hf_config) -> None:
        """Checks that need the target: run before the (slow) generation and training."""
        L = hf_config.num_hidden_layers
        if self.n_layers >= L:
            raise SpecdecError(f"a draft model of {self.n_layers} layers is not smaller than the {L}-layer target "
                               "(it would draft no faster than the target verifies)", f"choose --layers 2..{L - 1}")
        if self.intermediate_size is not None and self.intermediate_size > hf_config.intermediate_size:
            raise SpecdecError(f"intermediate_size {self.intermediate_size} is wider than the target's "
                               f"{hf_config.intermediate_size}: the student's MLPs are cut from the target's",
                               f"choose at most {hf_config.intermediate_size}, or None for the target's width")
        if self.max_len is not None and self.max_len > hf_config.max_position_embeddings:
            raise SpecdecError(f"max_len {self.max_len} exceeds the model's {hf_config.max_position_embeddings} positions")


def spaced_layers(n_target: int, n_student: int) -> list[int]:
    """`n_student` evenly spaced layer indices of an `n_target`-layer model, first and last included.

    floor(x + 0.5) rather than round(): monotone, so with n_student <= n_target (spacing >= 1) no index repeats.
    """
    if not 2 <= n_student <= n_target:
        raise SpecdecError(f"cannot pick {n_student} of {n_target} layers with the first and last among them")
    return [int(i * (n_target - 1) / (n_student - 1) + 0.5) for i in range(n_student)]


def _mlp_channels(gate, up, down, width: int):
    """Indices (ascending) of the `width` MLP channels to keep: channel i adds act(gate_i.x) * (up_i.x) * down[:, i]
    to the residual stream, so the product of those three norms bounds its contribution; keep the largest."""
    import torch

    score = gate.norm(dim=1) * up.norm(dim=1) * down.norm(dim=0)
    return torch.sort(torch.topk(score, width).indices).values


def build_student(target, layers: list[int], intermediate_size: int | None = None):
    """The target's class and config with len(layers) layers (MLP width `intermediate_size` or the target's),
    initialized from the target: embedding, final norm, head, and student layer i = target layer layers[i]."""
    import torch

    t_cfg = target.config
    d = t_cfg.to_dict()
    d["num_hidden_layers"] = len(layers)
    if intermediate_size is not None:
        d["intermediate_size"] = intermediate_size
    if isinstance(d.get("layer_types"), list):  # per-layer attention kinds (e.g. Qwen2's sliding window) follow their layer
        d["layer_types"] = [d["layer_types"][i] for i in layers]
    student = type(target)(type(t_cfg).from_dict(d)).float()

    t_state = target.state_dict()
    channels = {}
    if intermediate_size is not None and intermediate_size < t_cfg.intermediate_size:
        for i, src in enumerate(layers):
            p = f"model.layers.{src}.mlp."
            channels[i] = _mlp_channels(t_state[p + "gate_proj.weight"], t_state[p + "up_proj.weight"],
                                        t_state[p + "down_proj.weight"], intermediate_size)
    state = {}
    for key, param in student.state_dict().items():
        m = re.fullmatch(r"(model\.layers\.)(\d+)\.(.+)", key)
        src_key = f"{m[1]}{layers[int(m[2])]}.{m[3]}" if m else key
        if src_key not in t_state:
            raise SpecdecError(f"cannot initialize the student's {key}: the target has no {src_key}",
                               "please report this model")
        w = t_state[src_key]
        if m and int(m[2]) in channels and m[3] in ("mlp.gate_proj.weight", "mlp.up_proj.weight"):
            w = w[channels[int(m[2])]]  # [I, D]: rows are channels
        elif m and int(m[2]) in channels and m[3] == "mlp.down_proj.weight":
            w = w[:, channels[int(m[2])]]  # [D, I]: columns are channels
        if w.shape != param.shape:
            raise SpecdecError(f"cannot initialize the student's {key} {tuple(param.shape)} from the target's "
                               f"{src_key} {tuple(w.shape)}", "please report this model")
        state[key] = w.detach().clone().to(torch.float32)
    student.load_state_dict(state)
    # The embedding and head stay the target's: they already map between its vocabulary and the residual space
    # the copied layers work in; freezing them also spares their (largest) gradients and Adam state.
    for module in (student.get_input_embeddings(), student.get_output_embeddings()):
        module.weight.requires_grad_(False)
    return student.eval()


def _batches(seqs: list, batch_tokens: int, order) -> list[list[int]]:
    """Group sequence indices, in `order`, so a right-padded batch holds at most `batch_tokens` tokens (a longer
    sequence goes alone)."""
    out, cur, width = [], [], 0
    for i in order:
        n = len(seqs[i][0])
        if cur and max(width, n) * (len(cur) + 1) > batch_tokens:
            out.append(cur)
            cur, width = [], 0
        cur.append(int(i))
        width = max(width, n)
    if cur:
        out.append(cur)
    return out


def _collate(seqs: list, idx: list[int]):
    """Right-padded ids [B, T], attention mask [B, T], and `rows` [B, T]: the positions whose next token is an
    answer token (the pads are masked; right padding keeps every sequence's positions 0..n-1)."""
    import torch

    T = max(len(seqs[i][0]) for i in idx)
    ids = torch.zeros((len(idx), T), dtype=torch.long)
    attn = torch.zeros((len(idx), T), dtype=torch.long)
    rows = torch.zeros((len(idx), T), dtype=torch.bool)
    for b, i in enumerate(idx):
        s, n_prompt = seqs[i]
        ids[b, :len(s)] = torch.from_numpy(s)
        attn[b, :len(s)] = 1
        rows[b, n_prompt - 1:len(s) - 1] = True
    return ids, attn, rows


def _log_probs(model, ids, attn, rows):
    """Next-token log-probabilities [n, V] at the `rows` positions (the head runs on those rows only)."""
    import torch

    hidden = model.base_model(input_ids=ids, attention_mask=attn, use_cache=False).last_hidden_state[rows]
    return torch.log_softmax(model.get_output_embeddings()(hidden).float(), dim=-1)


def _kl(student_lp, teacher_lp, reduction: str):
    import torch

    return torch.nn.functional.kl_div(student_lp, teacher_lp, log_target=True, reduction=reduction)


def evaluate(target, student, seqs: list, batch_tokens: int) -> dict:
    """Per answer token: KL(target || student) in nats, and how often the student's top token is the target's."""
    import torch

    kl, agree, n = 0.0, 0, 0
    with torch.no_grad():
        for idx in _batches(seqs, batch_tokens, range(len(seqs))):
            ids, attn, rows = _collate(seqs, idx)
            teacher, pupil = _log_probs(target, ids, attn, rows), _log_probs(student, ids, attn, rows)
            kl += float(_kl(pupil, teacher, "sum"))
            agree += int((pupil.argmax(-1) == teacher.argmax(-1)).sum())
            n += int(rows.sum())
    return {"kl": kl / n, "agreement": agree / n, "tokens": n}


def _train(target, student, seqs: list, cfg: DistillConfig, step: Callable[[str], object]) -> list[float]:
    """AdamW with linear warm-up then cosine decay; returns the mean per-token KL of each epoch."""
    import torch

    params = [p for p in student.parameters() if p.requires_grad]
    # No weight decay: it would pull the copied weights toward zero, away from where they already work.
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
    g = torch.Generator().manual_seed(cfg.seed)
    plan = [_batches(seqs, cfg.batch_tokens, torch.randperm(len(seqs), generator=g).tolist()) for _ in range(cfg.epochs)]
    total = sum(len(b) for b in plan)
    warm = max(1, round(WARMUP_FRACTION * total))

    def lr_factor(i: int) -> float:
        if i < warm:
            return (i + 1) / warm
        return 0.5 * (1 + math.cos(math.pi * (i - warm) / max(1, total - warm)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
    epoch_kl = []
    for e, batches in enumerate(plan):
        step(f"draft model: training epoch {e + 1}/{cfg.epochs} ({len(batches)} steps)")
        student.train()
        kl_sum, n = 0.0, 0
        for idx in batches:
            ids, attn, rows = _collate(seqs, idx)
            with torch.no_grad():
                teacher = _log_probs(target, ids, attn, rows)
            loss = _kl(_log_probs(student, ids, attn, rows), teacher, "batchmean")  # per answer token
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, MAX_GRAD_NORM)
            opt.step()
            sched.step()
            m = int(rows.sum())
            kl_sum, n = kl_sum + loss.item() * m, n + m
        epoch_kl.append(kl_sum / n)
    student.eval()
    return epoch_kl


def train_draft_model(model_path: str | Path | None, out_dir: str | Path, cfg: DistillConfig,
                      step: Callable[[str], object] | None = None) -> dict:
    """Distil a draft model from the target at `model_path` (None: the default model) into the bundle `out_dir`.

    Returns the report (also written as out_dir/distill_report.json). `step(description)` is called as each
    stage starts (progress). The bundle appears at `out_dir` only once complete, report included.
    """
    step = step or (lambda _desc: None)
    out_dir = Path(out_dir)
    if out_dir.exists() and not cfg.force:
        raise SpecdecError(f"output folder {out_dir} already exists", "pass --force to replace it")

    import torch

    from specdec.export.bundle import ExportConfig, export_bundle
    from specdec.export.writer import bundle_files, staged_folder
    from specdec.export.prompts import instruction_prompts, target_answers
    from specdec.export.source import load_source
    from specdec.runtime.manifest import MANIFEST_NAME

    step("loading target")
    source = load_source(model_path)
    target, t_cfg = source.model, source.hf_config
    cfg.check_against(t_cfg)
    L = t_cfg.num_hidden_layers
    max_len = cfg.max_len or min(ExportConfig().max_len, t_cfg.max_position_embeddings)
    layers = spaced_layers(L, cfg.n_layers)

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    # The student checkpoint is an intermediate: beside the output (same disk), removed whatever happens.
    with tempfile.TemporaryDirectory(dir=out_dir.parent, prefix=f".{out_dir.name}.student-") as tmp:
        student_dir = Path(tmp) / "student"
        # Saved before target_answers, which sets left padding and a pad token on it for batched generation.
        source.tokenizer.save_pretrained(student_dir)
        torch.manual_seed(cfg.seed)
        student = build_student(target, layers, cfg.intermediate_size)

        step(f"draft model: the target answers {cfg.prompts} of specdec's prompts ({cfg.new_tokens} tokens each)")
        t0 = time.perf_counter()
        seqs = target_answers(target, source.tokenizer, instruction_prompts(cfg.prompts, seed=cfg.seed), cfg.new_tokens)
        generation_s = time.perf_counter() - t0
        seqs = [s for s in seqs if len(s[0]) > s[1]]  # an answer that ended at once has no position to learn from
        n_held = max(1, round(HELD_OUT_FRACTION * len(seqs)))
        if len(seqs) - n_held < 1:
            raise SpecdecError(f"the target wrote {len(seqs)} non-empty answers to {cfg.prompts} prompts: too few "
                               "to train on and hold out", "pass more prompts")
        train, held = seqs[:-n_held], seqs[-n_held:]

        step("draft model: measuring the copied student on held-out answers")
        before = evaluate(target, student, held, cfg.batch_tokens)
        t1 = time.perf_counter()
        epoch_kl = _train(target, student, train, cfg, step)
        training_s = time.perf_counter() - t1
        step("draft model: measuring the trained student on held-out answers")
        after = evaluate(target, student, held, cfg.batch_tokens)
        student.save_pretrained(student_dir)

        report = {
            "kind": "draft-model", "target": str(source.path), "target_layers": L, "n_layers": cfg.n_layers,
            "layers_from_target": layers, "intermediate_size": student.config.intermediate_size,
            "target_params": sum(p.numel() for p in target.parameters()),
            "student_params": sum(p.numel() for p in student.parameters()),
            "prompts": cfg.prompts, "new_tokens": cfg.new_tokens, "epochs": cfg.epochs, "lr": cfg.lr,
            "batch_tokens": cfg.batch_tokens, "seed": cfg.seed,
            "answer_tokens": sum(len(s) - n for s, n in seqs), "train_tokens": sum(len(s) - n for s, n in train),
            "held_out_tokens": after["tokens"],
            "generation_s": round(generation_s, 1), "training_s": round(training_s, 1),
            "epoch_kl": [round(k, 5) for k in epoch_kl],
            "first_epoch_kl": round(epoch_kl[0], 5), "last_epoch_kl": round(epoch_kl[-1], 5),
            "held_out_kl_before": round(before["kl"], 5), "held_out_kl_after": round(after["kl"], 5),
            "held_out_agreement_before": round(before["agreement"], 4),
            "held_out_agreement_after": round(after["agreement"], 4),
        }

        # Exported next to the output, completed there with the report, then renamed into place: out_dir only
        # ever holds a whole bundle (export_bundle's own .partial protects the graph-writing part).
        with staged_folder(out_dir, ".staging", create=False) as staging:
            manifest = export_bundle(student_dir, staging, ExportConfig(drafter="none", max_len=max_len),
                                     step=lambda desc: step(f"exporting the draft model: {desc}"))
            (staging / REPORT_NAME).write_text(json.dumps(report, indent=2) + "\n")
            # Listed with its checksum like every bundle file (read_manifest verifies it; quantize copies it);
            # the source is the target the student was distilled from, not the deleted student checkpoint.
            manifest = replace(manifest, files=bundle_files(staging), source=str(source.path))
            (staging / MANIFEST_NAME).write_text(manifest.to_json())
    return report
