"""The public runtime API: load a bundle, then generate or stream text.

    import specdec
    engine = specdec.load("bundles/smollm2")
    for piece in engine.stream("Tell me a joke."):
        print(piece, end="", flush=True)
    print(engine.last_stats.to_dict())
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence, Union

import numpy as np

from specdec.errors import SpecdecError
from specdec.runtime.decoder import MAX_STEP, Decoder
from specdec.runtime.draft_len import AdaptiveDraftLen, DraftLenPolicy, FixedDraftLen, choose_policy, median_seconds
from specdec.runtime.drafters.base import Drafter
from specdec.runtime.drafters.draft_model import ModelDrafter
from specdec.runtime.drafters.eagle import EagleDrafter, EagleHead
from specdec.runtime.drafters.corpus import Corpus, CorpusDrafter
from specdec.runtime.drafters.hybrid import LOOKUP_MIN_NGRAM, HybridDrafter
from specdec.runtime.drafters.layerskip import LayerSkipDrafter
from specdec.runtime.drafters.medusa import MedusaDrafter
from specdec.runtime.drafters.ngram import NgramDrafter
from specdec.runtime.kv import KVCache
from specdec.runtime.memcheck import check_fits
from specdec.runtime.manifest import Manifest, read_manifest
from specdec.runtime.sampling import SamplingConfig
from specdec.runtime.session import RuntimeOptions, provider_list
from specdec.runtime.speculative import SpecStats, speculate
from specdec.runtime.step_costs import StepCostCache, cost_key
from specdec.runtime.split import ExitHead, SplitTarget
from specdec.runtime.tuned import read_tuned
from specdec.runtime.tokenizer import StreamDecoder, TextCodec

# Longest draft the adaptive policy considers: with acceptance 0.8, an 9th draft token adds
# 0.8^9 = 0.13 expected tokens while every drafted token costs a draft step.
AUTO_K_MAX = 8
# Drafters "eagle-tree", "medusa-tree": the heads' next-best tokens added as leaves at draft depths 1, 2, 3. Where the chain's
# token is rejected, the target's choice is often the head's second (or third) guess; every leaf widens the
# verification step by one token, which costs an fp32 target little (FACTS: T=10 is 1.23x T=5) and more for int4.
TREE_SIBLINGS = (2, 1, 1)

Prompt = Union[str, Sequence[dict]]  # text, or chat messages [{"role": ..., "content": ...}]


@dataclass(frozen=True)
class GenerationConfig:
    max_new_tokens: int = 256
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    seed: int | None = None
    stop: tuple[str, ...] = ()
    draft_len: int | str | None = None  # None = the bundle's default; 0 = plain decoding; "auto" = adaptive
    chat: bool = True  # apply the chat template to a text prompt

    def __post_init__(self) -> None:
        if self.max_new_tokens <= 0:
            raise SpecdecError(f"max_new_tokens must be > 0, got {self.max_new_tokens}")
        if isinstance(self.draft_len, str) and self.draft_len != "auto":
            raise SpecdecError(f"draft length must be an integer >= 0 or 'auto', got {self.draft_len!r}")
        if isinstance(self.draft_len, int) and self.draft_len < 0:
            raise SpecdecError(f"draft length must be >= 0 (0 = no speculation), got {self.draft_len}")
        if self.seed is not None and self.seed < 0:
            raise SpecdecError(f"seed must be >= 0, got {self.seed}")
        if isinstance(self.stop, str):  # one stop string, not one per character
            object.__setattr__(self, "stop", (self.stop,))
        if any(not s for s in self.stop):
            raise SpecdecError("a stop string must not be empty (it would end every answer at its first token)")
        object.__setattr__(self, "stop", tuple(self.stop))


@dataclass(frozen=True)
class Generation:
    text: str
    token_ids: list[int]
    finish_reason: str  # "eos" | "stop" | "length" | "kv_full"
    stats: SpecStats


class OutputText:
    """Accepted token chunks -> streamed text, cut at EOS, the token budget and stop strings.

    One definition of when a generation ends and what its text is, shared by Engine and BatchedEngine.
    """

    def __init__(self, codec: TextCodec, eos: set[int], cfg: GenerationConfig) -> None:
        self.cfg, self.eos = cfg, eos
        self.stream = StreamDecoder(codec)
        self.ids: list[int] = []
        self.text = ""
        self.reason = "kv_full"  # until something else ends it, only a full KV buffer can
        self.done = False

    def push(self, tokens: Sequence[int]) -> str:
        """Take one round's tokens; return the new text (possibly ""). Sets `done` when the generation ends."""
        cut = next((i + 1 for i, t in enumerate(tokens) if t in self.eos), None)
        tokens = list(tokens[:cut][: self.cfg.max_new_tokens - len(self.ids)])
        self.ids += tokens
        piece = self.stream.push([t for t in tokens if t not in self.eos])
        already = len(self.text)
        self.text += piece
        # A stop string can only end inside the new piece: search from where it could start.
        window = max(0, already - max((len(s) for s in self.cfg.stop), default=0))
        hit = next((s for s in self.cfg.stop if s in self.text[window:]), None)
        if hit is not None:
            self.text, self.reason, self.done = self.text[:self.text.index(hit, window)], "stop", True
            return self.text[already:]
        if cut is not None:
            self.reason, self.done = "eos", True
        elif len(self.ids) >= self.cfg.max_new_tokens:
            self.reason, self.done = "length", True
        if self.done:
            piece += self.finish()
        return piece

    def finish(self) -> str:
        """Flush text held back for an incomplete character (not after a stop string: that text is cut)."""
        tail = "" if self.reason == "stop" else self.stream.flush()
        self.text += tail
        return tail

    def result(self, stats: SpecStats) -> Generation:
        return Generation(text=self.text, token_ids=list(self.ids), finish_reason=self.reason, stats=stats)


class Engine:
    def __init__(self, bundle: str | Path, max_len: int | None = None, runtime: RuntimeOptions | None = None,
                 drafter: str | None = None, verify_checksums: bool = True, step_costs: StepCostCache | None = None) -> None:
        """`drafter` overrides the bundle's: "none", "ngram", "model" (the bundle's draft graph) or "hybrid"
        (n-gram lookup where it matches, the draft model elsewhere). `step_costs`: where measured step costs
        are kept between runs (default: step_costs.default_path())."""
        self.path = Path(bundle)
        self.manifest: Manifest = read_manifest(self.path, verify_checksums=verify_checksums)
        self.runtime = runtime or RuntimeOptions()
        provider_list(self.runtime)  # an unavailable provider fails here, before KV is allocated on its device
        self.max_len = self.manifest.default_max_len if max_len is None else max_len
        # Step costs for draft_len="auto", per drafter kind: measured on first use (a calibration is ~40 forwards,
        # too dear to repeat per prompt) or read from an earlier run's, then refined by the rounds run.
        self._costs: dict[str, tuple[list[float], float]] = {}
        self.step_costs = step_costs or StepCostCache()
        m = self.manifest
        if not 0 < self.max_len <= m.model.max_position:
            raise SpecdecError(f"--max-len {self.max_len} is outside 1..{m.model.max_position} (the model's positions)")
        # Not told a drafter: what `specdec tune` found fastest on this machine, else the bundle's own.
        self.tuned = read_tuned(self.path, m, self.runtime) if drafter is None else None
        if self.tuned is not None:
            drafter = self.tuned.drafter
        self.default_draft_len = self.tuned.draft_len if self.tuned is not None else m.drafter.draft_len
        if self.runtime.provider == "cpu":  # the KV and prepacked weights live in host memory
            loaded = ["exit", "tail"] if m.split_target else ["target"]
            if (drafter or default_drafter(m)) in ("model", "hybrid"):
                loaded.append(m.drafter.graph or "draft")
            check_fits(self.path, m, loaded, self.max_len)
        self.codec = TextCodec(self.path / m.tokenizer.file, m.tokenizer.chat_template, m.tokenizer.bos_token_id,
                               m.tokenizer.eos_token_ids)
        self.target: Decoder | SplitTarget = self._split_target() if m.split_target else self._decoder("target")
        self._drafters: dict[str, Drafter | None] = {}
        self._eagle_head: EagleHead | None = None  # one head graph and cache for every EAGLE drafter
        self._medusa_heads: ExitHead | None = None
        try:
            self.use_drafter(drafter or default_drafter(m))
        except SpecdecError:
            if self.tuned is None:
                raise
            self.tuned, self.default_draft_len = None, m.drafter.draft_len  # a record this bundle can no longer run
            self.use_drafter(default_drafter(m))
        self.cached_ids: list[int] = []  # what the target's KV holds, for prefix reuse across calls
        self.last_stats = SpecStats()

    def _decoder(self, name: str, kv: KVCache | None = None) -> Decoder:
        g = self.manifest.graphs[name]
        if kv is None:
            kv = KVCache.for_graph(g, 1, self.max_len, device=self.runtime.device, device_id=self.runtime.device_id)
        return Decoder(self.path / g.file, g, g.model, kv, self.runtime)

    def _split_target(self) -> SplitTarget:
        """A LayerSkip bundle's target: its exit and tail slices over one cache (the full graph is not loaded,
        so drafting adds no second copy of any weight)."""
        exit_slice = self._decoder("exit")
        return SplitTarget(exit_slice, self._decoder("tail", kv=exit_slice.kv))

    def use_drafter(self, kind: str) -> None:
        """Switch drafter ("none", "ngram", "corpus", "model", "hybrid", "layerskip", "eagle", "eagle-tree", "medusa",
        "medusa-tree", "hybrid-tree"); each is built once and kept. The "-tree" kinds verify the chain plus the
        heads' next-best tokens (TREE_SIBLINGS) as one token tree.
        "hybrid" is n-gram lookup where it matches and the bundle's draft model or EAGLE/Medusa heads elsewhere;
        "hybrid-tree" drafts with both where the lookup matches and verifies them as branches of one tree."""
        if kind not in self._drafters:
            self._drafters[kind] = self._make_drafter(kind)
        self.drafter_kind, self.drafter = kind, self._drafters[kind]

    def add_draft_bundle(self, bundle: str | Path, name: str) -> None:
        """Register another bundle's target graph as a draft model under `name` (for use_drafter).

        The other bundle must have the same vocabulary (tokenizer digest), since drafts are passed by id.
        """
        other = read_manifest(Path(bundle))
        if other.tokenizer.vocab_digest != self.manifest.tokenizer.vocab_digest:
            raise SpecdecError(f"draft bundle {bundle} has a different vocabulary from {self.path}",
                               "a draft model must share the target's tokenizer")
        g = other.graphs["target"]
        kv = KVCache.for_graph(g, 1, self.max_len, device=self.runtime.device, device_id=self.runtime.device_id)
        self._drafters[name] = ModelDrafter(Decoder(Path(bundle) / g.file, g, g.model, kv, self.runtime))

    def _make_drafter(self, kind: str) -> Drafter | None:
        m = self.manifest
        if kind == "none":
            return None
        if kind == "ngram":
            return NgramDrafter(max_ngram=m.drafter.max_ngram)
        if kind == "corpus":
            return corpus_drafter(self.path, m)
        heads_hybrid = kind in ("hybrid", "hybrid-tree") and m.drafter.kind in ("eagle", "medusa")
        if kind == "hybrid-tree" and not heads_hybrid:
            raise SpecdecError(f"bundle {self.path} has no EAGLE or Medusa heads to branch beside the lookup",
                               "use --drafter hybrid, or a bundle exported with --drafter eagle or medusa")
        if kind in ("eagle", "eagle-tree") or (heads_hybrid and m.drafter.kind == "eagle"):
            if m.drafter.kind != "eagle" or not isinstance(self.target, Decoder):
                raise SpecdecError(f"bundle {self.path} has no EAGLE head", "re-export with --drafter eagle")
            if kind in ("eagle-tree", "hybrid-tree") and not self.target.spec.has_tree_bias:
                # a target at a GGUF's own codes pads its narrow steps (T-invariance) and verifies chains
                raise SpecdecError(f"bundle {self.path}'s target graph cannot verify token trees",
                                   "use --drafter eagle (a chain), or re-export with --precision fp32 for trees"
                                   if self.target.spec.pads_attention_only else "re-export it with this specdec version")
            if self._eagle_head is None:
                self._eagle_head = EagleHead(self._decoder(m.drafter.graph), np.load(self.path / m.drafter.draft_vocab))
            siblings = TREE_SIBLINGS if kind in ("eagle-tree", "hybrid-tree") else ()
            eagle = EagleDrafter(self.target, self._eagle_head, siblings=siblings)
            if kind in ("eagle", "eagle-tree"):
                return eagle
            return self._hybrid(eagle, tree=kind == "hybrid-tree")
        if kind in ("medusa", "medusa-tree") or (heads_hybrid and m.drafter.kind == "medusa"):
            if m.drafter.kind != "medusa" or not isinstance(self.target, Decoder):
                raise SpecdecError(f"bundle {self.path} has no Medusa heads", "re-export with --drafter medusa")
            if self._medusa_heads is None:
                self._medusa_heads = ExitHead(self.path / m.drafter.heads, np.load(self.path / m.drafter.draft_vocab),
                                              self.runtime)
            medusa = MedusaDrafter(self.target, self._medusa_heads,
                                   siblings=TREE_SIBLINGS if kind in ("medusa-tree", "hybrid-tree") else ())
            if kind in ("medusa", "medusa-tree"):
                return medusa
            return self._hybrid(medusa, tree=kind == "hybrid-tree")
        if kind in ("model", "hybrid"):
            if m.drafter.graph is None:
                raise SpecdecError(f"bundle {self.path} has no draft model", "re-export with --drafter self-int8 or model:PATH")
            draft = m.graphs[m.drafter.graph]
            if draft.model.vocab_size != m.model.vocab_size:
                raise SpecdecError(f"draft model vocabulary ({draft.model.vocab_size}) differs from the target's "
                                   f"({m.model.vocab_size})", "a draft model must share the target's tokenizer")
            model = self._drafters.get("model") or ModelDrafter(self._decoder(m.drafter.graph))
            self._drafters["model"] = model
            if kind == "model":
                return model
            # Shares the model drafter (and its KV) with kind "model": one copy of the draft weights.
            return HybridDrafter(NgramDrafter(max_ngram=m.drafter.max_ngram, min_ngram=LOOKUP_MIN_NGRAM), model)
        if kind == "layerskip":
            if not isinstance(self.target, SplitTarget):
                raise SpecdecError(f"bundle {self.path} has no LayerSkip exit", "re-export with --drafter layerskip")
            vocab = np.load(self.path / m.drafter.draft_vocab)
            return LayerSkipDrafter(self.target, ExitHead(self.path / m.drafter.exit_head, vocab, self.runtime))
        raise SpecdecError(f"unknown drafter {kind!r}", "choose none, ngram, corpus, model, hybrid, hybrid-tree, layerskip, eagle, "
                                                        "eagle-tree, medusa or medusa-tree")

    def _hybrid(self, heads: Drafter, tree: bool) -> HybridDrafter:
        """Lookup where it matches (prompt lookup, then the bundle's corpus of the target's answers if it has one),
        else `heads`; `tree`: both as branches of one tree where the lookup matches."""
        m = self.manifest
        lookup = (corpus_drafter(self.path, m) if m.drafter.corpus
                  else NgramDrafter(max_ngram=m.drafter.max_ngram, min_ngram=LOOKUP_MIN_NGRAM))
        kv = self.target.kv
        room = (lambda: min(kv.max_len - int(kv.lengths[0]) - 1, MAX_STEP - 1)) if tree else None
        return HybridDrafter(lookup, heads, room=room)

    def _draft_len_policy(self, draft_len: int | str | None) -> DraftLenPolicy | None:
        if draft_len is None:
            draft_len = self.default_draft_len
        policy = choose_policy(draft_len, self.drafter is not None, self._cached_costs)
        if isinstance(policy, AdaptiveDraftLen):
            # A lookup drafts in microseconds against a forward's milliseconds; a model at its measured step.
            policy.source_draft_s = {"lookup": 0.0, "model": policy.draft_s, "exit": policy.draft_s}
        return policy

    def _cached_costs(self) -> tuple[list[float], float]:
        """Step costs for this drafter: from this process, else from an earlier run on this machine
        (step_costs.py), else measured now."""
        kind = self.drafter_kind
        if kind not in self._costs:
            key = cost_key(self.manifest, kind, self.runtime)
            costs = self.step_costs.load(key)
            if costs is None or len(costs[0]) != AUTO_K_MAX + 1:
                costs = self._measure_costs()
                if len(costs[0]) == AUTO_K_MAX + 1:  # a measurement cut short by a nearly full KV is not kept
                    self.step_costs.store(key, *costs)
            self._costs[kind] = costs
        return self._costs[kind]

    def _keep_costs(self, policy: AdaptiveDraftLen) -> None:
        """The target step costs as the generation's own rounds refined them: the next generation (and the next
        process) starts from these."""
        kind = self.drafter_kind
        self._costs[kind] = (list(policy.verify_s), self._costs[kind][1])
        if len(policy.verify_s) == AUTO_K_MAX + 1:
            self.step_costs.store(cost_key(self.manifest, kind, self.runtime), *self._costs[kind])

    def _measure_costs(self) -> tuple[list[float], float]:
        """Time target steps of width 1..AUTO_K_MAX+1 and one draft step on this device.

        The steps write K/V past the valid length only, so the cache is unchanged (rollback is free).
        """
        kv = self.target.kv
        widths = range(1, min(AUTO_K_MAX + 1, kv.max_len - int(kv.lengths[0])) + 1)
        # Timed as greedy steps (the default): sampled rounds correct them as they run. Where the target has two
        # exact greedy paths (greedy_path.py) these runs are also their first trials, so a width's cost here may mix
        # the two; the rounds' own timings then move it to the faster one's (COST_EMA).
        verify = [median_seconds(lambda t=t: self.target.forward_choices(np.zeros((1, t), dtype=np.int64)))
                  for t in widths]
        draft = 0.0  # an n-gram lookup is microseconds against milliseconds of a forward
        model = self.drafter.model if isinstance(self.drafter, HybridDrafter) else self.drafter
        if isinstance(model, ModelDrafter):
            dec = model.decoder
            draft = median_seconds(lambda: dec.forward(np.zeros((1, 1), dtype=np.int64)))
        if isinstance(model, LayerSkipDrafter):
            exit_slice, head = model.target.exit, model.head
            residual = np.zeros(self.manifest.model.hidden_size, dtype=np.float32)
            draft = median_seconds(lambda: (exit_slice.forward(np.zeros((1, 1), dtype=np.int64)), head.logits(residual)))
        return verify, draft

    def reset(self) -> None:
        """Forget cached context (the KV stays allocated)."""
        self.cached_ids = []
        self.target.kv.reset()

    def encode(self, prompt: Prompt, chat: bool = True) -> list[int]:
        if isinstance(prompt, str):
            if not prompt.strip():
                raise SpecdecError("the prompt is empty", "pass some text")
            if chat and self.codec.has_chat_template:
                return self.codec.apply_chat_template([{"role": "user", "content": prompt}])
            ids = self.codec.encode(prompt)
            bos = self.manifest.tokenizer.bos_token_id
            return ([bos] if bos is not None else []) + ids
        return self.codec.apply_chat_template(list(prompt))

    def fit_conversation(self, messages: Sequence[dict], reserve: int) -> tuple[list[dict], int]:
        """The latest part of a chat that leaves `reserve` tokens of the KV buffer (at most half of it) for the
        answer. Earliest exchanges (a user turn and the replies after it) go first, whole; leading system turns
        stay. Returns (messages, exchanges dropped). Raises where the system turns and the last exchange alone
        do not fit."""
        messages = list(messages)
        n_system = next((i for i, m in enumerate(messages) if m.get("role") != "system"), len(messages))
        system, rest = messages[:n_system], messages[n_system:]
        reserve = min(max(reserve, 1), self.max_len // 2)
        budget = self.max_len - reserve
        if len(self.encode(messages)) <= budget:
            return messages, 0
        # Once trimming, go down to half the budget (llama.cpp's context shift discards half too): the next
        # turns then fit again without trimming, so the re-prefill of a changed prefix happens once every few
        # turns, not on every one.
        kept, dropped = messages, 0
        starts = [i for i, m in enumerate(rest) if m.get("role") == "user" and i > 0]  # exchanges 2, 3, ...
        for dropped, start in enumerate(starts, 1):
            kept = system + rest[start:]
            if len(self.encode(kept)) <= budget // 2:
                break
        n = len(self.encode(kept))
        if n > budget:
            raise SpecdecError(f"the last message needs {n} tokens with the system prompt, but the KV buffer holds "
                               f"{self.max_len} with {reserve} kept for the answer",
                               "shorten it, lower --max-new-tokens or raise --max-len")
        return kept, dropped

    def stream_ids(self, prompt_ids: Sequence[int], cfg: GenerationConfig) -> Iterator[list[int]]:
        """Yield token ids as they are accepted (several at once after a good round); stats in last_stats."""
        prompt_ids = list(prompt_ids)
        if not prompt_ids:
            raise SpecdecError("the prompt is empty", "pass some text")
        if len(prompt_ids) >= self.max_len:
            raise SpecdecError(f"the prompt has {len(prompt_ids)} tokens but the KV buffer holds {self.max_len}",
                               f"raise it with --max-len (the model allows up to {self.manifest.model.max_position})")
        kv = self.target.kv
        n_cached = 0
        # Only what the KV holds counts: the last token emitted is never in it.
        held = self.cached_ids[:int(kv.lengths[0])]
        for a, b in zip(held, prompt_ids[:-1]):  # keep >= 1 token to prefill for the first logits
            if a != b:
                break
            n_cached += 1
        kv.truncate(n_cached)
        self.cached_ids = list(prompt_ids)  # (+ emitted below) mirrors the KV
        policy = self._draft_len_policy(cfg.draft_len)
        drafter = self.drafter if policy is not None else None
        rng = np.random.default_rng(cfg.seed)
        self.last_stats = stats = SpecStats()
        eos = set(self.manifest.tokenizer.eos_token_ids)
        n_new = 0
        try:
            for tokens in speculate(self.target, drafter, prompt_ids, n_cached, policy or FixedDraftLen(0),
                                    cfg.sampling, rng, stats, cfg.max_new_tokens):
                self.cached_ids = self.cached_ids[:int(kv.lengths[0])]
                cut = next((i + 1 for i, t in enumerate(tokens) if t in eos), None)
                tokens = tokens[:cut][: cfg.max_new_tokens - n_new]
                n_new += len(tokens)
                stats.new_tokens = n_new
                self.cached_ids += tokens
                yield tokens
                if cut is not None or n_new >= cfg.max_new_tokens:
                    break
        finally:
            # Also when the caller stops iterating (stream() ends at EOS or the budget) or a round raised.
            self.cached_ids = self.cached_ids[:int(kv.lengths[0])]
            if isinstance(policy, AdaptiveDraftLen) and stats.target_forwards:
                self._keep_costs(policy)

    def stream(self, prompt: Prompt, cfg: GenerationConfig | None = None) -> Iterator[str]:
        """Yield text pieces; the finished Generation is in `last_generation`."""
        cfg = cfg or GenerationConfig()
        out = OutputText(self.codec, set(self.manifest.tokenizer.eos_token_ids), cfg)
        for tokens in self.stream_ids(self.encode(prompt, cfg.chat), cfg):
            piece = out.push(tokens)
            if piece:
                yield piece
            if out.done:
                break
        else:
            tail = out.finish()  # the KV filled up: flush what was held back
            if tail:
                yield tail
        self.last_generation = out.result(self.last_stats)

    def generate(self, prompt: Prompt, cfg: GenerationConfig | None = None) -> Generation:
        for _ in self.stream(prompt, cfg):
            pass
        return self.last_generation


def default_drafter(m: Manifest) -> str:
    """The drafter a bundle decodes with unless told otherwise: its own, except that a lookup bundle with a corpus
    of the target's answers drafts from it where prompt lookup finds nothing."""
    return "corpus" if m.drafter.kind == "ngram" and m.drafter.corpus else m.drafter.kind


def batch_default_drafter(path: Path, m: Manifest, runtime: RuntimeOptions, batchable: tuple[str, ...]) -> str:
    """The drafter a batched engine uses unless told: the tuned one where it can batch, else the bundle's."""
    tuned = read_tuned(path, m, runtime)
    return tuned.drafter if tuned is not None and tuned.drafter in batchable else default_drafter(m)


def corpus_drafter(path: Path, m: Manifest, reliability: dict | None = None) -> CorpusDrafter:
    """The bundle's corpus drafter; `reliability` (another CorpusDrafter's) to share what it learnt."""
    if m.drafter.corpus is None:
        raise SpecdecError(f"bundle {path} has no corpus of the target's answers",
                           "add one with `specdec corpus BUNDLE --data DATA`, or use --drafter ngram")
    corpus = Corpus.load(path / m.drafter.corpus, m.model.vocab_size, m.tokenizer.vocab_digest)
    return CorpusDrafter(NgramDrafter(max_ngram=m.drafter.max_ngram, min_ngram=LOOKUP_MIN_NGRAM), corpus, reliability)


def load(bundle: str | Path, **kwargs) -> Engine:
    return Engine(bundle, **kwargs)
