"""The two exact ways to a greedy step's choices (greedy_path.py): the same tokens either way, and the faster one
kept per step shape."""
from __future__ import annotations

import numpy as np
import pytest

import specdec
from specdec.runtime.engine import GenerationConfig
from specdec.runtime.greedy_path import GRAPH, LOGITS, REVISIT_EVERY, TRIALS, GreedyPaths, OnePath
from specdec.runtime.manifest import read_manifest



def _run(paths: GreedyPaths, shape, ms: dict[str, float], n: int) -> list[str]:
    """n steps of `shape`, each path taking ms[path]; the paths picked."""
    picked = []
    for _ in range(n):
        path = paths.pick(shape)
        paths.record(shape, path, ms[path] / 1000)
        picked.append(path)
    return picked


def test_each_path_is_tried_then_the_faster_kept_and_the_other_revisited():
    paths = GreedyPaths()
    picked = _run(paths, (1, 4), {GRAPH: 44.0, LOGITS: 41.0}, 2 * TRIALS + 2 * REVISIT_EVERY)
    assert picked[:2 * TRIALS] == [GRAPH, LOGITS] * TRIALS  # alternately, so both meet the same moment
    assert paths.best((1, 4)) == LOGITS
    assert paths.fastest_seconds()[(1, 4)] == {GRAPH: 0.044, LOGITS: 0.041}
    after = picked[2 * TRIALS:]
    assert after.count(GRAPH) == 2 and after.count(LOGITS) == 2 * REVISIT_EVERY - 2  # one revisit per period
    assert paths.best((1, 1)) is None  # shapes are chosen apart
    assert _run(paths, (1, 1), {GRAPH: 25.0, LOGITS: 28.0}, 2 * TRIALS + 5)[-5:] == [GRAPH] * 5


def test_a_choice_made_in_a_busy_moment_is_undone_by_later_timings():
    paths = GreedyPaths()
    _run(paths, (1, 3), {GRAPH: 30.0, LOGITS: 90.0}, 2 * TRIALS)  # the logits' trials met a busy machine
    assert paths.best((1, 3)) == GRAPH
    _run(paths, (1, 3), {GRAPH: 40.0, LOGITS: 34.0}, TRIALS * REVISIT_EVERY)  # quiet: revisits retime the logits
    assert paths.best((1, 3)) == LOGITS


def test_hiccups_do_not_decide():
    paths = GreedyPaths()
    for i in range(TRIALS):  # the graph's path met the machine busy every time but once
        paths.record((1, 2), GRAPH, (40.0 if i == 1 else 90.0) / 1000)
        paths.record((1, 2), LOGITS, 45.0 / 1000)
    assert paths.best((1, 2)) == GRAPH
    with pytest.raises(ValueError, match="unknown greedy path"):
        paths.record((1, 2), "host", 0.1)
    with pytest.raises(ValueError, match="unknown greedy path"):
        OnePath("host")


def test_both_paths_give_the_same_choices_chains_and_ragged_batches(tiny_bundle):
    from specdec.runtime.batched import BatchedEngine

    assert read_manifest(tiny_bundle).graphs["target"].has_argmax_rows
    target = specdec.load(tiny_bundle, drafter="none").target
    vocab = target.model.vocab_size
    target.prefill(np.random.default_rng(0).integers(0, vocab, size=(1, 10)))
    start = int(target.kv.lengths[0])
    for T in (1, 2, 3, 5, 9):
        tokens = np.random.default_rng(T).integers(0, vocab, size=(1, T))
        got = {}
        for path in (GRAPH, LOGITS):
            target.greedy_paths = OnePath(path)
            got[path] = target.forward_choices(tokens).copy()
        np.testing.assert_array_equal(got[GRAPH], got[LOGITS])
    assert int(target.kv.lengths[0]) == start  # steps never advance the cache themselves

    dec = BatchedEngine(tiny_bundle, 3, drafter="none").target.decoder
    tokens = np.random.default_rng(5).integers(0, vocab, size=(3, 4))
    q = np.array([4, 0, 2])  # a full row, an idle one, a ragged one
    got = {}
    for path in (GRAPH, LOGITS):
        dec.greedy_paths = OnePath(path)
        got[path] = dec.forward_choices(tokens, query_lens=q).copy()
    for row, n in enumerate(q):
        np.testing.assert_array_equal(got[GRAPH][row, :n], got[LOGITS][row, :n])


def test_speculation_stays_plain_greedy_whichever_path_each_width_takes(tiny_bundle):
    """Plain decoding on the graph's path, verification steps from the logits (as on an AVX2 CPU), and the
    other way round: the same tokens."""
    eng = specdec.load(tiny_bundle, drafter="ngram")

    class ByWidth(GreedyPaths):
        def __init__(self, wide: str) -> None:
            super().__init__()
            self.wide = wide

        def pick(self, shape):
            return self.wide if shape[1] > 1 else ({GRAPH: LOGITS, LOGITS: GRAPH}[self.wide])

    prompts = ("the the the the quick brown the the quick", "hello world hello world hello")
    plain = [eng.generate(p, GenerationConfig(max_new_tokens=40, draft_len=0)).token_ids for p in prompts]
    for wide in (GRAPH, LOGITS):
        eng.target.greedy_paths = ByWidth(wide)
        assert [eng.generate(p, GenerationConfig(max_new_tokens=40, draft_len=4)).token_ids for p in prompts] == plain


def test_a_graph_without_the_exact_path_has_one_way(tiny_bundle, tmp_path):
    from specdec.quant.bundle import quantize_bundle

    out = quantize_bundle(tiny_bundle, tmp_path / "int8", "int8")  # its head is int8: no exact-argmax path
    target = specdec.load(out, drafter="none").target
    assert target.greedy_paths is None
    target.prefill(np.arange(1, 9, dtype=np.int64)[None])
    step = np.array([[5, 9, 2]], dtype=np.int64)
    np.testing.assert_array_equal(target.forward_choices(step).copy(), target.forward(step).argmax(-1))
