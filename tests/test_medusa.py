"""Medusa heads on a tiny model: training, the exported graph against the training math, lossless drafting."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import specdec  # noqa: E402
from specdec.errors import SpecdecError  # noqa: E402
from specdec.export.bundle import ExportConfig, export_bundle  # noqa: E402
from specdec.export.medusa import MedusaConfig, train_medusa  # noqa: E402
from specdec.runtime.engine import GenerationConfig  # noqa: E402
from specdec.runtime.sampling import SamplingConfig  # noqa: E402

TRAIN = MedusaConfig(n_heads=3, epochs=6, batch_tokens=64, draft_vocab=200)


@pytest.fixture(scope="module")
def trained(tiny_checkpoint, tiny_distill_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("medusa") / "medusa.npz"
    return out, train_medusa(tiny_checkpoint, tiny_distill_data, out, TRAIN)


@pytest.fixture(scope="module")
def bundle(tiny_checkpoint, trained, tmp_path_factory):
    out = tmp_path_factory.mktemp("bundles") / "medusa"
    # fp32 heads: the graph-vs-formula test compares the graph with the training formula exactly
    export_bundle(tiny_checkpoint, out, ExportConfig(drafter="medusa", heads=trained[0], max_len=256, heads_precision="fp32"))
    return out


def test_training_lowers_the_loss(trained):
    path, r = trained
    assert path.is_file() and r["last_loss"] < r["first_loss"]
    assert len(r["held_out_agreement_after"]) == TRAIN.n_heads


def test_heads_graph_computes_the_trained_heads(tiny_checkpoint, trained, bundle):
    """The exported graph's logits equal the training-time formula on the same (fp16-stored) weights."""
    from specdec.export.eagle import target_fingerprint
    from specdec.export.graph import model_config_from_hf, weights_from_torch
    from specdec.export.medusa import load_medusa
    from specdec.export.source import load_source

    src = load_source(tiny_checkpoint)
    cfg, w = model_config_from_hf(src.hf_config), weights_from_torch(src.model)
    heads = load_medusa(trained[0], cfg, target_fingerprint(w))
    eng = specdec.load(bundle, drafter="medusa")
    h = np.random.default_rng(0).normal(size=cfg.hidden_size).astype(np.float32) * 3
    got = eng.drafter.heads.logits(h)  # [K, N]
    u = h / np.sqrt((h ** 2).mean() + cfg.rms_eps) * w.final_norm
    z = np.einsum("d,kde->ke", u, heads.W) + heads.b
    want = (u[None] + z / (1 + np.exp(-z))) @ w.embed[heads.vocab].T
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("drafter,k", [("medusa", 2), ("medusa", 3), ("medusa-tree", 3), ("hybrid", "auto"),
                                      ("hybrid-tree", 3)])
def test_greedy_medusa_output_is_plain_greedy(bundle, drafter, k):
    eng = specdec.load(bundle, drafter=drafter)
    for prompt in ("the quick brown fox", "hello world, this is"):
        plain = eng.generate(prompt, GenerationConfig(max_new_tokens=40, draft_len=0))
        assert eng.generate(prompt, GenerationConfig(max_new_tokens=40, draft_len=k)).token_ids == plain.token_ids


@pytest.mark.parametrize("drafter", ["medusa", "medusa-tree"])
def test_sampled_medusa_runs_repeat_under_a_seed(bundle, drafter):
    from test_eagle import assert_sampled_tree_laws

    eng = specdec.load(bundle, drafter=drafter)
    drafts = []
    real = eng.drafter.propose
    eng.drafter.propose = lambda ctx, k: drafts.append(real(ctx, k)) or drafts[-1]
    cfg = GenerationConfig(max_new_tokens=24, draft_len=3, seed=3, sampling=SamplingConfig(temperature=0.9))
    assert eng.generate("hello world", cfg).token_ids == eng.generate("hello world", cfg).token_ids
    if drafter == "medusa-tree":
        assert any(d.tokens.size > d.k for d in drafts)
        for d in drafts:
            assert_sampled_tree_laws(d)


def test_medusa_export_needs_heads_of_this_target(tiny_checkpoint, trained, tmp_path):
    from conftest import make_checkpoint

    with pytest.raises(SpecdecError, match="ships no Medusa heads") as e:
        export_bundle(tiny_checkpoint, tmp_path / "b", ExportConfig(drafter="medusa", max_len=256))
    assert "train-drafter --kind medusa" in e.value.hint
    other = make_checkpoint(tmp_path / "other", seed=3)
    with pytest.raises(SpecdecError, match="another target"):
        export_bundle(other, tmp_path / "b", ExportConfig(drafter="medusa", heads=trained[0], max_len=256))
    assert not (tmp_path / "b").exists()


def test_cli_trains_and_exports_medusa_heads(tiny_checkpoint, tiny_distill_data, tmp_path):
    from click.testing import CliRunner

    from specdec.cli import main

    heads = tmp_path / "m.npz"
    r = CliRunner().invoke(main, ["train-drafter", str(tiny_checkpoint), "--kind", "medusa", "--data",
                                  str(tiny_distill_data), "-o", str(heads), "--medusa-heads", "2", "--epochs", "1"])
    assert r.exit_code == 0, r.output + (r.stderr or "")
    assert f"--drafter medusa --heads {heads}" in r.stdout
    r = CliRunner().invoke(main, ["export", str(tiny_checkpoint), "-o", str(tmp_path / "b"), "--drafter", "medusa",
                                  "--max-len", "256"])
    assert r.exit_code != 0 and "ships no Medusa heads" in r.stderr and "Traceback" not in r.output


def test_sampled_medusa_tree_is_lossless_through_the_engine(bundle):
    """The target's exact law after a sampled medusa-tree round (tests/test_sampled_lossless.py explains the check)."""
    from sampled_checks import assert_lossless, check_engine
    from specdec.verify_stats import TargetLaw

    sampling = SamplingConfig(temperature=0.6, top_p=0.95)
    law = TargetLaw(specdec.load(bundle, drafter="none").target, sampling)
    eng = specdec.load(bundle, drafter="medusa-tree")
    prompt = eng.encode("the quick brown fox", chat=False)
    cfg = GenerationConfig(max_new_tokens=3, draft_len=2, sampling=sampling, chat=False)
    assert_lossless(*check_engine(eng, law, prompt, cfg, 600))
