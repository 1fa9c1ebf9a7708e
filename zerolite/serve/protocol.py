"""The OpenAI API's requests as zerolite serve reads them, and the parts its answers share.

    body = parse(ChatRequest, raw_json)            # BadRequest: one line saying what is wrong
    check_model(body, served)                      # the model asked for is the one served
    prompt = chat_prompt(body, served)             # token ids (completion_prompts: a list per prompt)
    seqs = sequences(body, [prompt], served, asked_max, default_max=None)  # one per choice, for the decode loop
    usage(...), error_body(...), model_card(...)   # pieces of the JSON objects OpenAI's clients expect

The answers are put together in zerolite.serve.app, the stream chunks in zerolite.serve.streaming.

A parameter OpenAI defines that would change the answer and that zerolite does not do (logprobs,
tools, logit_bias, ...) is refused by name rather than silently ignored; an unknown one is
refused too, so that a typo (max_token) is not mistaken for the default. top_k, ignore_eos (run to
max_tokens, as benchmarks want) and return_token_ids (each choice's token ids in the answer) are
vLLM's extensions.
"""

from __future__ import annotations

import json
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from zerolite.decoding.decoder import Sequence
from zerolite.decoding.text_stream import TextStream
from zerolite.decoding.token_choice import TokenChoice
from zerolite.sampling import Sampling
from zerolite.text import PromptError, check_ids, encode_chat, encode_text

MAX_N = 16                 # choices per request
MAX_STOPS = 4              # stop strings per request, as OpenAI allows
ERROR_TYPES = {401: "authentication_error", 404: "not_found_error", 429: "rate_limit_error", 500: "server_error",
               503: "server_error"}  # OpenAI's error "type" by HTTP status; other 4xx: invalid_request_error
GREEDY_BELOW = 1e-5        # a temperature this low is greedy (dividing by it would overflow the logits to inf)
# What the client should do instead, by text.PromptError's code.
FIXES = {
    "no_tokenizer": "give the prompt as token ids",
    "no_chat_template": "use /v1/completions",
    "chat_template_refused": "change the messages",
    "empty_prompt": "give it some tokens",
    "invalid_token_id": "check the prompt's ids",
}


class BadRequest(Exception):
    """A request zerolite will not run: str() says what is wrong; status is the HTTP code."""

    def __init__(self, message: str, status: int = 400, code: str | None = None, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.code = code
        self.param = param


@dataclass(frozen=True)
class ServedModel:
    """The one model a server serves, and the limits it serves it under."""
    name: str
    tokenizer: Any               # None: prompts as token ids only
    vocab_size: int
    eos_ids: frozenset[int]
    context: int                 # tokens per sequence, prompt and completion together
    max_tokens: int              # the most completion tokens one request may ask for
    max_prompt_tokens: int
    created: int


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class Common(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    seed: int | None = Field(None, ge=-2**63, le=2**63 - 1)
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    return_token_ids: bool = False
    ignore_eos: bool = False

    @property
    def usage_chunk(self) -> bool:
        """A stream ends with a chunk carrying usage (stream_options.include_usage)."""
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def plain(self) -> dict:
        content = self.content if not isinstance(self.content, list) else "".join(part.text for part in self.content)
        return {"role": self.role, "content": content or ""}


class ChatRequest(Common):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict | None = None
    metadata: dict | None = None
    store: bool | None = None


def parse(kind: type[BaseModel], raw: bytes):
    """The request body as kind, or BadRequest naming the first thing wrong with it."""
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as e:
        # bad JSON or bad UTF-8; a 5000-digit number; [[[[... nested past the stack
        raise BadRequest(f"the request body is not valid JSON ({' '.join(str(e).split())[:200]})") from None
    if not isinstance(data, dict):
        raise BadRequest(f"the request body must be a JSON object, not {type(data).__name__}")
    try:
        body = kind.model_validate(data)
    except ValidationError as e:
        raise BadRequest(*describe(e.errors()[0], kind)) from None
    refuse_unsupported(body)
    return body


def describe(error: dict, kind: type[BaseModel]) -> tuple[str, int, str, str]:
    # pydantic names the union member it tried in the location ("str", "list[int]", "TextPart"): not fields
    field = ".".join(str(part) for part in error["loc"]
                     if not (str(part) in ("str", "int", "float", "bool")
                             or "[" in str(part) or str(part)[:1].isupper()))
    top = str(error["loc"][0]) if error["loc"] else ""
    if error["type"] == "extra_forbidden":
        return (f"unknown parameter {field!r}: see the OpenAI API's {kind.__name__} for the ones there are",
                400, "unknown_parameter", field)
    if error["type"] == "missing":
        return f"{field!r} is required", 400, "missing_parameter", field
    if top == "prompt":
        return ("'prompt' must be a string, a list of strings, a list of token ids or a list of lists of token ids",
                400, "invalid_type", top)
    return f"{field}: {error['msg']}", 400, "invalid_value", top


def refuse_unsupported(body: Common) -> None:
    def refuse(param: str, why: str) -> None:
        raise BadRequest(f"{param!r} {why}", param=param, code="unsupported_parameter")

    if body.stream_options is not None and not body.stream:
        refuse("stream_options", "is only for streaming: set stream to true, or leave it out")
    if body.logit_bias:
        refuse("logit_bias", "is not supported by zerolite serve: leave it out")
    stops = [body.stop] if isinstance(body.stop, str) else body.stop or []
    if len(stops) > MAX_STOPS or any(not stop for stop in stops):
        refuse("stop", f"takes at most {MAX_STOPS} strings, none of them empty")
    if isinstance(body, CompletionRequest):
        if body.logprobs:
            refuse("logprobs", "is not supported by zerolite serve: leave it out")
        if body.best_of not in (None, body.n):
            refuse("best_of", "other than n is not supported by zerolite serve")
        if body.suffix:
            refuse("suffix", "(insertion) is not supported by zerolite serve")
    if isinstance(body, ChatRequest):
        if body.logprobs or body.top_logprobs:
            refuse("logprobs", "is not supported by zerolite serve: leave it out")
        if body.tools or body.tool_choice not in (None, "none"):
            refuse("tools", "(function calling) is not supported by zerolite serve")
        if body.response_format not in (None, {"type": "text"}):
            refuse("response_format", "other than text is not supported by zerolite serve")


def check_model(body: Common, served: ServedModel) -> None:
    if body.model != served.name:
        raise BadRequest(f"model {body.model!r} is not served here: this server serves {served.name!r} "
                         "(GET /v1/models)",
                         code="model_not_found", param="model")


def completion_prompts(body: CompletionRequest, served: ServedModel) -> list[list[int]]:
    """Token ids of each prompt the request holds."""
    prompt = body.prompt
    several = isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], (str, list))
    count = len(prompt) if several else 1
    if not prompt:
        raise BadRequest("'prompt' is empty", param="prompt", code="empty_prompt")
    if count * body.n > MAX_N:  # before any tokenizing: a list of 100,000 prompts costs nothing to refuse
        raise BadRequest(f"{count} prompts with n={body.n} make {count * body.n} choices; "
                         f"one request takes at most {MAX_N}", param="prompt")
    with bad_prompt("prompt"):
        if isinstance(prompt, str) or isinstance(prompt[0], str):
            texts = [prompt] if isinstance(prompt, str) else prompt
            prompts = [encode_text(served.tokenizer, text) for text in texts]
        else:
            prompts = prompt if several else [prompt]
        for ids in prompts:
            check_prompt(ids, served)
    return prompts


def chat_prompt(body: ChatRequest, served: ServedModel) -> list[int]:
    with bad_prompt("messages"):
        ids = encode_chat(served.tokenizer, [m.plain() for m in body.messages])
    with bad_prompt("prompt"):
        check_prompt(ids, served)
    return ids


@contextmanager
def bad_prompt(param: str):
    """text's PromptError as a 400 naming the request's parameter."""
    try:
        yield
    except PromptError as e:
        raise BadRequest(f"{e}: {FIXES[e.code]}", param=param, code=e.code) from None


def check_prompt(ids: list[int], served: ServedModel) -> None:
    check_ids(ids, served.vocab_size)
    if len(ids) > served.max_prompt_tokens or len(ids) >= served.context:
        limit = min(served.max_prompt_tokens, served.context - 1)
        raise BadRequest(f"the prompt is {len(ids)} tokens, and this server takes at most {limit}: shorten it",
                         param="prompt", code="context_length_exceeded")


def sequences(body: Common, prompts: list[list[int]], served: ServedModel, asked_max: int | None,
              default_max: int | None) -> list[Sequence]:
    """A Sequence for each prompt, n times over, with its limits checked."""
    out = []
    for i, ids in enumerate(prompts):
        room = served.context - len(ids)
        max_tokens = asked_max if asked_max is not None else min(default_max or room, room, served.max_tokens)
        if max_tokens > served.max_tokens:
            raise BadRequest(f"max_tokens is {max_tokens}, and this server generates at most {served.max_tokens} "
                             "tokens per request: ask for fewer", param="max_tokens", code="invalid_value")
        if max_tokens > room:
            raise BadRequest(f"the prompt is {len(ids)} tokens and max_tokens {max_tokens}: together they pass the "
                             f"context of {served.context} tokens; ask for {room} or fewer",
                             param="max_tokens", code="context_length_exceeded")
        for j in range(body.n):
            choice = TokenChoice(sampling(body, None if body.seed is None else body.seed + j), served.vocab_size)
            text = TextStream(served.tokenizer, stop_strings(body)) if served.tokenizer is not None else None
            stop_ids = frozenset() if body.ignore_eos else served.eos_ids
            out.append(Sequence(i * body.n + j, ids, max_tokens, choice, text, stop_ids))
    return out


def sampling(body: Common, seed: int | None) -> Sampling:
    temperature = 1.0 if body.temperature is None else body.temperature
    return Sampling(
        sample=temperature >= GREEDY_BELOW,
        temperature=temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=max(body.top_k or 0, 0),
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        seed=seed,
    )


def stop_strings(body: Common) -> list[str]:
    return [body.stop] if isinstance(body.stop, str) else list(body.stop or [])


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def error_body(message: str, status: int, code: str | None = None, param: str | None = None) -> dict:
    """OpenAI's error object for an answer of HTTP status."""
    kind = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def model_card(served: ServedModel) -> dict:
    return {"id": served.name, "object": "model", "created": served.created, "owned_by": "zerolite",
            "max_model_len": served.context}


def now() -> int:
    return int(time.time())
