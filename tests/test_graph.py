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


# ----------------------------------------------------------------------------------------------- fp16 graphs

def _decoder16(model, tmp_path, opts=None):
    cfg = model_config_from_hf(model.config)
    save_graph(build_decoder_graph(cfg, weights_from_torch(model), dtype=np.float16), tmp_path / "m16.onnx")
    L = cfg.n_layers
    spec = GraphSpec(file="m16.onnx", model=cfg, precision="fp16", n_layers=L,
                     inputs=CONTROL_INPUTS + tuple(kv_input_names(L)), outputs=("logits", *kv_output_names(L)))
    kv = KVCache(L, 1, cfg.n_kv_heads, 128, cfg.head_dim, dtype=spec.kv_dtype)
    return Decoder(tmp_path / "m16.onnx", spec, cfg, kv, opts or RuntimeOptions(allow_cpu_fp16=True))


def test_fp16_graph_is_fp16_end_to_end_and_controls_stay_int(tmp_path):
    import onnx

    _decoder16(_tiny(), tmp_path)
    g = onnx.load(str(tmp_path / "m16.onnx")).graph
    F16, F32 = onnx.TensorProto.FLOAT16, onnx.TensorProto.FLOAT
    types = {v.name: v.type.tensor_type.elem_type for v in list(g.input) + list(g.output)}
    assert {types[n] for n in kv_input_names(3) + kv_output_names(3) + ["logits"]} == {F16}
    assert [types[n] for n in CONTROL_INPUTS] == [onnx.TensorProto.INT64] * 2 + [onnx.TensorProto.INT32] * 3
    assert {i.data_type for i in g.initializer} == {F16}  # weights, norms, rotary tables: no fp32 left
    assert F32 not in types.values()


@pytest.mark.parametrize("model_type,tied", [("llama", True), ("mistral", False)])
def test_fp16_logits_match_transformers_within_fp16_rounding(tmp_path, model_type, tied):
    from specdec.export.verify import FP16_RELATIVE_TOLERANCE

    model = _tiny(model_type, tied)
    dec = _decoder16(model, tmp_path)
    ids = np.random.default_rng(1).integers(0, 300, size=(1, 40))
    with torch.no_grad():
        ref = model(torch.tensor(ids)).logits.numpy()  # [1,40,V]
    got = dec.forward(ids[:, :30]).astype(np.float32)
    assert dec.forward(ids[:, :1]).dtype == np.float16
    dec.kv.advance(30)
    got = np.concatenate([got, dec.forward(ids[:, 30:40]).astype(np.float32)], axis=1)
    # Measured 4-5e-3 of the largest logit here (fp16 rounds each op to 2**-11 relative); fp32 is < 1e-4.
    scale = np.abs(ref).max()
    assert np.abs(got - ref).max() < 0.01 * scale < FP16_RELATIVE_TOLERANCE * scale
    # Where transformers' top-1 leads by more than that error, fp16 picks the same token.
    top2 = np.sort(ref, axis=-1)[..., -2:]
    clear = (top2[..., 1] - top2[..., 0]) > 2 * 0.01 * scale
    assert clear.sum() > 20 and (got.argmax(-1) == ref.argmax(-1))[clear].all()


def test_fp16_graph_on_the_cpu_needs_the_override(tmp_path, monkeypatch):
    from specdec.errors import SpecdecError

    model = _tiny()
    with pytest.raises(SpecdecError) as e:
        _decoder16(model, tmp_path, opts=RuntimeOptions())
    assert "fp16 is a GPU precision" in str(e.value) and "--precision fp32|int8|int4" in str(e.value)
    monkeypatch.setenv("SPECDEC_ALLOW_CPU_FP16", "1")
    assert _decoder16(model, tmp_path, opts=RuntimeOptions()).forward(np.array([[1, 2]])).shape == (1, 2, 300)
