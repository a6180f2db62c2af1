"""specdec's ONNX decoder graph against transformers' forward, on tiny random models."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from specdec.export.graph import (CONTROL_INPUTS, build_decoder_graph, kv_input_names, kv_output_names,  # noqa: E402
                                  model_config_from_hf, save_graph, weights_from_torch)
from specdec.runtime.decoder import Decoder  # noqa: E402
from specdec.runtime.kv import KVCache  # noqa: E402
from specdec.runtime.manifest import GraphSpec  # noqa: E402
from specdec.runtime.session import RuntimeOptions  # noqa: E402


def _tiny(model_type="llama", tied=True, seed=0):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = AutoConfig.for_model(model_type, vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                               rope_theta=10000.0, tie_word_embeddings=tied)
    return AutoModelForCausalLM.from_config(cfg).eval()


def _decoder(model, tmp_path, hidden=()):
    cfg = model_config_from_hf(model.config)
    save_graph(build_decoder_graph(cfg, weights_from_torch(model), hidden_layers=hidden), tmp_path / "m.onnx")
    L = cfg.n_layers
    spec = GraphSpec(file="m.onnx", model=cfg, precision="fp32", n_layers=L,
                     inputs=CONTROL_INPUTS + tuple(kv_input_names(L)),
                     outputs=("logits", *kv_output_names(L), *(f"hidden.{t}" for t in hidden)), hidden_layers=hidden)
    kv = KVCache(L, 1, cfg.n_kv_heads, 128, cfg.head_dim)
    return Decoder(tmp_path / "m.onnx", spec, cfg, kv, RuntimeOptions())


@pytest.mark.parametrize("model_type,tied", [("llama", True), ("llama", False), ("qwen2", True), ("mistral", False)])
def test_logits_match_transformers(tmp_path, model_type, tied):
    model = _tiny(model_type, tied)
    dec = _decoder(model, tmp_path)
    ids = np.random.default_rng(1).integers(0, 300, size=(1, 40))
    with torch.no_grad():
        ref = model(torch.tensor(ids)).logits.numpy()  # [1,40,V]
    got = dec.forward(ids[:, :30]).copy()
    dec.kv.advance(30)
    assert np.abs(got - ref[:, :30]).max() < 1e-3
    got = dec.forward(ids[:, 30:40]).copy()  # a T=10 step after a past: verification
    assert np.abs(got - ref[:, 30:40]).max() < 1e-3


def test_multi_token_step_equals_single_steps_and_rollback_is_free(tmp_path):
    model = _tiny()
    dec = _decoder(model, tmp_path)
    ids = np.random.default_rng(2).integers(0, 300, size=(1, 20))
    dec.prefill(ids[:, :10])
    wide = dec.forward(ids[:, 10:15]).copy()  # [1,5,V], written at 10..14 but not kept
    singles = []
    for t in range(10, 15):  # the same five tokens one at a time overwrite the rejected rows
        singles.append(dec.forward(ids[:, t:t + 1])[0, 0].copy())
        dec.kv.advance(1)
    assert np.abs(wide[0] - np.stack(singles)).max() < 1e-4
    # Roll back two tokens, feed different ones: equals a fresh run of that sequence.
    dec.kv.truncate(13)
    alt = np.array([[7, 8]])
    got = dec.forward(alt).copy()
    with torch.no_grad():
        ref = model(torch.tensor(np.concatenate([ids[:, :13], alt], axis=1))).logits.numpy()[:, 13:]
    assert np.abs(got - ref).max() < 1e-3


def test_hidden_taps(tmp_path):
    model = _tiny()
    dec = _decoder(model, tmp_path, hidden=(0, 2, 3))
    ids = np.random.default_rng(3).integers(0, 300, size=(1, 6))
    dec.forward(ids)
    with torch.no_grad():
        out = model(torch.tensor(ids), output_hidden_states=True)
    assert np.abs(dec.hidden(0, 6) - out.hidden_states[0].numpy()).max() < 1e-5
    assert np.abs(dec.hidden(2, 6) - out.hidden_states[2].numpy()).max() < 1e-4
    # transformers' last hidden state is after the final norm; tap 3 is the residual before it.
    h3 = dec.hidden(3, 6)
    normed = h3 / np.sqrt((h3 ** 2).mean(-1, keepdims=True) + model.config.rms_norm_eps) * model.model.norm.weight.detach().numpy()
    assert np.abs(normed - out.hidden_states[3].numpy()).max() < 1e-4
