"""`zerolite generate`: JSONL in and out, batches, stats, the built-in model, a layout of another model."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from support.cli_runner import assert_one_line_error, run
from support.helpers import greedy
from support.tiny_models import save_tiny_model

REPOSITORY = Path(__file__).resolve().parent.parent
NEW_TOKENS = 6
PROMPTS = [[5, 17, 33, 9, 44], [12, 90], [101, 3, 7, 55, 8, 19, 4]]


@pytest.fixture(scope="module")
def source(make_source):
    return make_source("gpt2")


@pytest.fixture(scope="module")
def layout(make_layout):
    return make_layout("gpt2")


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def transformers_tokens(source, batch: list[list[int]]) -> list[list[int]]:
    """transformers' greedy tokens for one left-padded batch, cut after the end token."""
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    out = greedy(model, batch, NEW_TOKENS)
    rows = []
    for row in out[:, max(map(len, batch)):].tolist():
        rows.append(row[: row.index(2) + 1] if 2 in row else row)  # 2: the tiny models' end token
    return rows


def test_jsonl_in_and_out_match_transformers_batch_by_batch(capsys, monkeypatch, tmp_path, source):
    prompts = write_jsonl(tmp_path / "in.jsonl", [{"id": f"p{i}", "input_ids": ids} for i, ids in enumerate(PROMPTS)])
    result = run(capsys, monkeypatch, "generate", "--model", source, "--path", tmp_path / "layout", "--device", "cpu",
                 "--input", prompts, "--output", tmp_path / "out.jsonl", "--batch-size", "2", "--cpu-memory", "0",
                 "--max-new-tokens", str(NEW_TOKENS), "--stats-json", tmp_path / "stats.json", "--batching", "static")
    assert result.code == 0, result.stderr
    lines = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [line["id"] for line in lines] == ["p0", "p1", "p2"]
    expected = transformers_tokens(source, PROMPTS[:2]) + transformers_tokens(source, PROMPTS[2:])
    for line, tokens in zip(lines, expected, strict=True):
        assert set(line) == {"id", "prompt", "completion", "token_ids", "finish_reason"}
        assert line["prompt"] is None and line["completion"] is None  # token ids in, no tokenizer
        assert line["token_ids"] == tokens
        assert line["finish_reason"] == ("stop" if tokens[-1] == 2 else "length")
    stats = json.loads((tmp_path / "stats.json").read_text())
    assert set(stats) >= {"load_s", "prefill_s", "decode_s", "new_tokens", "decode_tokens_per_s", "tokens_per_pass",
                          "bytes_read", "peak_rss_bytes", "peak_device_bytes"}
    assert stats["new_tokens"] == sum(map(len, expected)) and stats["bytes_read"] > 0


def test_prompts_as_arguments_print_to_stdout(capsys, monkeypatch, tmp_path, layout):
    prompts = write_jsonl(tmp_path / "in.jsonl", [{"id": 1, "input_ids": PROMPTS[0]}])
    result = run(capsys, monkeypatch, "generate", "--model", layout, "--device", "cpu", "--input", prompts,
                 "--max-new-tokens", "3")
    assert result.code == 0
    assert len(json.loads(result.stdout.strip())) <= 3  # no tokenizer: the token ids


def test_the_plan_shows_the_batch_that_runs_not_the_batch_size_option(capsys, monkeypatch, tmp_path, layout):
    prompts = write_jsonl(tmp_path / "in.jsonl", [{"id": 1, "input_ids": PROMPTS[0]}])
    result = run(capsys, monkeypatch, "generate", "--model", layout, "--device", "cpu", "--input", prompts,
                 "--max-new-tokens", "3")  # --batch-size 8 by default, one prompt
    assert result.code == 0, result.stderr
    assert f"(batch 1 x {len(PROMPTS[0]) + 3} tokens)" in result.stderr, result.stderr


def test_a_resumed_run_announces_the_largest_batch_left_and_its_longest_sequence(layout):
    import zerolite
    from zerolite.generate.prompts import Prompt
    from zerolite.generate.run import generate_all
    from zerolite.sampling import Sampling

    prompts = [Prompt(f"p{i}", None, tuple(ids)) for i, ids in enumerate(PROMPTS)]
    started = []
    with zerolite.load(layout, device="cpu", show_progress=False) as lm:
        for done in (set(), {"p2"}, {"p0", "p1"}):
            generate_all(lm, prompts, Sampling(max_new_tokens=2), batch_size=2, on_batch=lambda batch: None,
                         show_progress=False, done=done, on_start=lambda *announced: started.append(announced))
    assert started == [(2, len(PROMPTS[2]) + 2), (2, len(PROMPTS[0]) + 2), (1, len(PROMPTS[2]) + 2)]


def test_two_models_under_one_path_root_get_a_layout_each(capsys, monkeypatch, tmp_path, source):
    other = save_tiny_model("llama", tmp_path / "other")
    (tmp_path / "nvme").mkdir()
    (tmp_path / "nvme" / "notes.txt").write_text("mine")  # an offload root holds other things too
    prompts = write_jsonl(tmp_path / "in.jsonl", [{"id": 1, "input_ids": PROMPTS[0]}])
    for model in (source, other, source):  # the third run reuses the first layout
        result = run(capsys, monkeypatch, "generate", "--model", model, "--path", tmp_path / "nvme", "--device", "cpu",
                     "--input", prompts, "--max-new-tokens", "2")
        assert result.code == 0, result.stderr
    layouts = sorted(path for path in (tmp_path / "nvme").iterdir() if path.is_dir())
    assert [path.name.split("-")[0] for path in layouts] == ["other", "source"]
    assert all((path / "manifest.json").is_file() for path in layouts)
    assert (tmp_path / "nvme" / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize("with_model", [False, True])
def test_a_layout_given_as_path_is_used_as_it_is(capsys, monkeypatch, tmp_path, source, layout, with_model):
    before = sorted(layout.iterdir())
    prompts = write_jsonl(tmp_path / "in.jsonl", [{"id": 1, "input_ids": PROMPTS[0]}])
    model = ["--model", source] if with_model else []
    result = run(capsys, monkeypatch, "generate", *model, "--path", layout, "--device", "cpu", "--input", prompts,
                 "--max-new-tokens", "2")
    assert result.code == 0, result.stderr
    assert sorted(layout.iterdir()) == before  # run from, not converted into a folder inside it


def test_sampling_with_a_seed_repeats(capsys, monkeypatch, tmp_path, layout):
    prompts = write_jsonl(tmp_path / "in.jsonl", [{"id": 1, "input_ids": PROMPTS[2]}])
    outputs = []
    for name in ("a", "b"):
        result = run(capsys, monkeypatch, "generate", "--model", layout, "--device", "cpu", "--input", prompts,
                     "--sample", "--temperature", "1.5", "--top-k", "0", "--seed", "7", "--output", tmp_path / name)
        assert result.code == 0, result.stderr
        outputs.append((tmp_path / name).read_text())
    assert outputs[0] == outputs[1]


def demo_arguments() -> list[str]:
    """The arguments `make demo` gives zerolite, read from the Makefile, with its prompt filled in."""
    makefile = (REPOSITORY / "Makefile").read_text()
    prompt = re.search(r"^PROMPT \?= (.*)$", makefile, re.MULTILINE)[1]
    recipe = makefile.split("\ndemo:", 1)[1].splitlines()[1]  # the line after the target
    program, *arguments = shlex.split(recipe.replace("$(PROMPT)", prompt))
    assert program == "$(BIN)/zerolite"
    return arguments


def test_the_demo_streams_the_builtin_model_from_disk_and_knows_the_capital_of_france(tmp_path):
    """The README's main job, as `make demo` runs it: the built-in model, converted on first use, every
    layer read from disk at every step (the default budgets would hold this small model in memory)."""
    arguments = demo_arguments()
    readme = " ".join((REPOSITORY / "README.md").read_text().split())
    assert "zerolite " + shlex.join(arguments).replace("'", '"') in readme  # the README shows what make runs
    zerolite = shutil.which("zerolite", path=os.path.dirname(sys.executable)) or "zerolite"
    env = dict(os.environ, ZEROLITE_CACHE=str(tmp_path / "cache"))
    done = subprocess.run([zerolite, *arguments], capture_output=True, text=True, env=env, timeout=600, check=False)
    assert done.returncode == 0, done.stderr
    assert "Paris" in done.stdout
    plan = next(line for line in done.stderr.splitlines() if line.startswith("plan: "))
    assert "layers streamed from disk" in plan and "in host memory" not in plan, plan
    assert float(re.search(r"([0-9.]+) GB read", done.stderr)[1]) > 0, done.stderr


# Bad input that needs more than a command line; the rest is in test_bad_input.py.


def test_layout_of_another_model(capsys, monkeypatch, make_source, make_layout):
    other = make_source("llama")
    layout = make_layout("gpt2", fresh=True)  # its own: were it overwritten after all, the shared one stays whole
    result = run(capsys, monkeypatch, "generate", "hi", "--model", other, "--path", layout, "--device", "cpu")
    assert_one_line_error(result, "holds a layout of another model", "choose another --path")
    assert (layout / "manifest.json").is_file()  # the other layout is left as it was
