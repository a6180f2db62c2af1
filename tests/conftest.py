"""Tiny random-weight models built inside the tests: seconds, not minutes."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import settings

# Hypothesis: under CI the same examples every run (a red build is reproducible, never a lucky draw); locally
# fresh examples each run, to keep finding new ones. Per-test @settings override only what they name.
settings.register_profile("ci", derandomize=True, print_blob=True)
settings.register_profile("dev")
settings.load_profile("ci" if os.environ.get("CI") else "dev")

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "speculative decoding drafts tokens and the target verifies them",
    "a small model proposes and a large model decides",
    "hello world, this is a tiny tokenizer for tests",
] * 20


def make_tokenizer(vocab_size: int = 320):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "<|im_end|>", "<|im_start|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="<|im_end|>", unk_token="<unk>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def make_checkpoint(folder: Path, seed: int = 0, n_layers: int = 2, hidden: int = 64, heads: int = 4,
                    kv_heads: int = 2, model_type: str = "llama", tokenizer=None, tied: bool = True) -> Path:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    tokenizer = tokenizer or make_tokenizer()
    torch.manual_seed(seed)
    cfg = AutoConfig.for_model(model_type, vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
                               num_hidden_layers=n_layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                               max_position_embeddings=512, rope_theta=10000.0, tie_word_embeddings=tied,
                               bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():  # random init is near-uniform; sharpen it so greedy text has structure
        for p in model.parameters():
            p.mul_(3.0)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def break_streamed_graphs(monkeypatch) -> None:
    """Make the streaming writer (export/gguf_export.py) perturb one weight of each graph after writing it, before
    the export's check reads it: the check must refuse."""
    import onnx

    from specdec.export import gguf_export

    write = gguf_export.write_gguf_graph

    def write_then_break(src, path, precision, progress=None, **graph):
        spec = write(src, path, precision, progress, **graph)
        g = onnx.load_model(str(path), load_external_data=False)
        norm = next(t for t in g.graph.initializer if t.name == "layers.1.post_norm")
        arr = onnx.numpy_helper.to_array(norm, base_dir=str(path.parent)).copy()
        arr[:8] *= 1.5
        norm.CopyFrom(onnx.numpy_helper.from_array(arr, norm.name))
        with open(path, "wb") as f:
            f.write(g.SerializeToString())
        return spec

    monkeypatch.setattr(gguf_export, "write_gguf_graph", write_then_break)


@pytest.fixture(scope="session", autouse=True)
def no_user_step_costs(tmp_path_factory):
    """Engines made by session- and module-scoped fixtures (before any test's own file is set) keep their step
    costs in the session's temporary folder, never in the user's cache."""
    import os

    from specdec.runtime.step_costs import STEP_COSTS_ENV

    before = os.environ.get(STEP_COSTS_ENV)
    os.environ[STEP_COSTS_ENV] = str(tmp_path_factory.mktemp("step_costs") / "step_costs.json")
    yield
    if before is None:
        os.environ.pop(STEP_COSTS_ENV, None)
    else:
        os.environ[STEP_COSTS_ENV] = before


@pytest.fixture(autouse=True)
def own_step_costs(tmp_path, monkeypatch):
    """Each test keeps `--draft-len auto`'s measured step costs in its own file, never the user's cache (and a
    test never starts from costs an earlier test measured)."""
    from specdec.runtime.step_costs import STEP_COSTS_ENV

    monkeypatch.setenv(STEP_COSTS_ENV, str(tmp_path / "step_costs.json"))


@pytest.fixture(scope="session")
def tiny_tokenizer():
    return make_tokenizer()


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory, tiny_tokenizer) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", tokenizer=tiny_tokenizer)


@pytest.fixture(scope="session")
def tiny_bundle(tmp_path_factory, tiny_checkpoint) -> Path:
    from specdec.export.bundle import ExportConfig, export_bundle

    out = tmp_path_factory.mktemp("bundles") / "tiny"
    export_bundle(tiny_checkpoint, out, ExportConfig(drafter="self-int8", max_len=256))
    return out


@pytest.fixture(scope="session")
def tiny_distill_data(tiny_checkpoint, tmp_path_factory) -> Path:
    """`specdec distill-data` output of the tiny model: what EAGLE and Medusa heads train on."""
    from specdec.export.distill_data import DistillDataConfig, plan_prompts, write_distill_data
    from specdec.export.source import load_source

    src = load_source(tiny_checkpoint)
    cfg = DistillDataConfig(n_prompts=24, new_tokens=24, batch=8, seed=0)
    out = tmp_path_factory.mktemp("distill") / "data"
    write_distill_data(src.model, src.tokenizer, out, cfg, plan_prompts(cfg, [], set()), "tiny")
    return out

