"""Prompts in, completions out: the JSONL files of `zerolite generate`.

Input, one object per line:   {"id": "q1", "prompt": "text"}  or  {"id": "q1", "input_ids": [1, 2, 3]},
                              optionally with its own "max_new_tokens": 32 and "stop": "\n\n" (or a list)
Output, one object per line:  {"id", "prompt", "completion", "token_ids", "finish_reason"}
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from zerolite.errors import ZeroliteError

INPUT_FORMAT = 'one JSON object per line, {"id": ..., "prompt": "..."} or {"id": ..., "input_ids": [...]}'


@dataclass(frozen=True)
class Prompt:
    id: str | int
    text: str | None                 # None when given as token ids
    input_ids: tuple[int, ...] | None
    line: int | None = None          # its line in the prompts file
    max_new_tokens: int | None = None  # its own limit; None: the job's
    stop: tuple[str, ...] = ()       # strings that end its completion (not shown in it)

    @property
    def where(self) -> str:
        """The prompt, as an error names it."""
        return (f"`input_file` line {self.line}, " if self.line is not None else "") + f"prompt {self.id!r}"


@dataclass(frozen=True)
class Completion:
    id: str | int
    prompt: str | None
    completion: str | None           # None when the model has no tokenizer
    token_ids: list[int]             # the generated ids only
    finish_reason: str               # "stop" (an end-of-sequence token or a stop string) or "length"

    def to_json(self) -> str:
        return json.dumps(asdict(self), ensure_ascii=False)


def prompts_from_arguments(texts: list[str]) -> list[Prompt]:
    return [Prompt(i, text, None) for i, text in enumerate(texts)]


def read_prompts(path: Path) -> list[Prompt]:
    """Every prompt in a JSONL file, or an error naming the file, the line and what is wrong."""
    if not path.exists():
        raise ZeroliteError(f"`input_file` {path} does not exist: give a JSONL file ({INPUT_FORMAT})")
    if not path.is_file():
        raise ZeroliteError(f"`input_file` {path} is not a file: give a JSONL file ({INPUT_FORMAT})")
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise ZeroliteError(f"cannot read `input_file` {path}: {e.strerror}") from e
    prompts: list[Prompt] = []
    seen: set = set()
    for number, line in enumerate(raw.split(b"\n"), start=1):
        if not line.strip():
            continue
        prompt = parse_line(line, f"{path}, line {number}", number)
        if prompt.id in seen:
            raise ZeroliteError(f"{path}, line {number}: id {prompt.id!r} appears twice: give every prompt its own id")
        seen.add(prompt.id)
        prompts.append(prompt)
    if not prompts:
        raise ZeroliteError(f"`input_file` {path} holds no prompts: write {INPUT_FORMAT}")
    return prompts


def parse_line(line: bytes, where: str, number: int) -> Prompt:
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ZeroliteError(f"{where} is not UTF-8 (byte {e.start}): save the file as UTF-8") from None
    try:
        obj = json.loads(text)
    except ValueError as e:
        raise ZeroliteError(f"{where} is not valid JSON ({e.msg} at column {e.colno}): write {INPUT_FORMAT}") from None
    if not isinstance(obj, dict):
        raise ZeroliteError(f"{where} is a JSON {type(obj).__name__}, not an object: write {INPUT_FORMAT}")
    if "id" not in obj or not isinstance(obj["id"], (str, int)) or isinstance(obj["id"], bool):
        raise ZeroliteError(f"{where} needs an \"id\" (a string or an integer): write {INPUT_FORMAT}")
    has_text, has_ids = "prompt" in obj, "input_ids" in obj
    if has_text == has_ids:
        raise ZeroliteError(f"{where} needs exactly one of \"prompt\" and \"input_ids\": write {INPUT_FORMAT}")
    limits = {"line": number, "max_new_tokens": own_max_new_tokens(obj, where), "stop": own_stop(obj, where)}
    if has_text:
        if not isinstance(obj["prompt"], str) or not obj["prompt"]:
            raise ZeroliteError(f"{where}: \"prompt\" must be a non-empty string")
        return Prompt(obj["id"], obj["prompt"], None, **limits)
    ids = obj["input_ids"]
    if (not isinstance(ids, list) or not ids
            or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids)):
        raise ZeroliteError(f"{where}: \"input_ids\" must be a non-empty list of token ids (integers >= 0)")
    return Prompt(obj["id"], None, tuple(ids), **limits)


def own_max_new_tokens(obj: dict, where: str) -> int | None:
    value = obj.get("max_new_tokens")
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ZeroliteError(f"{where}: \"max_new_tokens\" must be an integer of at least 1, got {json.dumps(value)}")
    return value


def own_stop(obj: dict, where: str) -> tuple[str, ...]:
    """"stop" as OpenAI's API takes it: a string or a list of strings, none empty."""
    value = obj.get("stop")
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not stops or not all(isinstance(s, str) and s for s in stops):
        raise ZeroliteError(f"{where}: \"stop\" must be a non-empty string or a list of them, "
                            f"got {json.dumps(value)}")
    return tuple(stops)
