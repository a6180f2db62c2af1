"""`specdec export`: target (+ drafter) -> bundle folder with ONNX graphs, tokenizer and manifest.

The bundle is written into `<out>.partial` and renamed into place at the end, so an interrupted
export never leaves a half-written bundle where a good one (or nothing) was.
"""
from __future__ import annotations

import shutil
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

import numpy as np
import onnx

from specdec.errors import SpecdecError
from specdec.export.writer import bundle_files, staged_folder
from specdec.export.graph import (CONTROL_INPUTS, DecoderWeights, build_decoder_graph, kv_input_names,
                                  kv_output_names, model_config_from_hf, save_graph, weights_from_torch)
from specdec.export.layerskip import LayerSkipConfig
from specdec.export.verify import check_logits, measure_min_step_tokens
from specdec.quant.weight_only import (FAST_TARGET_PRESETS, SELF_DRAFT_PRESETS, TARGET_PRESETS, WeightQuantConfig,
                                      quantize_weights)
from specdec.runtime.manifest import (ARGMAX_ROWS, ATTENTION_BIAS, LOGITS_ROWS, MANIFEST_NAME, DrafterSpec, GraphSpec, Manifest, ModelConfig, TokenizerSpec,
                                      read_manifest)
from specdec.export.source import is_gguf
from specdec.runtime.tokenizer import vocab_digest
from specdec.version import __version__

DRAFTERS = ("none", "ngram", *SELF_DRAFT_PRESETS, "layerskip", "eagle", "medusa", "model:PATH")
# fp16 is for GPUs (a CPU runs the fp32 graph faster); int8/int4 are weight-only with fp32 activations. "gguf"
# carries a quantized GGUF's own codes (export/gguf_export.py); "auto" is "gguf" for a quantized GGUF whose drafter
# the streaming export writes (GGUF_DRAFTERS), else fp32.
EXPORT_PRECISIONS = ("auto", "fp32", "fp16", *TARGET_PRESETS, "gguf")
# Drafters a streamed export (a GGUF file, or a checkpoint folder's safetensors) writes: the lookup drafters, an
# EAGLE head, and a draft model given as a bundle, a GGUF file or a checkpoint folder. The others (self-int8/int4,
# layerskip, medusa) are built from the fp32 torch model.
GGUF_DRAFTERS = ("none", "ngram", "eagle")
DRAFT_PRECISIONS = ("int4", "int8", "own")
# The largest block a streamed draft model is rounded in (ExportConfig.draft_precision): a 0.5B int4 draft of a
# 1.5B target in blocks of 128 costs 0.22 of a target step against 0.29 in blocks of 32
# (bench/results/qwen/step_curve_1.5b_0.5b_int4_block128.json)
DRAFT_BLOCK = 128
# A LayerSkip split (exit + tail) runs the target's own arithmetic: it may differ from the whole graph only by
# kernel rounding (fp32 ~1e-5; fp16 and the weight-only kernels' fp32 accumulation ~1e-3).
SPLIT_TOLERANCE = {"fp32": 1e-4, "fp16": 1e-2, "int8": 1e-2, "int4": 1e-2}


# Default draft length by drafter. Prompt lookup and the corpus score each drafted token and draft for free, so
# "auto" (measured step costs, the chain cut where it stops paying) beat a fixed 4 in every Spec-Bench run here:
# fp32 1.58x vs 1.52x, 1.42x vs 1.41x, 1.41x vs 1.41x; fast int4 1.35x vs 1.30x, 1.37x vs 1.29x
# (bench/results/specbench_*_confidence*.json, *_scored_cut.json). Model drafters keep a fixed length: with the
# self-int4 drafter, model:3 ran 0.92x and model:auto 0.88x (specbench_selfint4.json).
DEFAULT_DRAFT_LEN = {"ngram": "auto", "other": 4}


@dataclass(frozen=True)
class ExportConfig:
    drafter: str = "ngram"
    precision: str = "auto"
    max_len: int = 2048  # default KV buffer length a runtime allocates (it can ask for another)
    # The bundle's default draft length; None: DEFAULT_DRAFT_LEN for the drafter.
    draft_len: int | str | None = None
    max_ngram: int = 3
    force: bool = False
    layerskip: LayerSkipConfig = field(default_factory=LayerSkipConfig)  # for drafter "layerskip"
    # Drafters "eagle" / "medusa": a heads file from `specdec train-drafter` (eagle: None = the one shipped for
    # this target, if any).
    heads: Path | None = None
    # Weights of the eagle / medusa heads' graph: int8 (weight-only, int8-activation kernels) or fp32. A draft's
    # numerics never change the output, only how often it is accepted, and the head is read every draft step:
    # on held-out prompts int8 heads kept tau (1.55 chain, 1.75 tree) and ran 1.29x/1.32x vs fp32 heads'
    # 1.22x/1.24x (bench/results/heldout_eagle*.json).
    heads_precision: str = "int8"
    # Copy the corpus of the target's own answers shipped for this target (default model), if any: the runtime's
    # "corpus" drafter (the default for drafter ngram) drafts from it where prompt lookup finds nothing.
    corpus: bool = True
    # int8/int4 target with int8-activation kernels (FAST_TARGET_PRESETS): the fastest CPU graph; measured at export,
    # it runs every step with >= 2 tokens so that speculation stays token-identical (GraphSpec.min_step_tokens).
    fast_kernels: bool = False
    # A checkpoint folder's safetensors streamed tensor by tensor (export/hf_source.py: bounded memory, no torch)
    # where the drafter and precision allow it; False: loaded whole as a torch model, as every other combination is.
    stream: bool = True
    # int8/int4: weights per quantization scale in place of the preset's (None: the preset's 32). Larger blocks make a
    # smaller bundle and faster steps (onnxruntime's int8-activation kernels run ~1.7x faster on blocks of 256 than of
    # 32 from a few rows on) and round less exactly: worth it for a draft model, whose numerics never reach the output.
    block_size: int | None = None
    # A draft model given as a GGUF file or checkpoint folder (drafter model:PATH): "int4" / "int8" rounds it with
    # int8-activation kernels in blocks of up to DRAFT_BLOCK (its numerics never reach the output, only how often
    # its drafts are accepted, and a cheaper draft token is what speculation on a CPU needs); "own" keeps a GGUF's
    # own codes (a checkpoint: fp32). A draft bundle is copied as it is.
    draft_precision: str = "int4"

    def __post_init__(self) -> None:
        if self.precision not in EXPORT_PRECISIONS:
            raise SpecdecError(f"unknown precision {self.precision!r}", f"choose one of {', '.join(EXPORT_PRECISIONS)}")
        if self.precision == "gguf" and not self.streams_gguf:
            raise SpecdecError(f"--drafter {self.drafter} is built from the fp32 model, not from a GGUF's own codes",
                               "export with --precision fp32 (or int8/int4), or use --drafter none, ngram, eagle or "
                               "model:PATH")
        if self.fast_kernels and self.precision not in FAST_TARGET_PRESETS:
            raise SpecdecError(f"--fast-kernels applies to --precision {' or '.join(FAST_TARGET_PRESETS)}, not "
                               f"{self.precision}")
        if self.fast_kernels and self.drafter == "layerskip":
            raise SpecdecError("--fast-kernels is not built into a layerskip export",
                               "export with --drafter layerskip, then `specdec quantize DIR --to int4 --fast-kernels`")
        if self.block_size is not None:
            if self.precision not in FAST_TARGET_PRESETS:
                raise SpecdecError(f"--block-size applies to --precision {' or '.join(FAST_TARGET_PRESETS)}, not "
                                   f"{self.precision}")
            try:
                self.quant_preset  # the preset validates the block size
            except ValueError as e:
                raise SpecdecError(f"--block-size: {e}") from None
        if self.draft_precision not in DRAFT_PRECISIONS:
            raise SpecdecError(f"unknown draft precision {self.draft_precision!r}",
                               f"choose one of {', '.join(DRAFT_PRECISIONS)}")
        if self.heads_precision not in ("fp32", "int8"):
            raise SpecdecError(f"unknown heads precision {self.heads_precision!r}", "choose fp32 or int8")
        if self.heads is not None and self.drafter not in ("eagle", "medusa"):
            raise SpecdecError("--heads is for --drafter eagle or medusa")
        if not (self.drafter in DRAFTERS[:-1] or self.drafter.startswith("model:")):
            raise SpecdecError(f"unknown drafter {self.drafter!r}", f"choose one of {', '.join(DRAFTERS)}")
        if self.max_len <= 0:
            raise SpecdecError("--max-len must be > 0")
        if not (self.draft_len is None or self.draft_len == "auto"
                or (type(self.draft_len) is int and self.draft_len > 0)):
            raise SpecdecError(f"--draft-len must be an integer > 0 or 'auto', got {self.draft_len!r}")

    @property
    def streams_gguf(self) -> bool:
        """Whether a GGUF target (or a checkpoint folder) with this drafter can be streamed (export/gguf_export.py)."""
        return self.drafter in GGUF_DRAFTERS or self.drafter.startswith("model:")

    @property
    def quant_preset(self) -> WeightQuantConfig | None:
        """The rounding of an int8/int4 export: the precision's preset, with --block-size where given."""
        presets = FAST_TARGET_PRESETS if self.fast_kernels else TARGET_PRESETS
        if self.precision not in presets:
            return None
        preset = presets[self.precision]
        return preset if self.block_size is None else replace(preset, block_size=self.block_size)

    @property
    def default_draft_len(self) -> int | str:
        if self.draft_len is not None:
            return self.draft_len
        return DEFAULT_DRAFT_LEN.get(self.drafter, DEFAULT_DRAFT_LEN["other"])


def _graph_spec(file: str, cfg: ModelConfig, precision: str, n_layers: int, hidden: tuple[int, ...] = (),
                quant: dict | None = None, tree: bool = False, target: bool = False,
                exact_argmax: bool = False) -> GraphSpec:
    """`target`: the bundle's target graph, with the `argmax` output and the `logits_rows` input (and, with
    `exact_argmax`, the `argmax_rows` input)."""
    return GraphSpec(file=file, model=cfg, precision=precision, n_layers=n_layers,
                     inputs=CONTROL_INPUTS + ((ATTENTION_BIAS,) if tree else ()) + ((LOGITS_ROWS,) if target else ())
                     + ((ARGMAX_ROWS,) if exact_argmax else ()) + tuple(kv_input_names(n_layers)),
                     outputs=("logits", *(("argmax",) if target else ()), *kv_output_names(n_layers),
                              *(f"hidden.{t}" for t in hidden)),
                     hidden_layers=hidden, quant=quant or {})


def target_graph(model_cfg: ModelConfig, weights: DecoderWeights, precision: str, fast_kernels: bool = False,
                 preset: WeightQuantConfig | None = None, **build) -> onnx.ModelProto:
    """The target's graph, or a slice of it (`build`: n_layers / first_layer / logits of a LayerSkip split), at
    `precision` (int8/int4 with `fast_kernels`: FAST_TARGET_PRESETS). Slices are built and quantized exactly as the
    whole target is, so their weights equal the target's byte for byte and save_graph_sharing points them into its
    weight file instead of copying them. `preset` replaces the precision's rounding (ExportConfig.quant_preset)."""
    if precision in ("fp32", "fp16"):
        return build_decoder_graph(model_cfg, weights, dtype=np.float16 if precision == "fp16" else np.float32, **build)
    preset = preset or (FAST_TARGET_PRESETS if fast_kernels else TARGET_PRESETS)[precision]
    return quantize_weights(build_decoder_graph(model_cfg, weights, **build), preset)


def export_bundle(model_path: str | Path | None, out_dir: str | Path, cfg: ExportConfig,
                  step: Callable[[str], object] | None = None) -> Manifest:
    """Export and return the manifest. `step(description)` is called as each stage starts (progress)."""
    step = step or (lambda _desc: nullcontext())
    out_dir = Path(out_dir)
    if out_dir.exists() and not cfg.force:
        raise SpecdecError(f"output folder {out_dir} already exists", "pass --force to replace it")
    draft_bundle = draft_manifest = draft_streamed = None
    if cfg.drafter.startswith("model:"):
        draft_bundle = Path(cfg.drafter.split(":", 1)[1])
        if is_gguf(draft_bundle) or (not (draft_bundle / MANIFEST_NAME).exists() and _streams_checkpoint(draft_bundle)):
            draft_streamed, draft_bundle = draft_bundle, None
        else:
            draft_manifest = read_manifest(draft_bundle)  # fail early, before the slow target load

    from specdec.export.source import default_model_path, load_source

    model_path = Path(model_path) if model_path is not None else default_model_path()
    precision = cfg.precision
    if precision == "gguf" and not (is_gguf(model_path) or _quantized_checkpoint(model_path)):
        raise SpecdecError(f"--precision gguf carries a GGUF file's (or an AWQ/GPTQ checkpoint's) own codes; "
                           f"{model_path} is neither", "export with --precision fp32, int8 or int4")
    # int8/int4 stream too (export/rounded.py rounds each layer as it is read); stream=False keeps the torch path
    streamed = ("auto", "gguf", "fp32", "fp16") + (("int8", "int4") if cfg.stream else ())
    if is_gguf(model_path) and cfg.streams_gguf and precision in streamed:
        from specdec.export.gguf_source import GGUFSource

        step(f"reading {model_path.name}")
        src = GGUFSource(model_path)  # read once: its metadata takes seconds to parse for a 150k vocabulary
        precision = ("gguf" if src.quantized else "fp32") if precision == "auto" else precision
        return _export_streamed(src, out_dir, replace(cfg, precision=precision), step, draft_bundle, draft_streamed)
    if _quantized_checkpoint(model_path) and not (cfg.stream and cfg.streams_gguf and precision in streamed):
        raise SpecdecError(f"{model_path} is an AWQ/GPTQ checkpoint: specdec reads it with drafter none, ngram, "
                           "eagle or model:PATH, at its own precision (auto), dequantized (fp32, fp16) or rounded again "
                           "(int8, int4)", "choose one of those drafters and precisions")
    if cfg.stream and _streams_checkpoint(model_path) and cfg.streams_gguf and precision in streamed:
        from specdec.export.hf_source import SafetensorsSource

        step(f"reading {model_path.name}")
        src = SafetensorsSource(model_path)
        # an AWQ/GPTQ checkpoint at its own codes (export/hf_quant.py), like a quantized GGUF
        precision = ("gguf" if src.quantized else "fp32") if precision == "auto" else precision
        return _export_streamed(src, out_dir, replace(cfg, precision=precision), step, draft_bundle, draft_streamed)
    cfg = replace(cfg, precision="fp32" if precision == "auto" else precision)

    step("loading model")
    source = load_source(model_path)
    model_cfg = model_config_from_hf(source.hf_config)
    if cfg.max_len > model_cfg.max_position:
        raise SpecdecError(f"--max-len {cfg.max_len} exceeds the model's {model_cfg.max_position} positions")
    if cfg.drafter == "layerskip":
        cfg.layerskip.check_against(model_cfg.n_layers)
    if draft_manifest is not None:  # before any graph is written
        _check_same_vocab(draft_bundle, draft_manifest, vocab_digest(source.tokenizer.backend_tokenizer))
    if draft_streamed is not None:
        _check_streamed_draft_vocab(draft_streamed, vocab_digest(source.tokenizer.backend_tokenizer))
    weights = weights_from_torch(source.model)
    L = model_cfg.n_layers
    # before any graph is written: heads for another target are one error
    from specdec.export.eagle import target_fingerprint

    heads, medusa = _heads(cfg, model_cfg, target_fingerprint(weights))
    # The residual stream the heads read, and an attention bias: their drafts may be verified as token trees.
    tree = heads is not None or medusa is not None
    taps = (L,) if tree else ()

    with staged_folder(out_dir) as partial:
        graphs: dict[str, GraphSpec] = {}

        step(f"writing target graph ({cfg.precision})")
        presets = FAST_TARGET_PRESETS if cfg.fast_kernels else TARGET_PRESETS
        # Greedy steps of a target whose LM head is fp32 take their argmax from an 8-bit copy of it
        # (export/exact_argmax.py); a quantized head is read whole anyway, and fp16 graphs run on GPUs, where the head
        # is not what bounds a step.
        exact_argmax = cfg.precision == "fp32" or (cfg.precision in presets and
                                                   not presets[cfg.precision].quantizes_head)
        save_graph(target_graph(model_cfg, weights, cfg.precision, fast_kernels=cfg.fast_kernels,
                                preset=cfg.quant_preset, hidden_layers=taps, tree=tree, argmax=True, logits_rows=True,
                                exact_argmax=exact_argmax),
                   partial / "target.onnx")
        quant = cfg.quant_preset.to_dict() if cfg.quant_preset is not None else None
        graphs["target"] = _graph_spec("target.onnx", model_cfg, cfg.precision, L, hidden=taps, tree=tree, quant=quant,
                                       target=True, exact_argmax=exact_argmax)
        step("checking target graph against transformers")
        check = check_logits(source.model, partial / "target.onnx", graphs["target"])
        if not check.passes(cfg.precision):
            hint = "please report this model; the graph writer mis-handles it"
            if cfg.precision == "fp16":  # a correct graph can still overflow fp16's range on some models
                hint = "this model may not fit fp16's range; export with --precision fp32 (or int8/int4), or report it"
            raise SpecdecError(f"exported {cfg.precision} graph disagrees with transformers: max |logit diff| "
                               f"{check.max_abs_diff:.2e} > {check.tolerance(cfg.precision):.1e}", hint)
        graphs["target"] = replace(graphs["target"], checks=check.to_checks(cfg.precision))
        if cfg.fast_kernels:
            step("measuring the fast kernels' step-width invariance")
            min_step, step_checks = measure_min_step_tokens(partial / "target.onnx", graphs["target"])
            graphs["target"] = replace(graphs["target"], min_step_tokens=min_step,
                                       checks={**graphs["target"].checks, **step_checks})

        step("writing tokenizer")
        tok = source.tokenizer
        tok.backend_tokenizer.save(str(partial / "tokenizer.json"))
        from tokenizers import Tokenizer

        eos = _eos_ids(source)
        tok_spec = TokenizerSpec(file="tokenizer.json", bos_token_id=tok.bos_token_id, eos_token_ids=eos,
                                 chat_template=tok.chat_template if isinstance(tok.chat_template, str) else None,
                                 vocab_digest=vocab_digest(Tokenizer.from_file(str(partial / "tokenizer.json"))))

        drafter = DrafterSpec(kind="none", draft_len=cfg.default_draft_len)
        if cfg.drafter == "ngram":
            drafter = DrafterSpec(kind="ngram", max_ngram=cfg.max_ngram, draft_len=cfg.default_draft_len)
        elif cfg.drafter in SELF_DRAFT_PRESETS:
            qcfg = SELF_DRAFT_PRESETS[cfg.drafter]
            step(f"writing drafter graph ({cfg.drafter})")
            save_graph(quantize_weights(build_decoder_graph(model_cfg, weights), qcfg),
                       partial / "draft.onnx")
            graphs["draft"] = _graph_spec("draft.onnx", model_cfg, f"int{qcfg.bits}", L, quant=qcfg.to_dict())
            check = check_logits(source.model, partial / "draft.onnx", graphs["draft"])
            graphs["draft"] = replace(graphs["draft"], checks=check.to_checks(graphs["draft"].precision))
            drafter = DrafterSpec(kind="model", graph="draft", draft_len=cfg.default_draft_len)
        elif cfg.drafter == "layerskip":
            from specdec.export.layerskip import calibrate, check_split, write_layerskip

            calib = calibrate(source.model, source.tokenizer, weights, cfg.layerskip, step)
            step(f"writing layerskip graphs (exit at layer {calib.exit_layer} of {L})")
            split_graphs, fields_ = write_layerskip(
                partial, model_cfg, weights, calib, precision=cfg.precision,
                build=lambda **slice_: target_graph(model_cfg, weights, cfg.precision, preset=cfg.quant_preset,
                                                    **slice_))
            graphs.update(split_graphs)
            diff = check_split(partial, graphs, model_cfg.vocab_size)
            if not diff <= SPLIT_TOLERANCE[cfg.precision]:
                raise SpecdecError(f"the layerskip split disagrees with the target graph: max |logit diff| {diff:.2e}",
                                   "please report this model")
            graphs["tail"] = replace(graphs["tail"], checks={"max_abs_logit_diff_vs_target_graph": diff})
            drafter = DrafterSpec(kind="layerskip", draft_len=cfg.default_draft_len, **fields_)
        elif heads is not None:
            from specdec.export.eagle import write_eagle

            step(f"writing EAGLE head graph ({len(heads.vocab)}-token draft vocabulary)")
            # The head reads the target's residual stream: fp16 in an fp16 target, fp32 in all others.
            graphs["eagle"], fields_ = write_eagle(partial, model_cfg, weights, heads,
                                                   dtype=np.float16 if cfg.precision == "fp16" else np.float32,
                                                   int8=cfg.heads_precision == "int8")
            drafter = DrafterSpec(kind="eagle", graph="eagle", draft_len=cfg.default_draft_len, **fields_)
        elif medusa is not None:
            from specdec.export.medusa import build_medusa_graph

            step(f"writing Medusa heads graph ({medusa.W.shape[0]} heads, {len(medusa.vocab)}-token draft vocabulary)")
            graph = build_medusa_graph(model_cfg, weights, medusa)
            if cfg.heads_precision == "int8":
                graph = quantize_weights(graph, SELF_DRAFT_PRESETS["self-int8"])
            save_graph(graph, partial / "medusa.onnx")
            np.save(partial / "draft_vocab.npy", medusa.vocab)
            drafter = DrafterSpec(kind="medusa", draft_len=cfg.default_draft_len, heads="medusa.onnx",
                                  draft_vocab="draft_vocab.npy", calibration=medusa.meta.get("report", {}))
        elif draft_bundle is not None or draft_streamed is not None:
            graphs["draft"], drafter = _draft_model(partial, cfg, tok_spec, step, draft_bundle, draft_streamed)

        from specdec.export.eagle import target_fingerprint

        return _write_manifest(partial, cfg, graphs, drafter, tok_spec, target_fingerprint(weights), source.path, step)


def _heads(cfg: ExportConfig, model_cfg: ModelConfig, fingerprint: str):
    """(EAGLE heads, Medusa heads) of drafter eagle / medusa: the --heads file, else the one specdec ships for the
    target with this fingerprint; (None, None) for other drafters."""
    if cfg.drafter not in ("eagle", "medusa"):
        return None, None
    from specdec.export.eagle import HEADS_FORMAT, load_heads, shipped_heads
    from specdec.export.medusa import HEADS_FORMAT as MEDUSA_FORMAT, load_medusa

    medusa_kind = cfg.drafter == "medusa"
    path = cfg.heads or shipped_heads(fingerprint, MEDUSA_FORMAT if medusa_kind else HEADS_FORMAT)
    if path is None:
        name = "Medusa heads" if medusa_kind else "EAGLE head"
        raise SpecdecError(f"specdec ships no {name} for this target",
                           f"train one: `specdec distill-data -o DATA` then `specdec train-drafter --kind "
                           f"{cfg.drafter} --data DATA -o heads.npz`, and export with --heads heads.npz")
    if medusa_kind:
        return None, load_medusa(path, model_cfg, fingerprint)
    return load_heads(path, model_cfg, fingerprint), None


def _draft_model(partial: Path, cfg: ExportConfig, tok_spec: TokenizerSpec, step, draft_bundle: Path | None,
                 draft_streamed: Path | None) -> tuple[GraphSpec, DrafterSpec]:
    """The draft model's graph in the bundle (copied from a bundle, or streamed from a GGUF file or checkpoint
    folder) and the drafter."""
    if draft_bundle is not None:
        step(f"copying draft model from {draft_bundle}")
        graph = _copy_draft_bundle(draft_bundle, partial, tok_spec)
    else:
        graph = _stream_draft(draft_streamed, partial, step, cfg.draft_precision)
    return graph, DrafterSpec(kind="model", graph="draft", draft_len=cfg.default_draft_len)


def _write_manifest(partial: Path, cfg: ExportConfig, graphs: dict[str, GraphSpec], drafter: DrafterSpec,
                    tok_spec: TokenizerSpec, fingerprint: str, source: Path, step) -> Manifest:
    """Copy the corpus shipped for this target (if any, and wanted), then write the manifest."""
    if cfg.corpus:
        from specdec.export.corpus import CORPUS_FILE, shipped_corpus

        shipped = shipped_corpus(fingerprint)
        if shipped is not None:
            step("copying the corpus of the target's answers shipped with specdec")
            shutil.copyfile(shipped, partial / CORPUS_FILE)
            drafter = replace(drafter, corpus=CORPUS_FILE)
    step("writing manifest")
    manifest = Manifest(tokenizer=tok_spec, graphs=graphs, drafter=drafter, files=bundle_files(partial),
                        default_max_len=cfg.max_len, source=str(source), created_by=f"specdec {__version__}")
    (partial / MANIFEST_NAME).write_text(manifest.to_json())
    return manifest


def _eos_ids(source) -> tuple[int, ...]:
    ids = []
    for cand in (getattr(source.hf_config, "eos_token_id", None), source.tokenizer.eos_token_id):
        for t in cand if isinstance(cand, (list, tuple)) else [cand]:
            if t is not None and int(t) not in ids:
                ids.append(int(t))
    if not ids:
        raise SpecdecError("the model defines no end-of-sequence token", "add eos_token_id to its config")
    return tuple(ids)


def _check_same_vocab(src: Path, m: Manifest, target_digest: str) -> None:
    if m.tokenizer.vocab_digest != target_digest:
        raise SpecdecError(f"drafter bundle {src} has a different vocabulary from the target "
                           f"(vocab digest {m.tokenizer.vocab_digest[:12]} vs {target_digest[:12]})",
                           "a draft model must share the target's tokenizer")


def _copy_draft_bundle(src: Path, dst: Path, target_tok: TokenizerSpec) -> GraphSpec:
    m = read_manifest(src)
    _check_same_vocab(src, m, target_tok.vocab_digest)
    g = m.graphs["target"]
    files = [f for f in m.files if f == g.file or f.startswith(g.file + ".")]
    for f in files:
        (dst / "draft" / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src / f, dst / "draft" / f)
    return GraphSpec(file=f"draft/{g.file}", model=g.model, precision=g.precision, n_layers=g.n_layers,
                     inputs=g.inputs, outputs=g.outputs, hidden_layers=g.hidden_layers, quant=g.quant, checks=g.checks)


def _streams_checkpoint(path: Path) -> bool:
    """Whether `path` is a checkpoint folder whose safetensors export/hf_source.py streams."""
    from specdec.export.hf_source import why_not_streamed

    return path.is_dir() and (path / "config.json").is_file() and why_not_streamed(path) is None


def _quantized_checkpoint(path: Path) -> bool:
    """Whether `path` is a checkpoint folder whose config.json declares quantized weights (AWQ, GPTQ, ...)."""
    import json

    try:
        return path.is_dir() and bool(json.loads((path / "config.json").read_text()).get("quantization_config"))
    except (OSError, ValueError):
        return False


def _streamed_tokenizer(path: Path, folder: Path, eos_ids: tuple[int, ...] = ()) -> TokenizerSpec:
    """The tokenizer of a GGUF file or checkpoint folder saved into `folder` (gguf_source.save_tokenizer) and
    described; `eos_ids`: the model's own end-of-sequence ids (the GGUF's tokenizer.ggml.eos_token_id, config.json's
    eos_token_id), listed first."""
    from tokenizers import Tokenizer

    from specdec.export.gguf_source import save_tokenizer

    info = save_tokenizer(path, folder)
    eos = []
    for cand in (*eos_ids, info["eos"]):
        if cand is not None and int(cand) not in eos:
            eos.append(int(cand))
    if not eos:
        raise SpecdecError(f"{path.name} defines no end-of-sequence token",
                           "add its id (tokenizer.ggml.eos_token_id in a GGUF, eos_token_id in config.json)")
    return TokenizerSpec(file="tokenizer.json", bos_token_id=info["bos"], eos_token_ids=tuple(eos),
                         chat_template=info["chat_template"],
                         vocab_digest=vocab_digest(Tokenizer.from_file(str(folder / "tokenizer.json"))))


def _check_streamed_draft_vocab(path: Path, target_digest: str) -> None:
    """A draft GGUF file or checkpoint folder must share the target's vocabulary: one error before any graph is
    written."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        digest = _streamed_tokenizer(path, Path(tmp)).vocab_digest
    if digest != target_digest:
        raise SpecdecError(f"draft model {path} has a different vocabulary from the target "
                           f"(vocab digest {digest[:12]} vs {target_digest[:12]})",
                           "a draft model must share the target's tokenizer")


def _stream_draft(path: Path, partial: Path, step, draft_precision: str) -> GraphSpec:
    """A draft model given as a GGUF file or a checkpoint folder (vocabulary checked already), streamed into
    `draft/`: rounded to int4/int8 (ExportConfig.draft_precision), or at its own precision (a GGUF's codes, a
    checkpoint's safetensors as fp32). Its steps are never padded: only the target's must be T-invariant."""
    from specdec.export.gguf_export import export_gguf_graph
    from specdec.export.gguf_source import GGUFSource
    from specdec.export.hf_source import SafetensorsSource

    src = GGUFSource(path) if is_gguf(path) else SafetensorsSource(path)
    precision = "gguf" if src.quantized else "fp32"
    block = draft_block(src.config)
    if draft_precision in FAST_TARGET_PRESETS and block < 16:  # no block grid fits its shapes
        step("the draft model's widths fill no blocks of 16: kept at its own precision")
        draft_precision = "own"
    if draft_precision in FAST_TARGET_PRESETS:
        from specdec.export.rounded import RoundedSource

        preset = replace(FAST_TARGET_PRESETS[draft_precision], block_size=block)
        src, precision = RoundedSource(src, preset, draft_precision), "gguf"
    (partial / "draft").mkdir(exist_ok=True)
    step(f"writing draft graph ({draft_precision if draft_precision != 'own' else precision}) from {path.name}")
    spec = export_gguf_graph(src, partial / "draft" / "target.onnx", precision, step, what="draft", invariance=False)
    return replace(spec, file="draft/target.onnx")


def draft_block(cfg: ModelConfig) -> int:
    """The largest block of at most DRAFT_BLOCK weights that divides every matrix's inputs of a model."""
    inputs = (cfg.hidden_size, cfg.n_heads * cfg.head_dim, cfg.intermediate_size)
    return min(DRAFT_BLOCK, *(k & -k for k in inputs))


def _export_streamed(src, out_dir: Path, cfg: ExportConfig, step, draft_bundle: Path | None,
                     draft_streamed: Path | None) -> Manifest:
    """A GGUF target (gguf_source.GGUFSource) or a checkpoint folder's safetensors (hf_source.SafetensorsSource)
    streamed tensor by tensor into the bundle (export/gguf_export.py): bounded memory at any model size, a GGUF's own
    quantized codes with precision "gguf"."""
    from specdec.export.gguf_export import export_gguf_graph, gguf_fingerprint

    model_path = src.path
    model_cfg = src.config
    if cfg.max_len > model_cfg.max_position:
        raise SpecdecError(f"--max-len {cfg.max_len} exceeds the model's {model_cfg.max_position} positions")
    draft_manifest = read_manifest(draft_bundle) if draft_bundle is not None else None
    with staged_folder(out_dir) as partial:
        step("writing tokenizer")
        tok_spec = _streamed_tokenizer(model_path, partial, src.eos_token_ids)
        if draft_manifest is not None:  # before any graph is written
            _check_same_vocab(draft_bundle, draft_manifest, tok_spec.vocab_digest)
        if draft_streamed is not None:
            step(f"checking the vocabulary of draft model {draft_streamed.name}")
            _check_streamed_draft_vocab(draft_streamed, tok_spec.vocab_digest)
        target, precision = src, cfg.precision
        if precision in ("int8", "int4"):  # rounded as each layer is read: a carried source of its own
            from specdec.export.rounded import RoundedSource

            target = RoundedSource(src, cfg.quant_preset, precision)
            precision = "gguf"
        heads, _ = _heads(cfg, model_cfg, gguf_fingerprint(src))
        # An EAGLE head reads the target's residual stream; a carried target pads its narrow steps to keep them
        # T-invariant and verifies chains, not token trees.
        taps = (model_cfg.n_layers,) if heads is not None else ()
        tree = heads is not None and precision != "gguf"
        step(f"writing target graph ({cfg.precision}, {model_cfg.n_layers} layers)")
        graphs = {"target": export_gguf_graph(target, partial / "target.onnx", precision, step, taps=taps, tree=tree)}
        drafter = DrafterSpec(kind="none", draft_len=cfg.default_draft_len)
        if cfg.drafter == "ngram":
            drafter = DrafterSpec(kind="ngram", max_ngram=cfg.max_ngram, draft_len=cfg.default_draft_len)
        elif heads is not None:
            from specdec.export.eagle import write_eagle
            from specdec.export.streamed import LazyWeights

            step(f"writing EAGLE head graph ({len(heads.vocab)}-token draft vocabulary)")
            graphs["eagle"], fields_ = write_eagle(partial, model_cfg, LazyWeights(target, precision == "gguf"),
                                                   heads, dtype=np.float16 if precision == "fp16" else np.float32,
                                                   int8=cfg.heads_precision == "int8")
            drafter = DrafterSpec(kind="eagle", graph="eagle", draft_len=cfg.default_draft_len, **fields_)
        elif draft_bundle is not None or draft_streamed is not None:
            graphs["draft"], drafter = _draft_model(partial, cfg, tok_spec, step, draft_bundle, draft_streamed)
        return _write_manifest(partial, cfg, graphs, drafter, tok_spec, gguf_fingerprint(src), model_path, step)

