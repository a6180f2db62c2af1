"""`specdec distill-data` on a tiny model: shards, resume after a kill, refusals, benchmark prompts kept out."""
from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from specdec.errors import SpecdecError  # noqa: E402
from specdec.export.distill_data import (DistillDataConfig, batched_pre_norm_states, load_prompt_file,  # noqa: E402
                                        plan_prompts, pre_norm_states, shard_path, write_distill_data)

CFG = DistillDataConfig(n_prompts=7, new_tokens=6, batch=3, seed=1)


@pytest.fixture(scope="module")
def target(tiny_checkpoint):
    from specdec.export.source import load_source

    return load_source(tiny_checkpoint)


def _read(out):
    return [dict(np.load(p)) for p in sorted(out.glob("shard-*.npz"))]


def test_shards_hold_tokens_and_pre_norm_states(target, tmp_path):
    prompts = plan_prompts(CFG, [], set())
    r = write_distill_data(target.model, target.tokenizer, tmp_path, CFG, prompts, "tiny")
    assert r["shards"] == 3 and r["prompts"] == 7
    shards = _read(tmp_path)
    assert [len(s["prompt_len"]) for s in shards] == [3, 3, 1]
    s = shards[0]
    assert s["starts"][-1] == len(s["tokens"]) == len(s["hidden"])
    ids = s["tokens"][s["starts"][0]:s["starts"][1]].astype(np.int64)
    assert s["prompt_len"][0] < len(ids)  # an answer follows the prompt
    np.testing.assert_allclose(s["hidden"][:len(ids)].astype(np.float32), pre_norm_states(target.model, ids),
                               rtol=2e-3, atol=2e-3)
    # The final norm + head applied to the stored state predict the greedy answer's next tokens.
    logits = target.model.lm_head(target.model.model.norm(torch.from_numpy(pre_norm_states(target.model, ids))))
    p = int(s["prompt_len"][0])
    assert (logits.argmax(-1).numpy()[p - 1:-1] == ids[p:]).all()


def test_a_killed_run_resumes_without_loss_or_duplicates(target, tmp_path):
    prompts = plan_prompts(CFG, [], set())
    full = tmp_path / "full"
    write_distill_data(target.model, target.tokenizer, full, CFG, prompts, "tiny")

    class Killed(Exception):
        pass

    def kill_after_first(done, total, tokens):
        if done >= CFG.batch:
            raise Killed

    part = tmp_path / "part"
    with pytest.raises(Killed):
        write_distill_data(target.model, target.tokenizer, part, CFG, prompts, "tiny", progress=kill_after_first)
    (part / "shard-00001.tmp.npz").write_bytes(b"half a shard")  # a write cut short
    first = shard_path(part, 0).read_bytes()
    r = write_distill_data(target.model, target.tokenizer, part, CFG, prompts, "tiny")
    assert shard_path(part, 0).read_bytes() == first  # kept, not redone
    assert not list(part.glob("*.tmp.npz"))
    assert r["shards"] == 3
    for a, b in zip(_read(full), _read(part)):
        assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def test_other_settings_are_refused_unless_forced(target, tmp_path):
    prompts = plan_prompts(CFG, [], set())
    write_distill_data(target.model, target.tokenizer, tmp_path, CFG, prompts, "tiny")
    other = DistillDataConfig(n_prompts=7, new_tokens=5, batch=3, seed=1)
    with pytest.raises(SpecdecError, match="another target, prompts or settings"):
        write_distill_data(target.model, target.tokenizer, tmp_path, other, prompts, "tiny")
    write_distill_data(target.model, target.tokenizer, tmp_path, other, prompts, "tiny", force=True)
    assert json.loads((tmp_path / "distill.json").read_text())["config"]["new_tokens"] == 5


def test_benchmark_prompts_are_kept_out_and_bad_files_named(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "What is 2+2?"}\n{"messages": [{"role": "user", "content": "Say hi."}]}\n')
    extra = load_prompt_file(f)
    prompts = plan_prompts(CFG, extra, {"What is 2+2?"})
    assert [{"role": "user", "content": "Say hi."}] == prompts[0] and len(prompts) == 1 + CFG.n_prompts
    f.write_text('{"prompt": "ok"}\nnot json\n')
    with pytest.raises(SpecdecError, match="line 2 is not valid JSON"):
        load_prompt_file(f)
    with pytest.raises(SpecdecError, match="must be >= 1"):
        DistillDataConfig(batch=0)
    f.write_text('{"prompt": "ok"}\n{"messages": [{"role": "assistant", "content": "no question"}]}\n')
    with pytest.raises(SpecdecError, match="line 2 has neither"):
        load_prompt_file(f)
    f.write_text('{"messages": [{"role": "user", "content": "x"}, {"role": "robot", "content": "y"}]}\n')
    with pytest.raises(SpecdecError, match="line 1 has neither"):
        load_prompt_file(f)
    with pytest.raises(SpecdecError, match="no prompts to answer"):
        plan_prompts(DistillDataConfig(n_prompts=0), [], set())


def test_batched_states_equal_one_sequence_at_a_time(target):
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, 300, size=n) for n in (3, 17, 9, 17, 1, 30)]
    batched = batched_pre_norm_states(target.model, seqs, batch_tokens=40)  # several batches, padded rows
    for ids, states in zip(seqs, batched):
        assert states.shape == (len(ids), target.model.config.hidden_size)
        with torch.no_grad():
            out = target.model(torch.from_numpy(ids)[None], output_hidden_states=True)
            # transformers' last hidden state is after the final norm: apply it to ours to compare
            normed = target.model.model.norm(torch.from_numpy(states)).numpy()
        np.testing.assert_allclose(normed, out.hidden_states[-1][0].numpy(), rtol=1e-4, atol=1e-4)


def test_answered_conversations_are_recorded_as_given(target, tmp_path):
    """A prompts file may hold the target's earlier answers: they are teacher-forced, not regenerated, laid out as
    a generation would have written them, and kept in order beside prompts that are still answered."""
    tok = target.tokenizer
    asked = [{"role": "user", "content": "hello world"}]
    answered = [{"role": "user", "content": "tiny tokenizer"}, {"role": "assistant", "content": "this is a test"}]
    f = tmp_path / "conv.jsonl"
    f.write_text("\n".join(json.dumps({"messages": c}) for c in (answered, asked, answered)) + "\n")
    cfg = DistillDataConfig(n_prompts=0, new_tokens=5, batch=3)
    plan = plan_prompts(cfg, load_prompt_file(f), set())
    r = write_distill_data(target.model, target.tokenizer, tmp_path / "d", cfg, plan, "tiny")
    assert r["shards"] == 1 and r["prompts"] == 3
    s = _read(tmp_path / "d")[0]
    seqs = [s["tokens"][a:b].astype(np.int64) for a, b in zip(s["starts"][:-1], s["starts"][1:])]
    prompt = tok.apply_chat_template(answered[:1], tokenize=False, add_generation_prompt=True)
    p = tok(prompt, add_special_tokens=False)["input_ids"]
    expected = p + tok("this is a test", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert seqs[0].tolist() == seqs[2].tolist() == expected and s["prompt_len"][0] == len(p)
    # The unanswered prompt is generated exactly as in a run without the answered ones.
    alone = DistillDataConfig(n_prompts=0, new_tokens=5, batch=1)
    write_distill_data(target.model, target.tokenizer, tmp_path / "alone", alone, [asked], "tiny")
    assert seqs[1].tolist() == _read(tmp_path / "alone")[0]["tokens"].tolist()
    np.testing.assert_allclose(s["hidden"][:len(expected)].astype(np.float32), pre_norm_states(target.model, seqs[0]),
                               rtol=2e-3, atol=2e-3)


def test_cli_runs_and_resumes(tiny_checkpoint, tmp_path):
    from click.testing import CliRunner

    from specdec.cli import main

    args = ["distill-data", str(tiny_checkpoint), "-o", str(tmp_path / "d"), "--n", "4", "--new-tokens", "4",
            "--batch", "2"]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.output
    assert "2 shards for 4 prompts" in r.output
    r = CliRunner().invoke(main, args)  # everything there: nothing to do
    assert r.exit_code == 0 and "wrote 0 answer tokens" in r.output
    r = CliRunner().invoke(main, ["distill-data", str(tiny_checkpoint), "-o", str(tmp_path / "e"), "--n", "0"])
    assert r.exit_code != 0 and "no prompts to answer" in r.output and "Traceback" not in r.output


def test_earlier_answers_become_reading_documents(target, tmp_path, monkeypatch):
    from specdec.export import distill_data

    prompts = plan_prompts(CFG, [], set())
    write_distill_data(target.model, target.tokenizer, tmp_path / "first", CFG, prompts, "tiny")
    monkeypatch.setattr(distill_data, "DOCUMENT_MIN_TOKENS", 2)
    docs = distill_data.answers_as_documents(tmp_path / "first", target.tokenizer)
    assert docs and all(isinstance(d, str) and d for d in docs)
    broad = DistillDataConfig(n_prompts=40, new_tokens=6, batch=4, seed=1)
    plan = plan_prompts(broad, [], set(), docs)
    assert any(d in m["content"] for p in plan for m in p for d in docs)  # reading tasks quote them
    with pytest.raises(SpecdecError, match="no distillation shards"):
        distill_data.answers_as_documents(tmp_path / "nothing", target.tokenizer)


def test_folders_made_before_prompt_sets_still_resume(target, tmp_path):
    basic = DistillDataConfig(n_prompts=3, new_tokens=4, batch=3, seed=1, prompt_set="basic")
    write_distill_data(target.model, target.tokenizer, tmp_path, basic, plan_prompts(basic, [], set()), "tiny")
    meta = json.loads((tmp_path / "distill.json").read_text())
    del meta["config"]["prompt_set"]  # as written by earlier versions
    (tmp_path / "distill.json").write_text(json.dumps(meta))
    r = write_distill_data(target.model, target.tokenizer, tmp_path, basic, plan_prompts(basic, [], set()), "tiny")
    assert r["answer_tokens_this_run"] == 0  # nothing redone, nothing refused
    with pytest.raises(SpecdecError):
        write_distill_data(target.model, target.tokenizer, tmp_path, CFG, plan_prompts(CFG, [], set()), "tiny")
