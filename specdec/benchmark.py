"""`specdec bench`: plain vs speculative decoding of one bundle, side by side on Spec-Bench prompts.

Every prompt runs under every configuration back to back, so machine noise hits all of them alike;
speed-ups are ratios of totals measured in this one run. Greedy speculative output must equal plain
greedy output token for token: any prompt where it does not is counted and reported. Sampled runs (temperature
> 0) draw from the same distribution but not the same tokens, so their outputs are not compared.
"""
from __future__ import annotations

import dataclasses
import resource
import sys
import time
from dataclasses import dataclass
from typing import Callable

from specdec.errors import SpecdecError
from specdec.runtime.engine import Engine, GenerationConfig
from specdec.runtime.sampling import SamplingConfig
from specdec.runtime.drafters import DRAFTER_CHOICES
from specdec.spec_bench import Prompt

PLAIN = "plain"
# Run once per config before timing anything, never a benchmark question: the first generations of a config pay
# one-time costs (sessions' first runs allocate; draft_len=auto times the target's step widths, ~40 forwards)
# that would otherwise land in the first prompt's wall time and skew its category.
WARMUP_PROMPT = [{"role": "user", "content": "Write one sentence about the weather."}]
WARMUP_TOKENS = 16


@dataclass(frozen=True)
class BenchConfig:
    """One way of decoding: a drafter kind and a draft length (int or "auto")."""

    drafter: str
    draft_len: int | str

    @property
    def name(self) -> str:
        return PLAIN if self.drafter == "none" else f"{self.drafter}:{self.draft_len}"

    @classmethod
    def parse(cls, text: str) -> "BenchConfig":
        kind, _, k = text.partition(":")
        if kind not in DRAFTER_CHOICES + (PLAIN,):
            raise SpecdecError(f"unknown bench config {text!r}",
                               f"use DRAFTER:K with DRAFTER one of {', '.join(DRAFTER_CHOICES[1:])}, K an integer or auto")
        if kind in ("none", PLAIN):
            return cls("none", 0)
        if k != "auto" and not (k.isdigit() and int(k) > 0):
            raise SpecdecError(f"bad draft length in {text!r}", "use DRAFTER:K with K an integer > 0 or auto")
        return cls(kind, "auto" if k == "auto" else int(k))


def runnable_configs(drafter, configs: list[BenchConfig]) -> tuple[list[BenchConfig], list[str]]:
    """(the configs a bundle whose manifest's drafter is `drafter` can run, the names of those it cannot): each
    drafter needs its own graphs or heads in the bundle, and "corpus" its corpus."""
    kind = drafter.kind
    unusable = {"model": kind != "model", "hybrid": kind not in ("model", "eagle", "medusa"),
                "hybrid-tree": kind not in ("eagle", "medusa"), "eagle": kind != "eagle",
                "eagle-tree": kind != "eagle", "medusa": kind != "medusa", "medusa-tree": kind != "medusa",
                "layerskip": kind != "layerskip", "corpus": drafter.corpus is None}
    return ([c for c in configs if not unusable.get(c.drafter, False)],
            [c.name for c in configs if unusable.get(c.drafter, False)])


def peak_rss_mb() -> float:
    # ru_maxrss is KiB on Linux, bytes on macOS.
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (1 << 20) if sys.platform == "darwin" else rss / 1024


def run_bench(engine: Engine, prompts: list[Prompt], configs: list[BenchConfig], max_new_tokens: int,
              on_step: Callable[[], None] = lambda: None, sampling: SamplingConfig = SamplingConfig(),
              seed: int = 0) -> dict:
    """Every prompt under plain decoding then each config, after one untimed warm-up generation per config.
    Sampled runs use the same seed for every config."""
    configs = [BenchConfig("none", 0)] + [c for c in configs if c.drafter != "none"]
    warmup_ids = engine.encode(WARMUP_PROMPT)
    for cfg in configs:
        engine.use_drafter(cfg.drafter)
        engine.reset()
        gen = GenerationConfig(max_new_tokens=WARMUP_TOKENS, draft_len=cfg.draft_len, sampling=sampling, seed=seed)
        for _ in engine.stream_ids(warmup_ids, gen):
            pass
    runs = []
    for prompt in prompts:
        ids = engine.encode(prompt.messages)
        reference = None
        for cfg in configs:
            engine.use_drafter(cfg.drafter)
            engine.reset()  # no prefix reuse across configs: each pays its own prefill
            t0 = time.perf_counter()
            gen = GenerationConfig(max_new_tokens=max_new_tokens, draft_len=cfg.draft_len, sampling=sampling,
                                   seed=None if sampling.greedy else seed)
            tokens = [t for chunk in engine.stream_ids(ids, gen) for t in chunk]
            wall = time.perf_counter() - t0
            s = engine.last_stats
            reference = tokens if reference is None else reference
            runs.append({"prompt_id": prompt.id, "category": prompt.category, "config": cfg.name,
                         "new_tokens": len(tokens), "wall_s": wall, "ttft_s": s.prefill_s,
                         "forwards": s.target_forwards, "drafted": s.drafted, "accepted": s.accepted,
                         "identical": tokens == reference if sampling.greedy else None})
            on_step()
    return summarize(runs, [c.name for c in configs]) | {"runs": runs, "peak_rss_mb": round(peak_rss_mb(), 1),
                                                          "sampling": dataclasses.asdict(sampling),
                                                          "max_new_tokens": max_new_tokens}


def summarize(runs: list[dict], config_names: list[str]) -> dict:
    """Totals per (config, category) and overall; speed-up = tok/s over plain's tok/s on the same prompts."""
    categories = list(dict.fromkeys(r["category"] for r in runs)) + ["overall"]
    table: dict[str, dict[str, dict]] = {}
    for name in config_names:
        table[name] = {}
        for cat in categories:
            rs = [r for r in runs if r["config"] == name and (cat == "overall" or r["category"] == cat)]
            tokens, wall = sum(r["new_tokens"] for r in rs), sum(r["wall_s"] for r in rs)
            fwd, acc = sum(r["forwards"] for r in rs), sum(r["accepted"] for r in rs)
            table[name][cat] = {"prompts": len(rs), "tokens": tokens, "tok_s": tokens / wall if wall else 0.0,
                                "tau": (acc + fwd) / fwd if fwd else 1.0,
                                "not_identical": sum(r["identical"] is False for r in rs)}
    for name in config_names:
        for cat in categories:
            base = table[PLAIN][cat]["tok_s"]
            table[name][cat]["speedup"] = table[name][cat]["tok_s"] / base if base else 0.0
    return {"configs": config_names, "categories": categories, "table": table}


def render_table(result: dict):
    from rich.table import Table

    sampling = result.get("sampling") or {"temperature": 0.0}
    mode = ("greedy" if not sampling["temperature"] else
            "sampling: " + ", ".join(f"{k} {v}" for k, v in sampling.items()))
    # The budget changes the ratios: later in an answer a model repeats itself more, and lookup drafts catch it.
    budget = f"at most {result['max_new_tokens']} new tokens per question; " if "max_new_tokens" in result else ""
    t = Table(title=f"specdec bench ({mode}; {budget}speed-up vs plain decoding of the same bundle, same run)")
    t.add_column("category")
    for name in result["configs"]:
        t.add_column(f"{name}\ntok/s  tau  x", justify="right")
    for cat in result["categories"]:
        cells = []
        for name in result["configs"]:
            c = result["table"][name][cat]
            cells.append(f"{c['tok_s']:.1f}  {c['tau']:.2f}  {c['speedup']:.2f}x"
                         + (f" ({c['not_identical']} diff)" if c["not_identical"] else ""))
        t.add_row(cat, *cells)
    return t


def plot(result: dict, path: str) -> bool:
    """Speed-up per category as grouped bars; False if matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    cats, names = result["categories"], [n for n in result["configs"] if n != PLAIN]
    fig, ax = plt.subplots(figsize=(max(6, len(cats) * 0.9), 4))
    width = 0.8 / max(len(names), 1)
    for i, name in enumerate(names):
        ax.bar([x + i * width for x in range(len(cats))], [result["table"][name][c]["speedup"] for c in cats],
               width, label=name)
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xticks([x + width * (len(names) - 1) / 2 for x in range(len(cats))], cats, rotation=45, ha="right")
    ax.set_ylabel("speed-up over plain decoding")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True
