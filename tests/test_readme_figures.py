"""The README's comparison table is bench/peers.py's own rendering of the results file it cites, and every
results file the README names exists."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULT = REPO / "bench" / "results" / "peers_native_smollm2_256.json"


def test_readme_comparison_table_is_the_peers_output():
    out = subprocess.run([sys.executable, str(REPO / "bench" / "peers.py"), "--render", str(RESULT), "--markdown"],
                         capture_output=True, text=True, check=True).stdout.strip()
    assert out.count("\n") >= 3, out
    assert out in (REPO / "README.md").read_text(encoding="utf-8")


def test_readme_cites_only_files_that_exist():
    text = (REPO / "README.md").read_text(encoding="utf-8")
    cited = set(re.findall(r"`?((?:bench/results/)?[\w./-]+\.(?:jsonl|json|png))`?", text))
    cited -= {"specdec.json", "tokenizer.json", "config.json", "in.jsonl", "out.jsonl", "prompts.jsonl",
               "answers.jsonl"}  # file names in commands, not figures
    assert cited
    results = REPO / "bench" / "results"
    missing = [c for c in cited
               if not (REPO / c).exists() and not (results / c).exists() and not list(results.rglob(Path(c).name))]
    assert not missing, missing
