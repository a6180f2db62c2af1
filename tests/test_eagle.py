"""EAGLE heads on a tiny model: training, train/inference parity of the unrolled chain, lossless drafting, refusals."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import specdec  # noqa: E402
from specdec.errors import SpecdecError  # noqa: E402
from specdec.export import eagle as eagle_mod  # noqa: E402
from specdec.export.bundle import ExportConfig, export_bundle  # noqa: E402
from specdec.export.eagle import EagleConfig, load_heads, module_from_heads, target_fingerprint, train_eagle, unrolled  # noqa: E402
from specdec.runtime.engine import GenerationConfig  # noqa: E402
from specdec.runtime.sampling import SamplingConfig  # noqa: E402

TRAIN = EagleConfig(epochs=4, batch_tokens=512, unroll=3, draft_vocab=200)


@pytest.fixture(scope="module")
def data(tiny_distill_data):
    return tiny_distill_data


@pytest.fixture(scope="module")
def trained(tiny_checkpoint, data, tmp_path_factory):
    out = tmp_path_factory.mktemp("heads") / "heads.npz"
    report = train_eagle(tiny_checkpoint, data, out, TRAIN)
    return out, report


@pytest.fixture(scope="module")
def eagle_bundle(tiny_checkpoint, trained, tmp_path_factory):
    out = tmp_path_factory.mktemp("bundles") / "eagle"
    # fp32 heads: the parity test compares the graph with the torch head exactly
    export_bundle(tiny_checkpoint, out, ExportConfig(drafter="eagle", heads=trained[0], max_len=256, heads_precision="fp32"))
    return out


def test_training_lowers_the_loss_and_reports_held_out_agreement(trained):
    path, r = trained
    assert path.is_file() and not path.with_name(path.name + ".ckpt").exists()
    assert r["last_loss"] < r["first_loss"]
    assert len(r["held_out_after"]["agreement_by_step"]) == TRAIN.unroll
    assert r["draft_vocab"] <= TRAIN.draft_vocab and 0 < r["vocab_coverage"] <= 1


def test_unrolled_training_chain_matches_the_onnx_head_drafting(tiny_checkpoint, eagle_bundle, trained):
    """Step j of the training unroll at position s is exactly what drafting computes for the j-th draft of a
    chain that started at s-j+1 (real features before it, the head's own predictions after)."""
    from specdec.export.graph import model_config_from_hf, weights_from_torch
    from specdec.export.source import load_source

    src = load_source(tiny_checkpoint)
    cfg, w = model_config_from_hf(src.hf_config), weights_from_torch(src.model)
    heads = load_heads(trained[0], cfg, target_fingerprint(w))
    head, _ = module_from_heads(cfg, w, heads)

    eng = specdec.load(eagle_bundle, drafter="eagle")
    target, drafter = eng.target, eng.drafter
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, size=40)
    target.kv.reset()
    target.prefill(tokens[None])
    feats = target.kept_tap(cfg.n_layers, 0, 40).copy()  # [40, D]
    with torch.no_grad():
        outs = unrolled(head, torch.from_numpy(feats)[None], torch.from_numpy(np.roll(tokens, -1))[None], 3)

    p = 20  # the chain starts at position p: real features up to p
    hk = drafter.head.kv
    hk.reset()
    drafter.head.forward(tokens[None, 1:p + 2], features=feats[None, :p + 1])
    feature = drafter.head.hidden(1, p + 1)[0, -1].copy()
    hk.advance(p + 1)
    np.testing.assert_allclose(feature, outs[0][0, p].numpy(), atol=2e-4, rtol=1e-4)
    for j in (2, 3):  # step j at position p+j-1 feeds the true token there and the previous step's feature
        s = p + j - 1
        drafter.head.forward(tokens[None, s + 1:s + 2], features=feature[None, None])
        feature = drafter.head.hidden(1, 1)[0, -1].copy()
        hk.advance(1)
        np.testing.assert_allclose(feature, outs[j - 1][0, s].numpy(), atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("drafter,k", [("eagle", 1), ("eagle", 3), ("eagle", "auto"), ("hybrid", 4)])
def test_greedy_eagle_output_is_plain_greedy(eagle_bundle, drafter, k):
    eng = specdec.load(eagle_bundle, drafter=drafter)
    for prompt in ("the quick brown fox", "hello world, this is", "a small model proposes"):
        plain = eng.generate(prompt, GenerationConfig(max_new_tokens=48, draft_len=0))
        spec = eng.generate(prompt, GenerationConfig(max_new_tokens=48, draft_len=k))
        assert spec.token_ids == plain.token_ids
        # each accepted draft is a token that needed no pass of its own (no round drafts past the budget)
        assert spec.stats.target_forwards == plain.stats.target_forwards - spec.stats.accepted


def test_eagle_reuses_a_shared_prefix_and_stays_exact(eagle_bundle):
    """A chat's second turn starts with the first: the head keeps its entries for the shared prefix."""
    eng = specdec.load(eagle_bundle, drafter="eagle")
    plain = specdec.load(eagle_bundle, drafter="none")
    first = [{"role": "user", "content": "the quick brown fox"}]
    a = eng.generate(first, GenerationConfig(max_new_tokens=20, draft_len=3))
    second = first + [{"role": "assistant", "content": a.text}, {"role": "user", "content": "hello world"}]
    assert eng.generate(second, GenerationConfig(max_new_tokens=30, draft_len=3)).token_ids == \
        plain.generate(second, GenerationConfig(max_new_tokens=30)).token_ids


def test_sampled_eagle_runs_repeat_under_a_seed(eagle_bundle):
    eng = specdec.load(eagle_bundle, drafter="eagle")
    cfg = GenerationConfig(max_new_tokens=32, draft_len=3, seed=7, sampling=SamplingConfig(temperature=0.8))
    assert eng.generate("the quick brown", cfg).token_ids == eng.generate("the quick brown", cfg).token_ids


def test_heads_of_another_target_are_refused(tmp_path, trained):
    from conftest import make_checkpoint

    other = make_checkpoint(tmp_path / "other", seed=1)
    with pytest.raises(SpecdecError, match="another target"):
        export_bundle(other, tmp_path / "b", ExportConfig(drafter="eagle", heads=trained[0], max_len=256))
    assert not (tmp_path / "b").exists()


def test_no_shipped_head_for_a_new_target_says_how_to_train_one(tiny_checkpoint, tmp_path):
    with pytest.raises(SpecdecError, match="ships no EAGLE head") as e:
        export_bundle(tiny_checkpoint, tmp_path / "b", ExportConfig(drafter="eagle", max_len=256))
    assert "train-drafter --kind eagle" in e.value.hint


def test_missing_or_corrupt_data_is_one_clear_error(tiny_checkpoint, data, tmp_path):
    with pytest.raises(SpecdecError, match="no distillation data"):
        train_eagle(tiny_checkpoint, tmp_path / "nothing", tmp_path / "h.npz", TRAIN)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "distill.json").write_text((data / "distill.json").read_text())
    (bad / "shard-00000.npz").write_bytes(b"not a zip")
    with pytest.raises(SpecdecError, match="unreadable"):
        train_eagle(tiny_checkpoint, bad, tmp_path / "h.npz", TRAIN)


def test_a_killed_training_resumes_from_its_checkpoint(tiny_checkpoint, data, tmp_path, monkeypatch):
    monkeypatch.setattr(eagle_mod, "CHECKPOINT_EVERY_S", 0.0)
    cfg = EagleConfig(epochs=2, batch_tokens=512, unroll=2, draft_vocab=200)
    out = tmp_path / "h.npz"

    class Killed(Exception):
        pass

    def kill(done, total, loss):
        if done == 5:
            raise Killed

    with pytest.raises(Killed):
        train_eagle(tiny_checkpoint, data, out, cfg, progress=kill)
    assert out.with_name(out.name + ".ckpt").is_file() and not out.exists()
    seen = []
    report = train_eagle(tiny_checkpoint, data, out, cfg, step=seen.append, progress=lambda d, t, l: seen.append(d))
    assert any("resuming training at step 4" in str(s) for s in seen)  # the checkpoint after step 4 survived
    assert 5 in seen and 4 not in seen[seen.index(5):]
    assert out.is_file() and report["steps"] > 5


def test_bad_training_settings_are_refused():
    with pytest.raises(SpecdecError, match="unroll"):
        EagleConfig(unroll=0)
    with pytest.raises(SpecdecError, match="lr"):
        EagleConfig(lr=float("nan"))


def test_cli_trains_exports_and_generates_with_an_eagle_head(tiny_checkpoint, data, tmp_path):
    from click.testing import CliRunner

    from specdec.cli import main

    heads, bundle = tmp_path / "h.npz", tmp_path / "b"
    r = CliRunner().invoke(main, ["train-drafter", str(tiny_checkpoint), "--kind", "eagle", "--data", str(data),
                                  "-o", str(heads), "--epochs", "1", "--unroll", "2"])
    assert r.exit_code == 0, r.output + (r.stderr or "")
    assert f"--drafter eagle --heads {heads}" in r.stdout and "held-out agreement by draft step" in r.stdout
    r = CliRunner().invoke(main, ["export", str(tiny_checkpoint), "-o", str(bundle), "--drafter", "eagle",
                                  "--heads", str(heads), "--max-len", "256"])
    assert r.exit_code == 0, r.output + (r.stderr or "")
    r = CliRunner().invoke(main, ["generate", str(bundle), "the quick brown fox", "--max-new-tokens", "16"])
    assert r.exit_code == 0 and "tau" in r.output, r.output + (r.stderr or "")
    # Quantizing rewrites the head's graph against the new target's weight file.
    q = CliRunner().invoke(main, ["quantize", str(bundle), "--to", "int4", "-o", str(tmp_path / "q")])
    assert q.exit_code == 0, q.output + (q.stderr or "")
    r = CliRunner().invoke(main, ["generate", str(tmp_path / "q"), "the quick brown fox", "--max-new-tokens", "16"])
    assert r.exit_code == 0 and "tau" in r.output, r.output + (r.stderr or "")
    no_data = CliRunner().invoke(main, ["train-drafter", str(tiny_checkpoint), "--kind", "eagle", "-o", str(heads)])
    assert no_data.exit_code != 0 and "--data" in no_data.stderr


# ---- token-tree verification on the eagle bundle's (tree-capable) target


def _target(eagle_bundle):
    eng = specdec.load(eagle_bundle, drafter="none")
    assert eng.target.spec.has_tree_bias
    return eng.target


def test_tree_step_logits_equal_each_branch_decoded_on_its_own(eagle_bundle):
    """Brute force: every node's logits from the one tree step equal those of a plain causal forward over the
    past + that node's branch."""
    from specdec.runtime.acceptance import tree_attention_bias, tree_depths

    target = _target(eagle_bundle)
    rng = np.random.default_rng(1)
    past = rng.integers(0, 300, size=17)
    root, nodes = 11, rng.integers(0, 300, size=6)
    parents = np.array([-1, -1, 0, 0, 1, 2])
    target.kv.reset()
    target.prefill(past[None])
    step = np.concatenate([[root], nodes])[None]
    positions = len(past) + np.concatenate([[0], tree_depths(parents)])[None]
    tree_logits = target.forward(step, positions, bias=tree_attention_bias(parents, len(past)))[0].copy()
    for i in range(-1, len(nodes)):
        branch, j = [], i
        while j >= 0:
            branch.insert(0, int(nodes[j]))
            j = parents[j]
        plain = target.forward(np.asarray([[root, *branch]]))[0, -1]  # the cache still holds only the past
        np.testing.assert_allclose(tree_logits[i + 1], plain, atol=1e-4, rtol=1e-4)


def test_compacting_the_accepted_path_leaves_the_cache_of_a_plain_decode(eagle_bundle):
    from specdec.runtime.drafters.base import Draft
    from specdec.runtime.sampling import SamplingConfig
    from specdec.runtime.speculative import verify_tree

    target = _target(eagle_bundle)
    target.keep_tap(target.model.n_layers)
    rng = np.random.default_rng(2)
    past, root = rng.integers(0, 300, size=9), 7
    target.kv.reset()
    target.prefill(past[None])
    greedy = [root]  # the target's own next three tokens after root (forwards without advancing the cache)
    for _ in range(3):
        greedy.append(int(target.forward(np.asarray([greedy]))[0, -1].argmax()))
    # Path root -> node 1 -> node 3 -> node 4 holds them; nodes 0 and 2 are decoys on other branches.
    nodes = np.array([(greedy[1] + 1) % 300, greedy[1], (greedy[2] + 1) % 300, greedy[2], greedy[3]])
    parents = np.array([-1, -1, 1, 1, 3])
    draft = Draft(tokens=nodes, parents=parents)
    accepted, _ = verify_tree(target, np.concatenate([[root], nodes])[None], draft, SamplingConfig(), rng)
    assert accepted == [1, 3, 4]
    n = len(past) + 1 + len(accepted)
    target.kv.advance(1 + len(accepted))
    tree_kv = target.kv.slab[:, :, 0, :, :n].copy()
    tree_tap = target.kept_tap(target.model.n_layers, 0, n).copy()
    target.kv.reset()  # the same tokens decoded as a chain
    target.prefill(np.concatenate([past, greedy])[None])
    np.testing.assert_allclose(tree_kv, target.kv.slab[:, :, 0, :, :n], atol=1e-5)
    np.testing.assert_allclose(tree_tap, target.kept_tap(target.model.n_layers, 0, n), atol=1e-4)


@pytest.mark.parametrize("k", [2, 4, "auto"])
def test_greedy_eagle_tree_output_is_plain_greedy(eagle_bundle, k):
    eng = specdec.load(eagle_bundle, drafter="eagle-tree")
    for prompt in ("the quick brown fox", "hello world, this is", "a small model proposes"):
        plain = eng.generate(prompt, GenerationConfig(max_new_tokens=48, draft_len=0))
        spec = eng.generate(prompt, GenerationConfig(max_new_tokens=48, draft_len=k))
        assert spec.token_ids == plain.token_ids


def test_tree_steps_give_the_same_choices_on_both_greedy_paths(eagle_bundle):
    """A tree step's choices from the graph's exact-argmax path and from full logits (greedy_path.py) agree."""
    from specdec.runtime.acceptance import tree_attention_bias, tree_depths
    from specdec.runtime.greedy_path import OnePath

    target = specdec.load(eagle_bundle, drafter="eagle-tree").target
    assert target.greedy_paths is not None
    vocab = target.model.vocab_size
    target.prefill(np.random.default_rng(0).integers(0, vocab, size=(1, 10)))
    start = int(target.kv.lengths[0])
    for parents in (np.array([-1, 0, 0, 1, -1]), np.array([-1, -1, -1, 0, 1, 2, 3])):
        step = np.random.default_rng(len(parents)).integers(0, vocab, size=(1, len(parents) + 1))
        positions = start + np.concatenate([[0], tree_depths(parents)])[None, :]
        got = []
        for path in ("graph", "logits"):
            target.greedy_paths = OnePath(path)
            got.append(target.forward_choices(step, positions, bias=tree_attention_bias(parents, start)).copy())
        np.testing.assert_array_equal(*got)


def assert_sampled_tree_laws(draft) -> None:
    """Each node's law gives its token mass, sums to 1, and excludes its earlier siblings' tokens (siblings are
    drawn without replacement): what tree_speculative_accept needs to stay lossless."""
    assert draft.parents is not None and draft.p_draft is not None
    np.testing.assert_allclose(draft.p_draft.sum(axis=1), 1.0, rtol=1e-5)
    for i, (token, parent) in enumerate(zip(draft.tokens, draft.parents)):
        assert draft.p_draft[i, token] > 0
        earlier = draft.tokens[:i][draft.parents[:i] == parent]
        assert (draft.p_draft[i, earlier] == 0).all()


def test_tree_drafts_are_trees_greedy_and_sampled(eagle_bundle):
    eng = specdec.load(eagle_bundle, drafter="eagle-tree")
    drafts = []
    real = eng.drafter.propose
    eng.drafter.propose = lambda ctx, k: drafts.append(real(ctx, k)) or drafts[-1]
    eng.generate("the quick brown fox", GenerationConfig(max_new_tokens=24, draft_len=3))
    assert drafts and all(d.parents is not None and d.p_draft is None for d in drafts if d.tokens.size)
    assert any(d.tokens.size > d.k for d in drafts)  # leaves beside the chain
    drafts.clear()
    sampled = GenerationConfig(max_new_tokens=24, draft_len=3, seed=1, sampling=SamplingConfig(temperature=0.9))
    first = eng.generate("the quick brown fox", sampled)
    assert any(d.tokens.size > d.k for d in drafts)
    for d in drafts:
        assert_sampled_tree_laws(d)
    assert eng.generate("the quick brown fox", sampled).token_ids == first.token_ids  # seeded runs repeat


def test_int8_heads_graph_drafts_losslessly(tiny_checkpoint, trained, tmp_path):
    out = tmp_path / "eagle-int8"
    export_bundle(tiny_checkpoint, out, ExportConfig(drafter="eagle", heads=trained[0], max_len=256, heads_precision="int8"))
    eng = specdec.load(out, drafter="eagle-tree")
    assert eng.manifest.graphs["eagle"].precision == "int8"
    plain = eng.generate("the quick brown fox", GenerationConfig(max_new_tokens=40, draft_len=0))
    assert eng.generate("the quick brown fox", GenerationConfig(max_new_tokens=40, draft_len=3)).token_ids == plain.token_ids


def test_training_continues_from_a_heads_file(tiny_checkpoint, data, trained, tmp_path):
    out = tmp_path / "more.npz"
    report = train_eagle(tiny_checkpoint, data, out, EagleConfig(epochs=1, batch_tokens=512, unroll=3, draft_vocab=200),
                         init=trained[0])
    assert report["continued_from"]["steps"] == trained[1]["steps"]
    with np.load(out) as a, np.load(trained[0]) as b:
        assert (a["vocab"] == b["vocab"]).all()  # the head keeps the draft vocabulary it was trained with
    # It starts where the first training ended, not from scratch.
    assert report["first_loss"] < trained[1]["first_loss"]


# ---- hybrid-tree: the lookup's chain and the head's tree as branches of one tree

REPEATING = ("the quick brown fox jumps over the lazy dog, the quick brown fox jumps over",
             "one two three four, one two three four, one two three")


def _spy(eng):
    drafts = []
    real = eng.drafter.propose
    eng.drafter.propose = lambda ctx, k: drafts.append(real(ctx, k)) or drafts[-1]
    return drafts


@pytest.mark.parametrize("k", [2, 4, "auto"])
def test_greedy_hybrid_tree_output_is_plain_greedy(eagle_bundle, k):
    eng = specdec.load(eagle_bundle, drafter="hybrid-tree")
    drafts = _spy(eng)
    for prompt in REPEATING + ("hello world, this is",):
        plain = eng.generate(prompt, GenerationConfig(max_new_tokens=40, draft_len=0))
        assert eng.generate(prompt, GenerationConfig(max_new_tokens=40, draft_len=k)).token_ids == plain.token_ids
    both = [d for d in drafts if d.parents is not None and (d.parents == -1).sum() > 1]
    assert both  # rounds where lookup and head branched side by side


def test_sampled_hybrid_tree_repeats_under_a_seed_and_keeps_each_nodes_law(eagle_bundle):
    eng = specdec.load(eagle_bundle, drafter="hybrid-tree")
    drafts = _spy(eng)
    cfg = GenerationConfig(max_new_tokens=32, draft_len=3, seed=4, sampling=SamplingConfig(temperature=0.8))
    first = eng.generate(REPEATING[0], cfg)
    assert eng.generate(REPEATING[0], cfg).token_ids == first.token_ids
    for d in drafts:
        if d.p_draft is None:  # a lookup-only chain (no head branch drafted): deterministic
            continue
        np.testing.assert_allclose(d.p_draft.sum(axis=1), 1.0, rtol=1e-5)
        assert (d.p_draft[np.arange(d.tokens.size), d.tokens] > 0).all()


def test_hybrid_tree_needs_heads(tiny_bundle):
    with pytest.raises(SpecdecError, match="no EAGLE or Medusa heads"):
        specdec.load(tiny_bundle, drafter="hybrid-tree")


def test_merged_drafts_share_prefixes_when_greedy_and_keep_laws_when_sampling():
    from specdec.runtime.drafters.base import Draft
    from specdec.runtime.drafters.hybrid import merge_drafts

    lookup = Draft(tokens=np.array([5, 6, 7]))  # a chain
    head = Draft(tokens=np.array([5, 9, 6, 8]), parents=np.array([-1, -1, 0, 2]))  # 5 -> 6 -> 8, and 9
    merged = merge_drafts(lookup, head, max_nodes=16, merge_equal=True)
    assert merged.tokens.tolist() == [5, 6, 7, 9, 8] and merged.parents.tolist() == [-1, 0, 1, -1, 1]
    assert merged.p_draft is None and merged.k == 3
    # A cap drops nodes past it, and the children of dropped nodes with them.
    capped = merge_drafts(lookup, head, max_nodes=4, merge_equal=True)
    assert capped.tokens.tolist() == [5, 6, 7, 9] and capped.parents.tolist() == [-1, 0, 1, -1]
    rows = np.full((4, 10), 0.1, dtype=np.float32)
    sampled = merge_drafts(lookup, Draft(tokens=head.tokens, parents=head.parents, p_draft=rows), 16, merge_equal=False)
    assert sampled.tokens.tolist() == [5, 6, 7, 5, 9, 6, 8]  # no sharing: every node keeps its own row
    assert sampled.parents.tolist() == [-1, 0, 1, -1, -1, 3, 5]
    np.testing.assert_array_equal(sampled.p_draft[:3], np.eye(10, dtype=np.float32)[[5, 6, 7]])  # one-hot lookups
    np.testing.assert_array_equal(sampled.p_draft[3:], rows)


class _ScoredLookup:
    """A lookup drafter that proposes given chains with given confidences and records what it is told."""

    def __init__(self, drafts):
        self.drafts, self.told = list(drafts), []

    def begin(self, prompt_ids, sampling, rng):
        pass

    def source(self, context):
        return "lookup"

    def propose(self, context, k):
        from specdec.runtime.drafters.base import Draft

        tokens, confidence = self.drafts[0]
        return Draft(tokens=np.array(tokens[:k]), confidence=np.array(confidence[:k]))

    def accept(self, n_accepted, next_token):
        self.told.append((n_accepted, next_token))
        self.drafts.pop(0)


class _FixedModel(_ScoredLookup):
    def propose(self, context, k):
        from specdec.runtime.drafters.base import Draft

        return Draft(tokens=np.array(self.drafts.pop(0)[0][:k]))

    def accept(self, n_accepted, next_token):
        self.told.append((n_accepted, next_token))


def test_hybrid_trusts_a_scored_lookup_up_to_its_first_unsure_token_and_learns_from_what_was_emitted():
    from specdec.runtime.drafters.base import MIN_CONFIDENCE
    from specdec.runtime.drafters.hybrid import HybridDrafter

    sure, unsure = 0.9, MIN_CONFIDENCE / 2
    lookup = _ScoredLookup([([5, 6, 7], [sure, sure, unsure]), ([8], [unsure]), ([1], [sure])])
    model = _FixedModel([([5, 9], None), ([4, 4], None), ([2], None)])
    hybrid = HybridDrafter(lookup, model, room=lambda: 16)
    hybrid.begin([1, 2], SamplingConfig(), np.random.default_rng(0))
    context = [1, 2, 3]
    assert hybrid.source(context) == "both"
    tree = hybrid.propose(context, 3)
    # The lookup's 7 is unsure: its trusted part [5, 6] and the model's [5, 9] share the 5.
    assert tree.tokens.tolist() == [5, 6, 9] and tree.parents.tolist() == [-1, 0, 0]
    hybrid.accept(2, 4)  # the target kept the model's branch 5 -> 9, then wrote 4
    assert lookup.told == [] and model.told == []  # a tree round's lookup learns from the next context
    context += [5, 9, 4]
    # The lookup kept 1 token of its chain, and the target wrote 9 where it had 6 (the lookup's next draft, 8, is
    # unsure: the model drafts alone).
    assert hybrid.source(context) == "model" and lookup.told == [(1, 9)]
    chain = hybrid.propose(context, 2)
    assert chain.parents is None and chain.tokens.tolist() == [4, 4]
    hybrid.accept(1, 7)
    assert model.told == [(1, 7)]  # the model drafted: it is told at once
    context += [4, 7]
    hybrid.propose(context, 1)
    # The unsure 8 was never verified, yet the target's token there (4) says it was wrong.
    assert lookup.told == [(1, 9), (0, 4)]


@pytest.fixture(scope="module")
def eagle_corpus_bundle(eagle_bundle, tiny_distill_data, tmp_path_factory):
    import shutil

    from click.testing import CliRunner

    from specdec.cli import main

    bundle = tmp_path_factory.mktemp("bundles") / "eagle-corpus"
    shutil.copytree(eagle_bundle, bundle)
    r = CliRunner().invoke(main, ["corpus", str(bundle), "--data", str(tiny_distill_data)])
    assert r.exit_code == 0, r.output
    return bundle


@pytest.mark.parametrize("kind", ["hybrid", "hybrid-tree"])
def test_hybrids_of_a_bundle_with_a_corpus_draft_from_it_and_stay_plain_greedy(eagle_corpus_bundle, kind):
    from specdec.runtime.drafters.corpus import CorpusDrafter

    eng = specdec.load(eagle_corpus_bundle, drafter=kind)
    assert isinstance(eng.drafter.lookup, CorpusDrafter)
    drafts = _spy(eng)
    for prompt in REPEATING + ("hello world, this is",):
        plain = eng.generate(prompt, GenerationConfig(max_new_tokens=40, draft_len=0))
        for k in (3, "auto"):
            assert eng.generate(prompt, GenerationConfig(max_new_tokens=40, draft_len=k)).token_ids == plain.token_ids
    from specdec.runtime.drafters.base import PRIOR_TRIALS

    # The lookup side was told how its drafts fared.
    assert any(r.scores > PRIOR_TRIALS for r in eng.drafter.lookup.reliability.values())
    if kind == "hybrid-tree":
        assert [d for d in drafts if d.parents is not None and (d.parents == -1).sum() > 1]


def test_long_prompts_lose_their_beginning_not_the_answer():
    # 700 prompt tokens + 100 answer tokens in a 512 window: the answer stays whole, the prompt keeps its end.
    assert eagle_mod._window(1000, 1800, 700, 512) == (1288, 1800, 412)
    # Short sequences are untouched; an answer longer than the window keeps one prompt token and loses its end.
    assert eagle_mod._window(0, 300, 50, 512) == (0, 300, 50)
    assert eagle_mod._window(0, 900, 50, 512) == (49, 561, 1)


def test_several_data_folders_train_together(tiny_distill_data, tmp_path):
    one = eagle_mod.load_sequences(tiny_distill_data, 64, 10_000_000, 512)
    two = eagle_mod.load_sequences([tiny_distill_data, tiny_distill_data], 64, 10_000_000, 512)
    assert len(two) == 2 * len(one)
    assert eagle_mod._data_digest([tiny_distill_data]) == eagle_mod._data_digest(tiny_distill_data)
    assert eagle_mod._data_digest([tiny_distill_data, tiny_distill_data]) != eagle_mod._data_digest(tiny_distill_data)


def test_greedy_drafts_are_judged_by_the_targets_tokens_whether_verified_or_not():
    """Hand-computed: the chain [5, 6, 7] with a leaf beside each of its first two tokens, judged by what the
    target emitted after the draft point."""
    from specdec.runtime.drafters.eagle import judged_nodes

    chain, scores, leaves = [5, 6, 7], [0.9, 0.5, 0.4], [(8, 0, 0.05), (9, 1, 0.3)]
    assert judged_nodes(chain, scores, leaves, [5, 9]) == [
        ("chain", True, 0.9), ("leaf", False, 0.05), ("chain", False, 0.5), ("leaf", True, 0.3)]
    assert judged_nodes(chain, scores, leaves, [5, 6, 7, 1]) == [
        ("chain", True, 0.9), ("leaf", False, 0.05), ("chain", True, 0.5), ("leaf", False, 0.3), ("chain", True, 0.4)]
    assert judged_nodes(chain, scores, leaves, [4]) == [("chain", False, 0.9), ("leaf", False, 0.05)]
    assert judged_nodes(chain, scores, leaves, []) == []


def test_eagle_confidences_are_calibrated_on_what_the_target_keeps(eagle_bundle):
    """Greedy EAGLE learns how its scores translate (chain nodes and leaves apart) across rounds and sequences, and
    its drafts carry the calibrated confidences: score times rate, at most 1."""
    from specdec.runtime.drafters.base import PRIOR_TRIALS

    eng = specdec.load(eagle_bundle, drafter="eagle-tree")
    eng.generate("the quick brown fox", GenerationConfig(max_new_tokens=24, draft_len=4))
    drafter = eng.drafter
    chain, leaf = drafter.calibration["chain"], drafter.calibration["leaf"]
    assert chain.scores > PRIOR_TRIALS and leaf.scores > PRIOR_TRIALS
    assert chain.rate == pytest.approx(chain.hits / chain.scores)
    seen = []
    propose = drafter.propose

    def watched(context, k):
        draft = propose(context, k)
        if draft.k:  # node 0 is the chain's first token; the rates are those the draft was scored with
            seen.append((draft.confidence[0], drafter._pending[1][0] * chain.rate))
        return draft

    drafter.propose = watched
    eng.generate("speculative decoding drafts", GenerationConfig(max_new_tokens=24, draft_len=4))
    assert seen
    for confidence, calibrated in seen:
        assert confidence == pytest.approx(min(calibrated, 1.0))



# ---- sampled trees through the engine: the target's exact law (tests/test_sampled_lossless.py explains the check)

TREE_ANSWERS = 600


@pytest.mark.parametrize("drafter, sampling", [
    ("eagle-tree", SamplingConfig(temperature=0.5)),
    ("eagle-tree", SamplingConfig(temperature=0.8, top_k=8)),
    ("hybrid-tree", SamplingConfig(temperature=0.5, top_p=0.9)),
])
def test_sampled_trees_are_lossless_through_the_engine(eagle_bundle, drafter, sampling):
    from sampled_checks import assert_lossless, check_engine
    from specdec.verify_stats import TargetLaw

    law = TargetLaw(specdec.load(eagle_bundle, drafter="none").target, sampling)
    eng = specdec.load(eagle_bundle, drafter=drafter)
    drafts = _spy(eng)
    prompt = eng.encode(REPEATING[0], chat=False)
    cfg = GenerationConfig(max_new_tokens=3, draft_len=2, sampling=sampling, chat=False)
    assert_lossless(*check_engine(eng, law, prompt, cfg, TREE_ANSWERS))
    assert any(d.parents is not None and (d.parents == -1).sum() > 1 for d in drafts)  # siblings were verified


def test_a_tree_verifier_accepting_its_first_branch_whole_fails_the_check(eagle_bundle, monkeypatch):
    from sampled_checks import MUTANT_P, check_engine, first_branch_whole
    from specdec.runtime import speculative
    from specdec.verify_stats import TargetLaw

    sampling = SamplingConfig(temperature=0.5)
    law = TargetLaw(specdec.load(eagle_bundle, drafter="none").target, sampling)
    eng = specdec.load(eagle_bundle, drafter="eagle-tree")
    monkeypatch.setattr(speculative, "tree_speculative_accept", first_branch_whole)
    cfg = GenerationConfig(max_new_tokens=3, draft_len=2, sampling=sampling, chat=False)
    check, _ = check_engine(eng, law, eng.encode(REPEATING[0], chat=False), cfg, TREE_ANSWERS)
    assert check.pvalue < MUTANT_P, str(check)
