"""`specdec tune`: the fastest lossless drafter for a bundle on this device, found by measuring, then kept.

Every configuration the bundle can run (plain decoding; each drafter it holds at fixed draft lengths and "auto")
runs on the same prompts, interleaved prompt by prompt so that drift of the machine's speed hits all alike.
Rounds double the prompts (2, 4, 8, ...). After each round a configuration below DROP_BELOW of the best one's
tokens per second is dropped (plain decoding, the baseline of every speed-up, and the bundle's own default, which
keeps its place unless beaten by MARGIN over the whole race, never are), so the
budget goes to the contenders. A greedy configuration whose output differs from plain decoding's on any prompt
is dropped at once: the device's kernels are not exact for its step widths (`specdec verify` says where).
The budget is checked between prompts: every configuration still in the race has run the same prompts.

The winner (highest end-to-end tok/s among those left, unless the bundle's own default is within MARGIN of it) is
written to the bundle for this machine key
(runtime/tuned.py); engines not told a drafter then use it.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from specdec.benchmark import PLAIN, WARMUP_PROMPT, WARMUP_TOKENS, BenchConfig, peak_rss_mb, runnable_configs
from specdec.errors import SpecdecError
from specdec.runtime.drafters import DRAFTER_CHOICES
from specdec.runtime.engine import Engine, GenerationConfig
from specdec.runtime.manifest import Manifest
from specdec.runtime.sampling import SamplingConfig
from specdec.runtime.tuned import TunedChoice

LENGTHS = (3, 5, "auto")
DROP_BELOW = 0.8
# The bundle's own default stays unless a challenger beats it by this much: end-to-end tok/s of configurations a
# few percent apart swap places from one run to the next on the same machine.
MARGIN = 0.03
FIRST_ROUND = 2  # prompts in the first round; each round doubles
TUNE_TOKENS = 96  # new tokens per prompt
SAMPLED = SamplingConfig(temperature=0.7, top_p=0.95)

# (config, chat messages) -> (token ids generated, seconds, target passes, accepted drafts)
Measure = Callable[[BenchConfig, list[dict]], tuple[list[int], float, int, int]]


@dataclass
class Trial:
    config: BenchConfig
    per_prompt: list[tuple[int, float]] = field(default_factory=list)  # (tokens, seconds) of each prompt run
    forwards: int = 0
    accepted: int = 0
    rss_mb: float = 0.0  # the process's peak RSS after its first run (what loading its drafter added shows)
    dropped: str | None = None

    @property
    def tok_s(self) -> float:
        tokens, secs = sum(t for t, _ in self.per_prompt), sum(s for _, s in self.per_prompt)
        return tokens / secs if secs else 0.0

    @property
    def tau(self) -> float:
        return (self.accepted + self.forwards) / self.forwards if self.forwards else 1.0


@dataclass
class TuneResult:
    trials: list[Trial]
    prompts: int  # prompts every surviving configuration ran
    rounds: int
    seconds: float
    winner: Trial

    def speedup(self, trial: Trial) -> float:
        """tok/s over plain decoding's on the same prompts (a dropped trial ran fewer)."""
        plain = next(t for t in self.trials if t.config.drafter == "none")
        n = len(trial.per_prompt)
        tokens, secs = sum(t for t, _ in plain.per_prompt[:n]), sum(s for _, s in plain.per_prompt[:n])
        return trial.tok_s / (tokens / secs) if secs and tokens else 0.0

    def choice(self, sampled: bool) -> TunedChoice:
        w = self.winner
        return TunedChoice(drafter=w.config.drafter, draft_len=w.config.draft_len, tok_s=round(w.tok_s, 2),
                           speedup=round(self.speedup(w), 3), prompts=self.prompts, sampled=sampled)

    def to_dict(self) -> dict:
        return {"prompts": self.prompts, "rounds": self.rounds, "seconds": round(self.seconds, 1),
                "winner": self.winner.config.name, "drop_below": DROP_BELOW,
                "configs": [{"config": t.config.name, "prompts": len(t.per_prompt), "tok_s": round(t.tok_s, 2),
                             "tau": round(t.tau, 3), "speedup": round(self.speedup(t), 3), "rss_mb": t.rss_mb,
                             "dropped": t.dropped} for t in self.trials]}


def candidate_configs(manifest: Manifest) -> list[BenchConfig]:
    """Plain decoding and every drafter the bundle holds, at each of LENGTHS."""
    configs = [BenchConfig(kind, k) for kind in DRAFTER_CHOICES if kind != "none" for k in LENGTHS]
    return [BenchConfig("none", 0)] + runnable_configs(manifest.drafter, configs)[0]


def run_tune(configs: list[BenchConfig], prompts: list[list[dict]], measure: Measure, budget_s: float,
             greedy: bool = True, clock: Callable[[], float] = time.perf_counter,
             on_prompt: Callable[[int, int], None] | None = None, incumbent: BenchConfig | None = None) -> TuneResult:
    """Race `configs` over `prompts` within `budget_s` (see the module's docstring for the rules); `incumbent` (the
    bundle's own default) wins unless another configuration is MARGIN faster."""
    if not configs or configs[0].drafter != "none":
        raise ValueError("the first configuration must be plain decoding (the baseline)")
    trials = [Trial(c) for c in configs]
    start = clock()
    done, rounds, size, prompt_s, out_of_time = 0, 0, FIRST_ROUND, 0.0, False
    while done < len(prompts) and not out_of_time:
        for messages in prompts[done:done + size]:
            if done and clock() - start + prompt_s > budget_s:  # the next prompt would not fit
                out_of_time = True
                break
            t0 = clock()
            reference = None
            for trial in [t for t in trials if t.dropped is None]:
                ids, secs, forwards, accepted = measure(trial.config, messages)
                trial.per_prompt.append((len(ids), secs))
                trial.forwards += forwards
                trial.accepted += accepted
                if not trial.rss_mb:
                    trial.rss_mb = round(peak_rss_mb(), 1)
                reference = ids if reference is None else reference
                if greedy and ids != reference:
                    trial.dropped = f"prompt {done + 1}: output differs from plain decoding"
            prompt_s = clock() - t0
            done += 1
            if on_prompt is not None:
                on_prompt(done, len(prompts))
        if out_of_time:
            break
        rounds += 1
        alive = [t for t in trials if t.dropped is None]
        best = max(t.tok_s for t in alive)
        for t in alive:  # plain (the baseline) and the incumbent (the margin needs its full figure) always stay
            if t.config.drafter != "none" and t.config != incumbent and t.tok_s < DROP_BELOW * best:
                t.dropped = f"round {rounds}: {t.tok_s / best:.2f}x the best"
        size *= 2
    if done < min(FIRST_ROUND, len(prompts)):
        need = (clock() - start) * FIRST_ROUND * 2
        raise SpecdecError(f"a budget of {budget_s:.0f} s is too short to compare anything: one prompt under all "
                           f"{len(configs)} configurations took {clock() - start:.0f} s",
                           f"give at least --minutes {need / 60:.1f}, or fewer --new-tokens")
    survivors = [t for t in trials if t.dropped is None and len(t.per_prompt) == done]
    winner = max(survivors, key=lambda t: t.tok_s)
    held = next((t for t in survivors if t.config == incumbent), None)
    if held is not None and winner.tok_s < (1 + MARGIN) * held.tok_s:
        winner = held
    return TuneResult(trials=trials, prompts=done, rounds=rounds, seconds=clock() - start, winner=winner)


def engine_measure(engine: Engine, max_new_tokens: int = TUNE_TOKENS, sampling: SamplingConfig = SamplingConfig(),
                   seed: int = 0) -> Measure:
    """Measure on `engine`: each configuration warmed up once, untimed (first runs allocate, "auto" times the
    target's step widths), then timed end to end (prefill included) from a reset KV."""
    warm: set[str] = set()

    def measure(cfg: BenchConfig, messages: list[dict]) -> tuple[list[int], float, int, int]:
        engine.use_drafter(cfg.drafter)
        gen = GenerationConfig(max_new_tokens=max_new_tokens, draft_len=cfg.draft_len, sampling=sampling,
                               seed=None if sampling.greedy else seed)
        if cfg.name not in warm:
            engine.reset()
            for _ in engine.stream_ids(engine.encode(WARMUP_PROMPT), GenerationConfig(
                    max_new_tokens=WARMUP_TOKENS, draft_len=cfg.draft_len, sampling=sampling, seed=seed)):
                pass
            warm.add(cfg.name)
        engine.reset()
        ids = engine.encode(messages)
        t0 = time.perf_counter()
        tokens = [t for chunk in engine.stream_ids(ids, gen) for t in chunk]
        secs = time.perf_counter() - t0
        s = engine.last_stats
        return tokens, secs, s.target_forwards, s.accepted

    return measure


def read_prompts(path: Path) -> list[list[dict]]:
    """A JSONL file of {"messages": [...]} or {"prompt": "..."} lines (other fields ignored); bad lines skipped."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise SpecdecError(f"cannot read prompts {path}: {e}", "pass a readable JSONL file") from None
    prompts = []
    for line in lines:
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(obj, dict) and isinstance(obj.get("prompt"), str) and obj["prompt"].strip():
            prompts.append([{"role": "user", "content": obj["prompt"]}])
        elif isinstance(obj, dict) and isinstance(obj.get("messages"), list) and obj["messages"] and all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in obj["messages"]):
            prompts.append(obj["messages"])
    if not prompts:
        raise SpecdecError(f"{path} has no usable prompt lines",
                           'each line should be a JSON object with "prompt" (text) or "messages" (a chat)')
    return prompts


def default_prompts(n: int = 64, seed: int = 0) -> list[list[dict]]:
    """specdec's own prompt families (never benchmark questions)."""
    from specdec.export.prompt_families import broad_prompts

    return broad_prompts(n, seed=seed)


def render_table(result: TuneResult, title: str):
    from rich.table import Table

    t = Table(title=title)
    for col in ("config", "prompts", "tok/s", "tau", "speed-up", "peak RSS MB", "note"):
        t.add_column(col, justify="left" if col in ("config", "note") else "right")
    for trial in sorted(result.trials, key=lambda x: (x.dropped is not None, -x.tok_s)):
        note = "winner" if trial is result.winner else (trial.dropped or "")
        t.add_row(trial.config.name, str(len(trial.per_prompt)), f"{trial.tok_s:.1f}", f"{trial.tau:.2f}",
                  f"{result.speedup(trial):.2f}x", f"{trial.rss_mb:.0f}", note)
    return t


def plot(result: TuneResult, path: Path) -> bool:
    """tok/s per configuration as bars (the winner highlighted); False if matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    trials = sorted(result.trials, key=lambda x: -x.tok_s)
    fig, ax = plt.subplots(figsize=(max(6, 0.5 * len(trials)), 4))
    colors = ["tab:green" if t is result.winner else "tab:gray" if t.dropped else "tab:blue" for t in trials]
    ax.bar([t.config.name for t in trials], [t.tok_s for t in trials], color=colors)
    ax.set_ylabel("tokens / s (end to end)")
    ax.set_title(f"specdec tune: {result.prompts} prompts, winner {result.winner.config.name}")
    ax.tick_params(axis="x", labelrotation=60)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


__all__ = ["LENGTHS", "DROP_BELOW", "PLAIN", "SAMPLED", "Trial", "TuneResult", "candidate_configs", "run_tune",
           "engine_measure", "read_prompts", "default_prompts", "render_table", "plot"]
