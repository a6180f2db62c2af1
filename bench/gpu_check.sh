#!/usr/bin/env bash
# GPU check: one command, at most 8 minutes, nothing fetched from the network.
#
#   bash bench/gpu_check.sh                 # exports the default model, then checks CUDA and TensorRT
#   BUNDLE=bundles/smollm2 bash bench/gpu_check.sh     # reuse a bundle (no export)
#   MODEL=/path/to/model.gguf bash bench/gpu_check.sh  # export another model (MAX_LEN=... if it has < 2048 positions)
#   DRY_RUN_ON_CPU=1 BUNDLE=... bash bench/gpu_check.sh # test this script without a GPU: "cuda" rows run on the CPU
#
# Needs: onnxruntime-gpu in the venv (CUDAExecutionProvider; TensorrtExecutionProvider for the TensorRT rows),
# an NVIDIA GPU, and for the export the default model already in the specdec cache (`specdec export` fetches
# it once with pip; this script never does) or MODEL=... / BUNDLE=....
#
# What it does: exports the default model (SmolLM2-135M-Instruct, int8 self-draft), then on CUDA and on
# TensorRT runs plain greedy decoding and speculative decoding (self-draft, n-gram, corpus: k=4) on a few prompts,
# checks that every speculative output is token-identical to plain greedy on the same provider, and prints
# one table of decode tok/s and tau. Exit 0 only if CUDA ran and every identity check passed.
#
# Precision: the export is fp16 (the GPU precision) when `specdec export --help` lists it, else fp32. An fp16
# T-token step may round one fp16 ulp differently from T single steps, so an identity "NO" on an fp16 target
# can be a tie within fp16 rounding rather than a bug: compare with an fp32 bundle (BUNDLE=...) before digging.
# An fp32 bundle (BUNDLE=<a plain `specdec export`>) also checks the exact-argmax path on the GPU (its greedy
# choices come from an 8-bit head, export/exact_argmax.py; onnxruntime's CUDA MatMulInteger takes int8 activations
# only, so that node is expected to fall back to the CPU): the identity rows must still all say yes.
set -euo pipefail
cd "$(dirname "$0")/.."

LIMIT_S=${LIMIT_S:-480}            # the whole script
PY=${PYTHON:-.venv/bin/python}
if [ -z "${WORK:-}" ]; then  # a scratch folder of our own: removed at the end unless KEEP=1
    WORK=$(mktemp -d /tmp/specdec-gpu-check.XXXXXX)
    [ -n "${KEEP:-}" ] || trap 'rm -rf "$WORK"' EXIT
fi
START=$(date +%s)
left() { local s=$(( LIMIT_S - ($(date +%s) - START) )); echo $(( s > 1 ? s : 1 )); }
say() { echo "[gpu_check $(( $(date +%s) - START ))s] $*" >&2; }
die() { echo "gpu_check: $*" >&2; exit 2; }

[ -x "$PY" ] || command -v "$PY" >/dev/null || die "no python at $PY (set PYTHON=...)"

# ------------------------------------------------------------------ fail fast without CUDA
PROVIDERS=$("$PY" -c "import onnxruntime as o; print(','.join(o.get_available_providers()))" 2>/dev/null) \
    || die "cannot import onnxruntime with $PY"
CUDA_PROVIDER=cuda
if [ -n "${DRY_RUN_ON_CPU:-}" ]; then
    say "DRY RUN: the cuda rows run on the CPU provider; nothing here says anything about a GPU"
    PROVIDERS="CUDAExecutionProvider,$PROVIDERS"
    CUDA_PROVIDER=cpu
fi
case ",$PROVIDERS," in
    *,CUDAExecutionProvider,*) ;;
    *) die "CUDA is not available: this onnxruntime has no CUDAExecutionProvider (providers: $PROVIDERS).
  Install the GPU build on a machine with an NVIDIA GPU:  $PY -m pip uninstall -y onnxruntime && $PY -m pip install onnxruntime-gpu" ;;
esac
if command -v nvidia-smi >/dev/null; then
    GPU=$(timeout 10 nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null | head -1) \
        || die "nvidia-smi failed: no usable NVIDIA GPU/driver"
else
    GPU="(nvidia-smi not found)"
fi
say "GPU: $GPU; onnxruntime providers: $PROVIDERS"

# ------------------------------------------------------------------ export (no network)
if [ -n "${BUNDLE:-}" ]; then
    [ -f "$BUNDLE/specdec.json" ] || die "BUNDLE=$BUNDLE is not a specdec bundle"
    say "using bundle $BUNDLE (no export)"
else
    PRECISION=fp32
    EXPORT_HELP=$("$PY" -m specdec.cli export --help)
    if grep -q fp16 <<<"$EXPORT_HELP"; then
        PRECISION=fp16
    else
        say "NOTE: fp16 export is not implemented yet (specdec export --precision: fp32|int8|int4): exporting fp32"
    fi
    if [ -z "${MODEL:-}" ]; then
        CACHED=$("$PY" -c "from specdec.export.source import DEFAULT_MEMBER, cache_dir; from pathlib import Path; print(cache_dir() / 'models' / Path(DEFAULT_MEMBER).name)")
        [ -f "$CACHED" ] || die "the default model is not in the cache ($CACHED) and this script fetches nothing.
  Run \`specdec export -o bundles/smollm2\` once with network access (or copy the GGUF there), or pass MODEL=... or BUNDLE=..."
        MODEL=$CACHED
    fi
    BUNDLE=$WORK/bundle
    say "exporting $MODEL ($PRECISION target, int8 self-draft) to $BUNDLE"
    timeout "$(left)" "$PY" -m specdec.cli export "$MODEL" -o "$BUNDLE" --drafter self-int8 --precision "$PRECISION" \
        ${MAX_LEN:+--max-len "$MAX_LEN"} --force >&2 || die "export failed or ran out of time"
fi

# ------------------------------------------------------------------ decode on one provider (a child process each)
cat > "$WORK/run_provider.py" <<'PYEOF'
import json, sys, time
from pathlib import Path
import specdec
from specdec import GenerationConfig
from specdec.runtime.session import RuntimeOptions

bundle, provider, out = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
PROMPTS = [
    "What is the capital of France? Answer in one sentence.",
    "Write a short story about a robot who learns to paint.",
    "Repeat this list exactly: apples, pears, plums, cherries, apricots, peaches, grapes, figs.",
]
N = 128
rows = []
result = {"provider": provider, "rows": rows}
t0 = time.perf_counter()
opts = RuntimeOptions(provider=provider, trt_cache_dir=str(bundle / "trt_cache") if provider == "tensorrt" else None)
e = specdec.load(bundle, runtime=opts, drafter="model")  # one engine, drafters switched: one copy of the weights
result["load_s"] = round(time.perf_counter() - t0, 2)
e.use_drafter("none")
e.generate(PROMPTS[0], GenerationConfig(max_new_tokens=16, draft_len=0))  # warm-up (TensorRT builds engines here)
result["warmup_s"] = round(time.perf_counter() - t0, 2)
plain_ids = {}
configs = [("plain", "none", 0), ("model:4", "model", 4), ("ngram:4", "ngram", 4)]
if e.manifest.drafter.corpus is not None:  # the default model's bundles carry the shipped corpus
    configs.append(("corpus:4", "corpus", 4))
for name, drafter, k in configs:
    e.use_drafter(drafter)
    toks = secs = fwd = acc = 0
    same = True
    for p in PROMPTS:
        e.reset()
        g = e.generate(p, GenerationConfig(max_new_tokens=N, draft_len=k))
        s = g.stats
        toks += max(s.new_tokens - 1, 0); secs += s.decode_s; fwd += s.target_forwards; acc += s.accepted
        if name == "plain":
            plain_ids[p] = g.token_ids
        else:
            same &= g.token_ids == plain_ids[p]
    rows.append({"config": name, "tok_s": toks / secs if secs else 0.0, "tau": (acc + fwd) / max(fwd, 1),
                 "identical": same, "tokens": toks})
result["plain_ids"] = plain_ids
out.write_text(json.dumps(result))
PYEOF

run_provider() {  # row label, onnxruntime provider, seconds
    local budget=$3
    [ "$budget" -gt 20 ] || { say "skipping $1: out of time"; echo '{"skipped":"out of time"}' > "$WORK/$1.json"; return 1; }
    say "decoding on $2 (at most ${budget}s)"
    if ! timeout "$budget" "$PY" "$WORK/run_provider.py" "$BUNDLE" "$2" "$WORK/$1.json" >&2; then
        echo '{"skipped":"failed or timed out (see above)"}' > "$WORK/$1.json"
        return 1
    fi
}

CUDA_OK=1
run_provider cuda "$CUDA_PROVIDER" $(( $(left) - 30 )) || CUDA_OK=0
case ",$PROVIDERS," in
    *,TensorrtExecutionProvider,*) run_provider tensorrt tensorrt $(( $(left) - 10 )) || true ;;
    *) echo '{"skipped":"this onnxruntime has no TensorrtExecutionProvider"}' > "$WORK/tensorrt.json" ;;
esac

# ------------------------------------------------------------------ the table
TABLE_RC=0
"$PY" - "$WORK" "$BUNDLE" "$GPU" <<'PYEOF' || TABLE_RC=$?
import json, sys
from pathlib import Path
work, bundle, gpu = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
m = json.loads((Path(bundle) / "specdec.json").read_text())
print(f"GPU: {gpu}   bundle: {bundle} (target {m['graphs']['target']['precision']}, drafter {m['drafter']['kind']})")
print(f"{'row':<10} {'config':<9} {'tok/s':>8} {'tau':>6} {'speed-up':>9}  greedy identical")
bad = False
for prov in ("cuda", "tensorrt"):
    r = json.loads((work / f"{prov}.json").read_text())
    if "skipped" in r:
        print(f"{prov:<10} skipped: {r['skipped']}")
        continue
    base = next(x["tok_s"] for x in r["rows"] if x["config"] == "plain")
    for x in r["rows"]:
        ident = "-" if x["config"] == "plain" else ("yes" if x["identical"] else "NO")
        bad |= ident == "NO"
        print(f"{prov:<10} {x['config']:<9} {x['tok_s']:>8.1f} {x['tau']:>6.2f} {x['tok_s'] / base:>8.2f}x  {ident}")
    print(f"{'':<10} (onnxruntime provider {r['provider']}; load {r['load_s']} s, load + warm-up {r['warmup_s']} s)")
sys.exit(1 if bad else 0)
PYEOF
[ "$CUDA_OK" = 1 ] || die "the CUDA run failed"
[ "$TABLE_RC" = 0 ] || die "speculative output differs from plain greedy on some provider"
say "done in $(( $(date +%s) - START ))s"
