"""Distilled draft model (`specdec train-drafter --kind draft-model`) on tiny random models."""
from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from click.testing import CliRunner  # noqa: E402

from specdec.cli import main  # noqa: E402
from specdec.errors import SpecdecError  # noqa: E402
from specdec.export.bundle import ExportConfig, export_bundle  # noqa: E402
from specdec.export.distill import (REPORT_NAME, DistillConfig, build_student, spaced_layers,  # noqa: E402
                                    train_draft_model)
from specdec.export.source import load_source  # noqa: E402
from specdec.runtime.engine import Engine, GenerationConfig  # noqa: E402
from specdec.runtime.manifest import read_manifest  # noqa: E402
from conftest import make_checkpoint  # noqa: E402

# Seconds on two cores (the default lr); batches small enough that an epoch is several steps.
QUICK = dict(n_layers=2, prompts=20, new_tokens=24, epochs=3, batch_tokens=512)
PROMPTS = ["the quick brown fox", "speculative decoding drafts tokens", "hello world, this is"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, tiny_tokenizer):
    return make_checkpoint(tmp_path_factory.mktemp("distill") / "ckpt4", seed=5, n_layers=4, tokenizer=tiny_tokenizer)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, ckpt):
    out = tmp_path_factory.mktemp("distill_out") / "draft"
    steps: list[str] = []
    report = train_draft_model(ckpt, out, DistillConfig(**QUICK), step=steps.append)
    return out, report, steps


@pytest.mark.parametrize("field, value", [
    ("n_layers", 1), ("n_layers", 0), ("n_layers", 2.5), ("intermediate_size", 0), ("prompts", 1),
    ("new_tokens", 0), ("epochs", 0), ("lr", 0.0), ("lr", -1e-3), ("lr", float("nan")), ("lr", float("inf")),
    ("batch_tokens", 0), ("seed", -1), ("max_len", 0),
])
def test_config_rejects_bad_values(field, value):
    with pytest.raises(SpecdecError, match=field):
        DistillConfig(**{field: value})


def test_config_defaults_are_valid_and_match_the_cli():
    cfg = DistillConfig()
    assert (cfg.n_layers, cfg.intermediate_size, cfg.prompts, cfg.new_tokens, cfg.epochs) == (4, None, 400, 128, 2)
    params = {p.name: p.default for p in main.commands["train-drafter"].params}
    assert (params["layers"], params["intermediate_size"], params["prompts"], params["new_tokens"],
            params["epochs"]) == (cfg.n_layers, cfg.intermediate_size, cfg.prompts, cfg.new_tokens, cfg.epochs)


@pytest.mark.parametrize("kwargs, needle", [
    (dict(n_layers=4), "not smaller"),  # the target has 4 layers
    (dict(intermediate_size=129), "wider"),  # make_checkpoint's MLPs are 2 x 64 wide
    (dict(max_len=513), "positions"),  # make_checkpoint's models have 512 positions
])
def test_config_checked_against_the_target_before_training(tmp_path, ckpt, kwargs, needle):
    steps: list[str] = []
    with pytest.raises(SpecdecError, match=needle):
        train_draft_model(ckpt, tmp_path / "out", DistillConfig(**{**QUICK, **kwargs}), step=steps.append)
    assert steps == ["loading target"]  # refused before the target wrote a single answer
    assert list(tmp_path.iterdir()) == []


def test_existing_output_needs_force(tmp_path, ckpt):
    (tmp_path / "out").mkdir()
    with pytest.raises(SpecdecError, match="already exists"):
        train_draft_model(ckpt, tmp_path / "out", DistillConfig(**QUICK))


def test_spaced_layers_include_first_and_last():
    assert spaced_layers(30, 4) == [0, 10, 19, 29]
    assert spaced_layers(4, 2) == [0, 3]
    assert spaced_layers(5, 3) == [0, 2, 4]
    assert spaced_layers(7, 7) == list(range(7))
    for n_target in range(2, 40):
        for n_student in range(2, n_target + 1):
            picked = spaced_layers(n_target, n_student)
            assert picked[0] == 0 and picked[-1] == n_target - 1 and len(set(picked)) == n_student
            assert picked == sorted(picked)


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_student_is_a_copy_of_target_layers_with_the_same_vocabulary(tmp_path, tiny_tokenizer, model_type):
    source = load_source(make_checkpoint(tmp_path / model_type, seed=2, n_layers=5, model_type=model_type,
                                         tokenizer=tiny_tokenizer))
    target = source.model
    student = build_student(target, spaced_layers(5, 3))
    assert type(student) is type(target)
    assert student.config.num_hidden_layers == 3 and len(student.model.layers) == 3
    for key in ("vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size"):
        assert getattr(student.config, key) == getattr(target.config, key), key
    assert torch.equal(student.model.embed_tokens.weight, target.model.embed_tokens.weight)
    assert torch.equal(student.lm_head.weight, target.lm_head.weight)
    assert torch.equal(student.model.norm.weight, target.model.norm.weight)
    t_state = target.state_dict()
    for i, src in enumerate([0, 2, 4]):
        for name, w in student.model.layers[i].state_dict().items():
            assert torch.equal(w, t_state[f"model.layers.{src}.{name}"]), (i, name)
    # Only the layers and the final norm train: the embedding and (tied) head stay the target's.
    assert not student.model.embed_tokens.weight.requires_grad and not student.lm_head.weight.requires_grad
    assert student.model.layers[0].mlp.down_proj.weight.requires_grad and student.model.norm.weight.requires_grad
    # A student of all the target's layers is the target: same logits.
    ids = torch.tensor([source.tokenizer.encode("the quick brown fox jumps")])
    whole = build_student(target, list(range(5)))
    with torch.no_grad():
        torch.testing.assert_close(whole(ids).logits, target(ids).logits)


def test_narrow_student_keeps_the_strongest_mlp_channels(tmp_path, tiny_tokenizer):
    target = load_source(make_checkpoint(tmp_path / "t", seed=4, n_layers=4, tokenizer=tiny_tokenizer)).model
    width = 40  # of the target's 128
    student = build_student(target, [0, 3], intermediate_size=width)
    assert student.config.intermediate_size == width
    mlp, t_mlp = student.model.layers[1].mlp, target.model.layers[3].mlp
    assert mlp.gate_proj.weight.shape == (width, 64) and mlp.down_proj.weight.shape == (64, width)
    score = t_mlp.gate_proj.weight.norm(dim=1) * t_mlp.up_proj.weight.norm(dim=1) * t_mlp.down_proj.weight.norm(dim=0)
    kept = torch.sort(torch.topk(score, width).indices).values
    assert torch.equal(mlp.gate_proj.weight, t_mlp.gate_proj.weight[kept])
    assert torch.equal(mlp.up_proj.weight, t_mlp.up_proj.weight[kept])
    assert torch.equal(mlp.down_proj.weight, t_mlp.down_proj.weight[:, kept])
    # Every kept channel scores at least as high as every dropped one.
    dropped = torch.ones(len(score), dtype=torch.bool)
    dropped[kept] = False
    assert score[kept].min() >= score[dropped].max()


def test_reported_agreement_is_measured_on_the_held_out_answers(trained, ckpt):
    """The report's top-1 agreement before and after training, recomputed here: before, from the student copied
    out of the target; after, from the exported draft graph, on the target's held-out answers (not asserted to
    rise: the tiny model's held-out answers are a few dozen tokens)."""
    from specdec.export.distill import HELD_OUT_FRACTION, build_student, spaced_layers
    from specdec.export.prompts import instruction_prompts, target_answers
    from specdec.export.source import load_source
    from specdec.runtime.engine import Engine

    out, r, _ = trained
    cfg = DistillConfig(**QUICK)
    src = load_source(ckpt)
    torch.manual_seed(cfg.seed)
    copied = build_student(src.model, spaced_layers(r["target_layers"], cfg.n_layers), cfg.intermediate_size)
    answers = target_answers(src.model, src.tokenizer, instruction_prompts(cfg.prompts, seed=cfg.seed), cfg.new_tokens)
    answers = [a for a in answers if len(a[0]) > a[1]]
    held = answers[-max(1, round(HELD_OUT_FRACTION * len(answers))):]
    draft = Engine(out, drafter="none").target
    before = after = n = 0
    for ids, n_prompt in held:
        rows = slice(n_prompt - 1, len(ids) - 1)  # the positions that predict the answer's tokens
        with torch.no_grad():
            want = src.model(torch.from_numpy(ids)[None]).logits[0, rows].argmax(-1).numpy()  # [answer]
            before += int((copied(torch.from_numpy(ids)[None]).logits[0, rows].argmax(-1).numpy() == want).sum())
        draft.kv.reset()
        draft.prefill(ids[None, :n_prompt - 1])
        after += int((draft.forward(ids[None, rows])[0].argmax(-1) == want).sum())
        n += len(want)
    assert n == r["held_out_tokens"]
    assert r["held_out_agreement_before"] == pytest.approx(before / n, abs=1e-4)
    assert r["held_out_agreement_after"] == pytest.approx(after / n, abs=1.5 / n)  # fp32 graph vs torch: a tie may flip


def test_training_lowers_the_kl_to_the_target(trained):
    _, r, steps = trained
    assert r["epoch_kl"][0] == r["first_epoch_kl"] and len(r["epoch_kl"]) == QUICK["epochs"]
    assert r["last_epoch_kl"] < 0.9 * r["first_epoch_kl"], r
    assert r["held_out_kl_after"] < r["held_out_kl_before"], r  # on answers to prompts it was not trained on
    assert r["layers_from_target"] == [0, 3] and r["target_layers"] == 4 and r["n_layers"] == 2
    assert 0 < r["held_out_tokens"] < r["answer_tokens"] and r["train_tokens"] + r["held_out_tokens"] == r["answer_tokens"]
    assert r["student_params"] < r["target_params"]
    assert any("training epoch 3/3" in s for s in steps) and any(s.startswith("exporting the draft model") for s in steps)


def test_draft_bundle_is_a_valid_bundle_with_its_report(trained, ckpt):
    out, r, _ = trained
    m = read_manifest(out)  # checksums included, the report's too
    assert REPORT_NAME in m.files and json.loads((out / REPORT_NAME).read_text()) == r
    assert m.graphs["target"].n_layers == 2 and m.drafter.kind == "none"
    target = load_source(ckpt)
    assert m.model.vocab_size == target.hf_config.vocab_size and m.model.hidden_size == target.hf_config.hidden_size
    assert m.source == str(ckpt)
    assert not list(out.parent.glob(".draft.student-*")) and not out.with_name("draft.staging").exists()


def test_greedy_speculation_with_the_student_equals_plain_greedy(tmp_path, trained, ckpt):
    out, _, _ = trained
    bundle = tmp_path / "target"
    # The export checks the draft bundle's vocabulary against the target's (refused if it differs).
    export_bundle(ckpt, bundle, ExportConfig(drafter=f"model:{out}", max_len=256))
    engine = Engine(bundle)
    assert engine.drafter_kind == "model"
    drafted = 0
    for prompt in PROMPTS:
        engine.reset()
        plain = engine.generate(prompt, GenerationConfig(max_new_tokens=32, draft_len=0))
        engine.reset()
        spec = engine.generate(prompt, GenerationConfig(max_new_tokens=32, draft_len=3))
        assert spec.token_ids == plain.token_ids, prompt
        drafted += spec.stats.drafted
    assert drafted > 0  # the student really drafted


def test_cli_train_drafter_end_to_end(tmp_path, ckpt):
    out = tmp_path / "cli_draft"
    args = ["train-drafter", str(ckpt), "-o", str(out), "--kind", "draft-model", "--layers", "2", "--prompts", "6",
            "--new-tokens", "12", "--epochs", "1"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output + (result.stderr or "")
    assert f"wrote {out}" in result.stdout and "held-out top-1 agreement" in result.stdout
    assert f"--drafter model:{out}" in result.stdout
    report = json.loads((out / REPORT_NAME).read_text())
    assert (report["n_layers"], report["prompts"], report["new_tokens"], report["epochs"]) == (2, 6, 12, 1)
    assert read_manifest(out).graphs["target"].n_layers == 2
    # Again without --force: one error line, the bundle untouched.
    again = CliRunner().invoke(main, args)
    assert again.exit_code != 0 and "already exists" in again.stderr and "Traceback" not in again.output
    # Bad values are one error line too.
    bad = CliRunner().invoke(main, args[:-2] + ["--epochs", "0", "--force"])
    assert bad.exit_code != 0 and "epochs must be an integer >= 1" in bad.stderr
    wrong_kind = CliRunner().invoke(main, [*args[:5], "self-int8"])
    assert wrong_kind.exit_code != 0 and "draft-model" in wrong_kind.stderr
