"""Bad input on the command line ends as one line on stderr naming the problem (and the fix), a
non-zero exit and no traceback. Every case that needs no more than a command line and a few small
files is in the table here; those that need more (damaged layouts, a full disk, I/O faults) are
beside the code they test."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save as safetensors_bytes
from transformers import T5Config

from support.cli_runner import assert_one_line_error, run
from support.tiny_models import tiny_config
from zerolite.convert.writer import JOURNAL
from zerolite.io.device import cuda_available

# Small files the cases write under {tmp} before running.
WEIGHTS = safetensors_bytes({"x": torch.zeros(1)})
LLAMA_CONFIG = tiny_config("llama").to_json_string()
T5_MODEL = {"t5/config.json": T5Config(d_model=32, d_ff=64, num_layers=1, num_heads=2).to_json_string(),
            "t5/model.safetensors": WEIGHTS}
PROMPTS = "generate --model {layout} --device cpu --input {tmp}/in.jsonl --max-new-tokens 10"


def case(argv: str, *expected: str, id: str, files: dict | None = None, marks=()):
    """argv: the command line after `zerolite`, split on spaces, each word with {tmp} (this test's
    folder), {source} (a tiny llama's folder) and {layout} (its layout) filled in.
    expected: words the error line must hold. files: {name under {tmp}: text or bytes}, written first."""
    return pytest.param(argv, expected, files or {}, id=id, marks=marks)


CASES = [
    # convert: the model folder
    case("convert {tmp}/nowhere --path {tmp}/out", "does not exist", "nowhere", id="convert-model-folder-missing"),
    case("convert {tmp} --path {tmp}/out", "no config.json", id="convert-empty-model-folder"),
    case("convert {tmp}/model --path {tmp}/out", "no config.json", id="convert-weights-without-config",
         files={"model/model.safetensors": WEIGHTS}),
    case("convert {tmp}/model --path {tmp}/out", "no weights in", "model.safetensors",
         id="convert-config-without-weights", files={"model/config.json": LLAMA_CONFIG}),
    case("convert {tmp}/notes.txt --path {tmp}/out", "is a file, not a model folder", id="convert-model-is-a-text-file",
         files={"notes.txt": "hello"}),
    case("convert {tmp}/model --path {tmp}/out", "cannot read the model config", id="convert-unsupported-architecture",
         files={"model/config.json": '{"model_type": "no-such-architecture"}', "model/model.safetensors": WEIGHTS}),
    case("convert {tmp}/model --path {tmp}/out", "cannot read the model config", id="convert-config-not-json",
         files={"model/config.json": "{not json", "model/model.safetensors": WEIGHTS}),
    case("convert {tmp}/t5 --path {tmp}/out", "'t5' is not a causal language model", id="convert-not-a-causal-lm",
         files=T5_MODEL),
    # convert: --path and options
    case("convert {source} --path {tmp}/a-file", "cannot write to --path", id="convert-path-is-a-file",
         files={"a-file": ""}),
    case("convert {source} --path {tmp}/a-file/layout", "cannot write to --path", "choose a folder you can write to",
         id="convert-path-under-a-file", files={"a-file": ""}),
    case("convert {source} --path /proc/zerolite-layout", "cannot write to --path", id="convert-path-read-only"),
    case("convert {source} --path {tmp}/out --dtype fp8", "unknown --dtype", "bf16", id="convert-unknown-dtype"),
    case("convert {source} --path {tmp}/out --weights int3", "unknown --weights 'int3'", "int8",
         id="convert-unknown-weights"),
    case("convert {source} --path {tmp}/out --weights int4 --group-size 48", "--group-size 48", "32, 64 or 128",
         id="convert-int4-unknown-group-size"),
    case("convert {source} --path {tmp}/out --weights int8 --group-size 32", "--group-size",
         "one scale per output channel", id="convert-group-size-for-int8"),
    case("convert {source} --path {tmp}/out --group-size 32", "--group-size is for int4 weights", "--weights int4",
         id="convert-group-size-without-weights"),
    case("convert", "Missing option '--path'", id="convert-missing-path-option"),
    # inspect
    case("inspect {tmp}", "no zerolite layout", "zerolite convert", id="inspect-no-layout"),
    # generate: the model
    case("generate hi --device cpu --model /no/such/model", "does not exist", id="generate-model-missing"),
    case("generate hi --device cpu --model {tmp}/interrupted", "did not finish", "zerolite convert",
         id="generate-interrupted-conversion", files={f"interrupted/{JOURNAL}": "{}\n"}),
    case("generate hi --device cpu --model {tmp}/t5 --path {tmp}/out", "'t5' is not a causal language model",
         id="generate-not-a-causal-lm", files=T5_MODEL),
    case("generate hello --model {layout} --device cuda", "no usable CUDA device", "--device cpu",
         id="generate-cuda-where-there-is-none",
         marks=pytest.mark.skipif(cuda_available(), reason="this machine has CUDA")),
    # generate: options
    case("generate --model {layout} --device cpu", "nothing to generate from", id="generate-no-prompt"),
    case("generate hi --model {layout} --device cpu --batch-size abc", "--batch-size", "not a number", "auto",
         id="generate-batch-size-not-a-number"),
    case("generate hi --model {layout} --device cpu --batch-size many", "--batch-size", "auto",
         id="generate-batch-size-a-word"),
    case("generate hi --model {layout} --device cpu --batch-size 0", "--batch-size", "at least 1",
         id="generate-batch-size-0"),
    case("generate hi --model {layout} --device cpu --max-new-tokens 0", "--max-new-tokens",
         "greater than or equal to 1", id="generate-max-new-tokens-0"),
    case("generate hi --model {layout} --device cpu --max-new-tokens -5", "--max-new-tokens",
         "greater than or equal to 1", id="generate-max-new-tokens-negative"),
    case("generate hi --model {layout} --device cpu --prefetch-depth 0", "--prefetch-depth",
         "greater than or equal to 1", id="generate-prefetch-depth-0"),
    case("generate hi --model {layout} --device cpu --offload disk", "unknown --offload", "nvme",
         id="generate-unknown-offload"),
    case("generate hi --model {layout} --device cpu --dtype fp8", "unknown --dtype", id="generate-unknown-dtype"),
    case("generate hi --model {layout} --device tpu", "unknown --device", id="generate-unknown-device"),
    case("generate hi --model {layout} --device cpu --sample --temperature hot", "--temperature", "valid number",
         id="generate-temperature-not-a-number"),
    case("generate hi --model {layout} --device cpu --sample --temperature 0", "--temperature must be above 0",
         id="generate-temperature-0"),
    case("generate hi --model {layout} --device cpu --sample --top-p 1.5", "--top-p", id="generate-top-p-above-1"),
    case("generate hi --model {layout} --device cpu --sample --top-k -1", "--top-k", id="generate-top-k-negative"),
    # generate: memory budgets
    case("generate hi --model {layout} --device cpu --cpu-memory 20", "--cpu-memory", "unit", "24GB",
         id="generate-cpu-memory-without-unit"),
    case("generate hi --model {layout} --device cpu --gpu-memory much", "--gpu-memory", "not a size",
         id="generate-gpu-memory-not-a-size"),
    case("generate hi --model {layout} --device cpu --kv-offload 1.5", "--kv-offload", "from 0 to 1",
         id="generate-kv-offload-above-1"),
    case("generate hi --model {layout} --device cpu --kv-offload -0.1", "--kv-offload", "from 0 to 1",
         id="generate-kv-offload-negative"),
    case("generate hi --model {layout} --device cpu --kv-bits 3", "--kv-bits", "16, 8, 4, not 3",
         id="generate-kv-bits-3"),
    case("generate hi --model {layout} --device cpu --kv-attention gpu", "--kv-attention", "auto, device, cpu",
         id="generate-kv-attention-gpu"),
    case("generate hi --model {layout} --device cpu --micro-batches 0", "--micro-batches",
         "greater than or equal to 1", id="generate-micro-batches-0"),
    case("generate hi --model {layout} --device cpu --offload cpu --kv-disk 0.5", "--kv-disk", "offload root",
         "--path", id="generate-kv-disk-without-a-disk"),
    case("generate hi --model {layout} --device cpu --kv-offload 0.6 --kv-disk 0.6", "--kv-disk",
         "at most 1 together", id="generate-kv-disk-with-kv-offload-above-1"),
    # plan: the K/V's and the micro-batches' flags, checked as generate checks them
    case("plan --model {source} --device cpu --kv-disk 0.6 --kv-offload 0.6", "--kv-disk", "at most 1",
         id="plan-kv-disk-and-offload-above-1"),
    case("plan --model {source} --device cpu --kv-attention gpu", "--kv-attention", "auto, device, cpu",
         id="plan-kv-attention-unknown"),
    # generate: files in and out
    case("generate --model {layout} --device cpu --input /nonexistent.jsonl", "does not exist",
         id="generate-input-missing"),
    case("generate --model {layout} --device cpu --input {tmp}", "is not a file", id="generate-input-is-a-folder"),
    case("generate hi --model {layout} --device cpu --output /nonexistent/out.jsonl",
         "folder /nonexistent does not exist", id="generate-output-folder-missing"),
    case("generate hi --model {layout} --device cpu --output {tmp}", "cannot write --output",
         id="generate-output-is-a-folder"),
    case("generate hi --model {layout} --device cpu --stats-json /no/such/dir/s.json",
         "folder /no/such/dir does not exist", id="generate-stats-json-folder-missing"),
    # generate: the prompts file
    case(PROMPTS, "holds no prompts", id="prompts-empty", files={"in.jsonl": b""}),
    case(PROMPTS, "holds no prompts", id="prompts-blank-lines", files={"in.jsonl": b"\n  \n"}),
    case(PROMPTS, "line 2", "not valid JSON", id="prompts-line-not-json",
         files={"in.jsonl": b'{"id": 1, "input_ids": [1, 2]}\n{"id": 2, "input_ids": [1,\n'}),
    case(PROMPTS, "line 1", "not UTF-8", id="prompts-not-utf8",
         files={"in.jsonl": b'{"id": 1, "prompt": "caf\xe9"}\n'}),
    case(PROMPTS, "line 1", "not an object", id="prompts-line-not-an-object", files={"in.jsonl": b"[1, 2, 3]\n"}),
    case(PROMPTS, "line 1", '"id"', id="prompts-no-id", files={"in.jsonl": b'{"input_ids": [1]}\n'}),
    case(PROMPTS, "line 1", "exactly one of", id="prompts-neither-prompt-nor-ids", files={"in.jsonl": b'{"id": 1}\n'}),
    case(PROMPTS, "line 1", "non-empty list", id="prompts-empty-ids",
         files={"in.jsonl": b'{"id": 1, "input_ids": []}\n'}),
    case(PROMPTS, "line 2", "appears twice", id="prompts-id-twice",
         files={"in.jsonl": b'{"id": 1, "input_ids": [1]}\n{"id": 1, "input_ids": [2]}\n'}),
    case(PROMPTS, "token id 100000", "vocabulary", id="prompts-token-past-vocabulary",
         files={"in.jsonl": b'{"id": 1, "input_ids": [100000]}\n'}),
    case(PROMPTS, "'long' is 300 tokens", "context of 256", id="prompts-longer-than-context",
         files={"in.jsonl": b'{"id": "long", "input_ids": [' + b", ".join([b"5"] * 300) + b"]}\n"}),
    case(PROMPTS, "--max-new-tokens 6 or less", id="prompts-no-room-for-new-tokens",
         files={"in.jsonl": b'{"id": "near", "input_ids": [' + b", ".join([b"5"] * 250) + b"]}\n"}),
    case(PROMPTS, "no tokenizer", "input_ids", id="prompts-text-without-tokenizer",
         files={"in.jsonl": b'{"id": "text", "prompt": "hello"}\n'}),
    # profile
    case("profile --disk /nonexistent", "--disk /nonexistent does not exist", id="profile-disk-missing"),
    case("profile --disk {tmp}/empty.bin", "is empty", id="profile-disk-empty-file", files={"empty.bin": b""}),
    case("profile --model {layout} --device cpu --prompt-tokens 0", "--prompt-tokens", "greater than or equal to 1",
         id="profile-prompt-tokens-0"),
    case("profile --model {layout} --device cpu --new-tokens 1", "--new-tokens", "greater than or equal to 2",
         id="profile-new-tokens-1"),
    case("profile --model {layout} --device cpu --batch-size 0", "--batch-size", "greater than or equal to 1",
         id="profile-batch-size-0"),
    case("profile --model {layout} --device cpu --prefetch-depth -2", "--prefetch-depth",
         id="profile-prefetch-depth-negative"),
    case("profile --model {layout} --device cpu --offload ssd", "unknown --offload", id="profile-unknown-offload"),
    case("profile --model {layout} --device cpu --plot /nonexistent/t.png", "folder /nonexistent does not exist",
         id="profile-plot-folder-missing"),
]


@pytest.mark.parametrize(("argv", "expected", "files"), CASES)
def test_bad_input_ends_in_one_clear_line(capsys, monkeypatch, tmp_path, make_source, make_layout, argv, expected,
                                          files):
    for name, content in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content.encode() if isinstance(content, str) else content)
    places = dict(tmp=tmp_path, source=make_source(), layout=make_layout())
    result = run(capsys, monkeypatch, *(word.format(**places) for word in argv.split()))
    assert_one_line_error(result, *expected)
