"""Benchmark prompts for the scripts in bench/: the loader lives in specdec.spec_bench (shared with `specdec bench`)."""
from specdec.spec_bench import DEFAULT_QUESTIONS, Prompt, categories, load_spec_bench

__all__ = ["DEFAULT_QUESTIONS", "Prompt", "categories", "load_spec_bench"]
