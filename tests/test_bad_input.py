"""More bad input across convert, generate and profile (the rest lives beside each command's tests):
one line naming the problem and the fix, a non-zero exit, no traceback."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from cli_runner import assert_one_line_error, run
from tiny_models import save_tiny_model
from zerolite.convert import JOURNAL, convert


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return save_tiny_model("opt", tmp_path_factory.mktemp("bad") / "source")


@pytest.fixture(scope="module")
def layout(source, tmp_path_factory):
    path = tmp_path_factory.mktemp("bad-layout") / "layout"
    convert(source, path, show_progress=False)
    return path


def model_folder(tmp_path, config: str):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(config)
    save_file({"x": torch.zeros(1)}, folder / "model.safetensors")
    return folder


@pytest.mark.parametrize(
    ("case", "fragments"),
    [
        ("unsupported-architecture", ("cannot read the model config",)),
        ("config-not-json", ("cannot read the model config",)),
        ("model-is-a-text-file", ("is a file, not a model folder",)),
        ("path-is-a-file", ("cannot write to --path",)),
        ("empty-model-folder", ("no config.json",)),
    ],
)
def test_convert_bad_sources_and_targets(capsys, monkeypatch, tmp_path, source, case, fragments):
    target = tmp_path / "out"
    if case == "unsupported-architecture":
        model = model_folder(tmp_path, json.dumps({"model_type": "no-such-architecture"}))
    elif case == "config-not-json":
        model = model_folder(tmp_path, "{not json")
    elif case == "model-is-a-text-file":
        model = tmp_path / "notes.txt"
        model.write_text("hello")
    elif case == "path-is-a-file":
        model, target = source, tmp_path / "a-file"
        target.write_text("")
    else:
        model = tmp_path / "empty"
        model.mkdir()
    assert_one_line_error(run(capsys, monkeypatch, "convert", model, "--path", target), *fragments)


def test_generate_from_an_interrupted_conversion(capsys, monkeypatch, tmp_path, layout):
    interrupted = tmp_path / "interrupted"
    interrupted.mkdir()
    (interrupted / JOURNAL).write_text("{}\n")
    result = run(capsys, monkeypatch, "generate", "hi", "--model", interrupted, "--device", "cpu")
    assert_one_line_error(result, "did not finish", "zerolite convert")


@pytest.mark.parametrize(
    ("args", "fragments"),
    [
        (["--batch-size", "abc"], ("--batch-size", "not a number", "auto")),
        (["--temperature", "hot", "--sample"], ("--temperature", "valid number")),
        (["--max-new-tokens", "-5"], ("--max-new-tokens", "greater than or equal to 1")),
        (["--top-k", "-1", "--sample"], ("--top-k",)),
        (["--dtype", "fp8"], ("unknown --dtype",)),
        (["--device", "tpu"], ("unknown --device",)),
        (["--model", "/no/such/model"], ("does not exist",)),
        (["--stats-json", "/no/such/dir/s.json"], ("folder /no/such/dir does not exist",)),
    ],
)
def test_generate_bad_values(capsys, monkeypatch, layout, args, fragments):
    arguments = ["generate", "hi", "--device", "cpu", *args]
    if "--model" not in args:
        arguments += ["--model", str(layout)]
    assert_one_line_error(run(capsys, monkeypatch, *arguments), *fragments)


def test_generate_input_that_is_a_folder_and_output_that_is_a_folder(capsys, monkeypatch, tmp_path, layout):
    result = run(capsys, monkeypatch, "generate", "--model", layout, "--device", "cpu", "--input", tmp_path)
    assert_one_line_error(result, "is not a file")
    result = run(capsys, monkeypatch, "generate", "hi", "--model", layout, "--device", "cpu", "--output", tmp_path)
    assert_one_line_error(result, "cannot write --output")


def test_profile_bad_values(capsys, monkeypatch, tmp_path, layout):
    empty = tmp_path / "empty.bin"
    empty.write_bytes(b"")
    assert_one_line_error(run(capsys, monkeypatch, "profile", "--disk", empty), "is empty")
    result = run(capsys, monkeypatch, "profile", "--model", layout, "--device", "cpu", "--prompt-tokens", "0")
    assert_one_line_error(result, "--prompt-tokens", "greater than or equal to 1")
    result = run(capsys, monkeypatch, "profile", "--model", layout, "--device", "cpu", "--prefetch-depth", "-2")
    assert_one_line_error(result, "--prefetch-depth")
