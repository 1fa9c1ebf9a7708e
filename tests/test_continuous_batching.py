"""`zerolite generate --batching continuous`: a file's prompts through the server's running batch,
each prompt's tokens those transformers' generate gives it alone, a finished prompt's place taken
mid-batch, the same output file as batch after batch; an input line's own max_new_tokens and stop."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

import zerolite
from support.cli_runner import assert_one_line_error, run
from support.helpers import new_tokens_alone
from support.tiny_models import save_ascii_tokenizer
from zerolite.convert.writer import convert
from zerolite.decoding.decoder import Decoder
from zerolite.errors import ZeroliteError
from zerolite.generate.continuous import ReleaseInOrder
from zerolite.generate.prompts import Prompt, read_prompts
from zerolite.generate.run import generate_all
from zerolite.sampling import Sampling

BATCH = 3
# (prompt length, its own max_new_tokens): the first batch's longest (16) outlives a short one (2)
LINES = [(5, 16), (3, 2), (9, 5), (1, 12), (12, 3), (4, 8), (7, 1)]


def prompts() -> list[Prompt]:
    generator = torch.Generator().manual_seed(0)
    return [Prompt(f"p{i}", None, tuple(torch.randint(3, 128, (n,), generator=generator).tolist()), line=i + 1,
                   max_new_tokens=new) for i, (n, new) in enumerate(LINES)]


@pytest.fixture(scope="module")
def source(make_source):
    return make_source("llama")


@pytest.fixture(scope="module")
def lm(make_layout):
    with zerolite.load(make_layout("llama"), device="cpu", show_progress=False) as lm:
        yield lm


def watch_the_decoder(monkeypatch) -> dict:
    """Each sequence's step of joining and of leaving, counted in the decoder's steps."""
    seen = {"steps": 0, "joined": {}, "left": {}}
    join, step, leave = Decoder.join, Decoder.step, Decoder.leave

    def joining(decoder, sequences):
        seen["joined"].update((s.index, seen["steps"]) for s in sequences)
        return join(decoder, sequences)

    def stepping(decoder):
        seen["steps"] += 1
        return step(decoder)

    def leaving(decoder, rows):
        seen["left"].update((row.owner.index, seen["steps"]) for row in rows)
        return leave(decoder, rows)

    monkeypatch.setattr(Decoder, "join", joining)
    monkeypatch.setattr(Decoder, "step", stepping)
    monkeypatch.setattr(Decoder, "leave", leaving)
    return seen


def test_each_prompt_gets_its_tokens_alone_and_a_finished_prompts_place_is_taken_mid_batch(monkeypatch, source, lm):
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    expected = {p.id: new_tokens_alone(model, list(p.input_ids), p.max_new_tokens) for p in prompts()}
    seen = watch_the_decoder(monkeypatch)
    handed = []
    stats = generate_all(lm, prompts(), Sampling(max_new_tokens=64), BATCH, handed.append, show_progress=False,
                         batching="continuous")
    got = [c for batch in handed for c in batch]
    assert [c.id for c in got] == [p.id for p in prompts()]  # input order, whatever order they ended in
    assert {c.id: c.token_ids for c in got} == expected
    assert [c.finish_reason for c in got] == ["stop" if c.token_ids[-1] == 2 else "length" for c in got]
    assert stats.new_tokens == sum(map(len, expected.values()))
    # the path under test ran: prompt 3 joined before the first three's longest (prompt 0) left
    first_longest_left = max(seen["left"][i] for i in range(BATCH))
    assert seen["joined"][BATCH] < first_longest_left, seen
    assert len(handed) > 1  # handed on as they were ready, not once at the end


@pytest.mark.parametrize("tiers", [dict(kv_offload=0.5), dict(kv_offload=0.25, kv_disk=0.5)])
def test_prompts_prefilled_apart_merge_into_a_kv_cache_partly_in_host_memory(tiers, make_layout, source):
    """--kv-offload: half the layers' K/V in host buffers, which a merge must widen and join too;
    --kv-disk: layers whose K/V is in files, read whole, changed and written anew."""
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    lines = prompts()[:4]
    got = []
    with zerolite.load(make_layout("llama"), device="cpu", show_progress=False, **tiers) as lm:
        generate_all(lm, lines, Sampling(), 2, got.extend, show_progress=False, batching="continuous")
    assert [c.token_ids for c in got] == [new_tokens_alone(model, list(p.input_ids), p.max_new_tokens) for p in lines]


def test_a_run_resumed_continuously_completes_a_static_runs_file_line_for_line(capsys, monkeypatch, tmp_path,
                                                                               make_layout):
    lines = [{"id": p.id, "input_ids": list(p.input_ids), "max_new_tokens": p.max_new_tokens} for p in prompts()]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))

    def generate(output, *more):
        result = run(capsys, monkeypatch, "generate", "--model", make_layout("llama"), "--device", "cpu",
                     "--input", tmp_path / "in.jsonl", "--output", output, "--batch-size", str(BATCH),
                     "--max-new-tokens", "64", "--offload", "cpu", *more)  # cpu: no planner to time
        assert result.code == 0, result.stderr
        return output.read_text()

    static = generate(tmp_path / "static.jsonl", "--batching", "static")
    # a run killed after the first four lines: the rerun (continuous by default) does the rest, in order
    resumed = tmp_path / "resumed.jsonl"
    resumed.write_text("".join(static.splitlines(keepends=True)[:4]))
    assert generate(resumed) == static


def test_a_stop_string_ends_a_line_in_both_batchings_alike(capsys, monkeypatch, tmp_path, make_source):
    source = make_source("llama", seed=3, fresh=True)
    save_ascii_tokenizer(source)
    layout = tmp_path / "layout"
    convert(source, layout, show_progress=False)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    with zerolite.load(layout, device="cpu", show_progress=False) as lm:
        ids = lm.tokenizer("Once upon").input_ids
        alone = new_tokens_alone(model, ids, 12)
        text = lm.tokenizer.decode(alone, skip_special_tokens=True)
        stop = text[4:6]
        cut = text.index(stop)
        lines = [Prompt("s", "Once upon", None, line=1, stop=(stop, "never there")), Prompt("t", "The", None, line=2)]
        for batching in ("static", "continuous"):
            got = []
            generate_all(lm, lines, Sampling(max_new_tokens=12), 2, got.extend, show_progress=False, batching=batching)
            assert got[0].completion == text[:cut], batching
            assert got[0].finish_reason == "stop"
            assert got[0].token_ids == alone[:len(got[0].token_ids)] and len(got[0].token_ids) < len(alone)
            assert got[1].completion == lm.tokenizer.decode(new_tokens_alone(model, lm.tokenizer("The").input_ids, 12),
                                                            skip_special_tokens=True)


@pytest.mark.parametrize("field, value, says", [
    ("max_new_tokens", 0, '"max_new_tokens" must be an integer of at least 1, got 0'),
    ("max_new_tokens", "8", '"max_new_tokens" must be an integer of at least 1, got "8"'),
    ("max_new_tokens", True, '"max_new_tokens" must be an integer of at least 1, got true'),
    ("stop", "", '"stop" must be a non-empty string or a list of them, got ""'),
    ("stop", ["\n", 3], '"stop" must be a non-empty string or a list of them, got ["\\n", 3]'),
    ("stop", [], '"stop" must be a non-empty string or a list of them, got []'),
])
def test_a_bad_value_of_a_line_is_named_with_its_line(tmp_path, field, value, says):
    path = tmp_path / "in.jsonl"
    path.write_text(json.dumps({"id": 1, "prompt": "a"}) + "\n" + json.dumps({"id": 2, "prompt": "b", field: value}))
    with pytest.raises(ZeroliteError) as error:
        read_prompts(path)
    assert str(error.value) == f"{path}, line 2: {says}"


def test_the_command_line_names_the_line_of_a_bad_value_or_a_stop_without_tokenizer(capsys, monkeypatch, tmp_path,
                                                                                     make_layout):
    path = tmp_path / "in.jsonl"
    path.write_text(json.dumps({"id": 1, "input_ids": [5, 6], "max_new_tokens": -3}) + "\n")
    result = run(capsys, monkeypatch, "generate", "--model", make_layout("llama"), "--device", "cpu", "--input", path)
    assert_one_line_error(result, "line 1", '"max_new_tokens" must be an integer of at least 1, got -3')
    path.write_text(json.dumps({"id": 1, "input_ids": [5, 6]}) + "\n" + json.dumps({"id": 2, "input_ids": [7],
                                                                                     "stop": "x"}) + "\n")
    result = run(capsys, monkeypatch, "generate", "--model", make_layout("llama"), "--device", "cpu", "--input", path,
                 "--offload", "cpu")  # no planner to time
    assert_one_line_error(result, "line 2", '"stop" strings need the model\'s tokenizer')


def test_a_prompt_and_its_own_max_new_tokens_past_the_context_are_named(lm):
    too_long = [Prompt("a", None, (5, 6), line=1), Prompt("b", None, (5, 6, 7), line=2, max_new_tokens=254)]
    with pytest.raises(ZeroliteError, match='line 2, prompt \'b\' is 3 tokens; with "max_new_tokens" 254 it would '
                                            'run past the model\'s context of 256: use "max_new_tokens" 253 or less'):
        generate_all(lm, too_long, Sampling(max_new_tokens=4), 2, lambda batch: None, show_progress=False)


def test_what_the_running_batch_cannot_follow_runs_batch_after_batch_or_is_refused(monkeypatch, lm):
    """A generation config with a rule only transformers' generate applies (here a repetition
    penalty): the default batching is static, an explicit continuous says why it cannot run."""
    seen = watch_the_decoder(monkeypatch)
    monkeypatch.setattr(lm.generation_config, "repetition_penalty", 1.3)
    got = []
    generate_all(lm, prompts()[:2], Sampling(max_new_tokens=3), 2, got.extend, show_progress=False)
    assert len(got) == 2 and seen["steps"] == 0
    with pytest.raises(ZeroliteError, match="`batching` continuous cannot run here: the model's generation config "
                                            "sets repetition_penalty"):
        generate_all(lm, prompts()[:2], Sampling(max_new_tokens=3), 2, got.extend, show_progress=False,
                     batching="continuous")


def test_completions_are_handed_on_in_input_order_as_soon_as_every_earlier_one_is():
    handed = []
    release = ReleaseInOrder([0, 2, 5, 6], handed.append)
    release.add({5: "c5"})
    release.add({2: "c2"})
    assert handed == []
    release.add({0: "c0"})
    release.add({6: "c6"})
    assert handed == [["c0", "c2", "c5"], ["c6"]]
