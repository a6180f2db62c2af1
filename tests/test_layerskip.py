"""LayerSkip self-speculation on tiny random models: split = full target, shared-KV drafting is lossless."""
from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from specdec.errors import SpecdecError  # noqa: E402
from specdec.export.bundle import ExportConfig, export_bundle  # noqa: E402
from specdec.export.layerskip import LayerSkipConfig, best_draft_len  # noqa: E402
from specdec.runtime.engine import Engine, GenerationConfig  # noqa: E402
from specdec.runtime.sampling import SamplingConfig  # noqa: E402
from conftest import make_checkpoint  # noqa: E402

QUICK = dict(prompts=12, new_tokens=24, epochs=2, draft_vocab=200)
PROMPTS = ["the quick brown fox", "speculative decoding drafts tokens", "hello world, this is"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, tiny_tokenizer):
    return make_checkpoint(tmp_path_factory.mktemp("ls") / "ckpt4", seed=3, n_layers=4, tokenizer=tiny_tokenizer)


@pytest.fixture(scope="module")
def bundles(tmp_path_factory, ckpt):
    root = tmp_path_factory.mktemp("lsb")
    export_bundle(ckpt, root / "ls", ExportConfig(drafter="layerskip", max_len=256,
                                                  layerskip=LayerSkipConfig(exit_layer=2, **QUICK)))
    export_bundle(ckpt, root / "auto", ExportConfig(drafter="layerskip", max_len=256,
                                                    layerskip=LayerSkipConfig(adapter=False, **QUICK)))
    export_bundle(ckpt, root / "plain", ExportConfig(drafter="none", max_len=256))
    return root


def test_split_graphs_share_the_target_weights(bundles):
    ls = bundles / "ls"
    m = json.loads((ls / "specdec.json").read_text())
    assert m["drafter"]["kind"] == "layerskip" and m["drafter"]["exit_layer"] == 2
    assert m["graphs"]["tail"]["checks"]["max_abs_logit_diff_vs_target_graph"] <= 1e-4
    # exit.onnx and tail.onnx point into target.onnx.data: no weight file of their own.
    assert not (ls / "exit.onnx.data").exists() and not (ls / "tail.onnx.data").exists()
    target_data = (ls / "target.onnx.data").stat().st_size
    assert (ls / "exit.onnx").stat().st_size + (ls / "tail.onnx").stat().st_size < 0.05 * target_data
    curve = m["drafter"]["calibration"]["curve"]
    assert [c["exit_layer"] for c in curve] == [1, 2, 3]


def test_calibration_agreement_is_the_exits_top1_on_held_out_answers(bundles, ckpt, tiny_tokenizer):
    """Each exit's calibration agreement, recomputed here with transformers: the exit's residual stream through
    the final norm and the tied head over the draft vocabulary, against the target's own next token, on the
    held-out fifth of the calibration answers' positions."""
    from transformers import AutoModelForCausalLM

    from specdec.export.prompts import instruction_prompts, target_answers

    m = json.loads((bundles / "ls" / "specdec.json").read_text())
    cfg = LayerSkipConfig(exit_layer=2, **QUICK)
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    answers = target_answers(model, tiny_tokenizer, instruction_prompts(cfg.prompts, seed=cfg.seed), cfg.new_tokens)
    vocab = np.load(bundles / "ls" / m["drafter"]["draft_vocab"])  # [N] target ids
    head = model.get_input_embeddings().weight[torch.from_numpy(vocab)]  # [N, D] the tied head's rows
    g_final, eps = model.model.norm.weight, model.config.rms_norm_eps
    states: dict[int, list] = {E: [] for E in (1, 2, 3)}
    nexts = []
    with torch.no_grad():
        for ids, n_prompt in answers:
            if len(ids) <= n_prompt:
                continue
            out = model(torch.from_numpy(ids)[None], output_hidden_states=True)
            rows = slice(n_prompt - 1, len(ids) - 1)  # positions whose next token is an answer token
            nexts.append(out.logits[0, rows].argmax(-1))
            for E in states:
                states[E].append(out.hidden_states[E][0, rows].half().float())  # stored as fp16 by the calibration
    nxt = torch.cat(nexts)  # [n]
    held = slice(int(len(nxt) * 0.8), len(nxt))
    for c in m["drafter"]["calibration"]["curve"]:
        h = torch.cat(states[c["exit_layer"]])[held]  # [m, D]
        pred = vocab[((h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * g_final) @ head.T).argmax(-1)]
        agreement = float((torch.from_numpy(pred) == nxt[held]).float().mean())
        assert c["agreement"] == pytest.approx(agreement, abs=1.5 / len(pred)), c


def test_auto_exit_layer_is_the_best_predicted(bundles):
    m = json.loads((bundles / "auto" / "specdec.json").read_text())
    curve = m["drafter"]["calibration"]["curve"]
    chosen = next(c for c in curve if c["exit_layer"] == m["drafter"]["exit_layer"])
    assert chosen["predicted_speedup"] == max(c["predicted_speedup"] for c in curve)
    if chosen["predicted_speedup"] <= 1.0:  # nothing pays: the closest with one draft, most accepted among those
        def one(c):
            return (1 + c["agreement"]) / (1 + c["draft_cost"])
        close = [c for c in curve if one(c) >= max(map(one, curve)) - 0.01]
        assert chosen["agreement"] == max(c["agreement"] for c in close)
    assert m["drafter"]["calibration"]["exit_layer_chosen_by"] == "calibration"


def test_shared_kv_verification_equals_a_full_forward(bundles):
    """Drafting writes layers < E; verification reuses them: the logits are the full target's."""
    from specdec.runtime.drafters.layerskip import LayerSkipDrafter

    e, full = Engine(bundles / "ls", drafter="layerskip"), Engine(bundles / "plain", drafter="none")
    ids = np.random.default_rng(0).integers(4, 300, size=(1, 30))
    e.target.prefill(ids)
    full.target.prefill(ids)
    drafter: LayerSkipDrafter = e.drafter
    drafter.begin(ids[0].tolist(), SamplingConfig(), np.random.default_rng(0))
    context = ids[0].tolist() + [7]  # the last emitted token, not yet in the cache
    e.target.kv.truncate(29)
    full.target.kv.truncate(29)
    draft = drafter.propose(context[:-1] + [int(ids[0, -1])], 4)
    assert int(e.target.kv.lengths[0]) == 29  # drafting leaves the valid length where it was
    step = np.asarray([[int(ids[0, -1]), *draft.tokens]], dtype=np.int64)
    got = e.target.forward(step).copy()
    want = full.target.forward(step)
    assert np.abs(got - want).max() < 1e-4


@pytest.mark.parametrize("draft_len", [1, 3, 6, "auto"])
def test_greedy_layerskip_equals_plain_greedy(bundles, draft_len):
    ls, plain = Engine(bundles / "ls", drafter="layerskip"), Engine(bundles / "plain", drafter="none")
    for prompt in PROMPTS:
        want = plain.generate(prompt, GenerationConfig(max_new_tokens=40, draft_len=0)).token_ids
        got = ls.generate(prompt, GenerationConfig(max_new_tokens=40, draft_len=draft_len))
        assert got.token_ids == want
        assert ls.last_stats.drafted > 0
    # Plain decoding of the layerskip bundle (exit + tail, no drafts) is the same text too.
    ls.use_drafter("none")
    assert ls.generate(PROMPTS[0], GenerationConfig(max_new_tokens=40)).token_ids == \
        plain.generate(PROMPTS[0], GenerationConfig(max_new_tokens=40, draft_len=0)).token_ids


def test_layerskip_sampling_is_seeded_and_valid(bundles):
    e = Engine(bundles / "ls", drafter="layerskip")
    cfg = GenerationConfig(max_new_tokens=30, sampling=SamplingConfig(temperature=0.8, top_p=0.9), seed=5, draft_len=3)
    a, b = e.generate(PROMPTS[1], cfg), e.generate(PROMPTS[1], cfg)
    assert a.token_ids == b.token_ids and len(a.token_ids) > 0


def test_bad_layerskip_requests(ckpt, tmp_path, tiny_bundle):
    with pytest.raises(SpecdecError, match="out of range"):
        export_bundle(ckpt, tmp_path / "x", ExportConfig(drafter="layerskip", max_len=256,
                                                         layerskip=LayerSkipConfig(exit_layer=4, **QUICK)))
    assert not (tmp_path / "x").exists() and not (tmp_path / "x.partial").exists()
    with pytest.raises(SpecdecError, match="exit-layer must be >= 1"):
        LayerSkipConfig(exit_layer=0)
    with pytest.raises(SpecdecError, match="no LayerSkip exit"):
        Engine(tiny_bundle, drafter="layerskip")


def test_quantizing_a_layerskip_bundle_quantizes_its_split_alike(bundles, tmp_path):
    """The exit and tail slices are quantized as the target is and point into the new target's weight file
    (tests/test_drafter_precisions.py checks sharing and lossless drafting at every precision)."""
    from specdec.quant.bundle import quantize_bundle

    q = quantize_bundle(bundles / "ls", tmp_path / "q", "int4")
    m = json.loads((q / "specdec.json").read_text())
    assert {m["graphs"][g]["precision"] for g in ("target", "exit", "tail")} == {"int4"}
    # The split's logits against the quantized target graph's own, run here (not the figure the quantizer wrote).
    split = Engine(q, drafter="none")
    whole = split._decoder("target")
    ids = np.random.default_rng(1).integers(4, 300, size=(1, 30))
    got = split.target.prefill(ids).copy()  # [1, vocab]
    want = whole.prefill(ids)  # [1, vocab]
    assert np.abs(got - want).max() < 1e-2


def test_adapter_learns_a_transform_of_the_residual_stream():
    from specdec.export.layerskip import _rms, _train_adapter

    torch.manual_seed(0)
    D, N = 32, 50
    h = torch.randn(2048, D)
    rot = torch.linalg.qr(torch.randn(D, D))[0]
    final = _rms(h @ rot, 1e-5)  # the target's last state: a rotation of the exit's
    head = torch.randn(N, D)
    g = torch.ones(D)
    module = _train_adapter(h, final, head, g, 1e-5, LayerSkipConfig(adapter_rank=16, epochs=30))

    def agree(x):
        return float(((_rms(x, 1e-5) @ head.T).argmax(-1) == (final @ head.T).argmax(-1)).float().mean())

    with torch.no_grad():
        assert agree(module(h)) > agree(h) + 0.2


def test_best_draft_len_arithmetic():
    assert best_draft_len(0.0, 0.5) == (0, 1.0)  # nothing accepted: do not draft
    k, s = best_draft_len(0.9, 0.05)  # cheap and good: draft long
    assert k >= 5 and s > 2.0


def test_sampled_layerskip_is_lossless_through_the_engine(bundles):
    """The exit's sampled drafts verified by the tail keep the full target's exact law (the check is the one of
    tests/test_sampled_lossless.py; the law is read from the plain bundle of the same checkpoint)."""
    from sampled_checks import assert_lossless, check_engine
    from specdec.verify_stats import TargetLaw

    sampling = SamplingConfig(temperature=0.7)
    law = TargetLaw(Engine(bundles / "plain", drafter="none").target, sampling)
    e = Engine(bundles / "ls", drafter="layerskip")
    prompt = e.encode(PROMPTS[0], chat=False)
    assert_lossless(*check_engine(e, law, prompt, GenerationConfig(max_new_tokens=3, draft_len=2, sampling=sampling,
                                                                     chat=False), 600))
