"""zerolite serve over HTTP on 127.0.0.1: tokens equal to zerolite generate's whatever shares the
batch, the openai client and curl, disconnects, a full queue, bad requests, an API key, SIGTERM.

Every client loop here is bounded (a count, and httpx timeouts) so that a hung server fails the
test instead of hanging it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

import zerolite
from support.cli_runner import assert_one_line_error, run, run_tool
from support.helpers import new_tokens_alone
from support.live_server import LiveServer
from support.tiny_models import CHAT_TEMPLATE, save_ascii_tokenizer
from zerolite.convert.writer import convert
from zerolite.serve.server import ServeSettings

TIMEOUT = httpx.Timeout(60.0)
NEW_TOKENS = 12
LENGTHS = (3, 11, 1, 7, 19, 5)


def random_prompts(seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 128, (n,), generator=generator).tolist() for n in LENGTHS]


def complete(url: str, prompt, stream: bool, model: str, **extra) -> dict:
    """One /v1/completions request: its token ids, text and finish reason (a stream's pieces joined)."""
    body = {"model": model, "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0, "return_token_ids": True,
            "stream": stream, **extra}
    if not stream:
        answer = httpx.post(url + "/v1/completions", json=body, timeout=TIMEOUT)
        assert answer.status_code == 200, answer.text
        choice = answer.json()["choices"][0]
        return {"ids": choice["token_ids"], "text": choice["text"], "reason": choice["finish_reason"]}
    ids, text, reason = [], "", None
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=TIMEOUT) as answer:
        assert answer.status_code == 200
        lines = [line for line in answer.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    for line in lines[:-1]:
        choice = json.loads(line.removeprefix("data: "))["choices"][0]
        ids += choice.get("token_ids", [])
        text += choice["text"]
        reason = choice["finish_reason"] or reason
    return {"ids": ids, "text": text, "reason": reason}


def generate_cli(capsys, monkeypatch, tmp_path, layout, prompts: list[list[int]]) -> list[list[int]]:
    """zerolite generate's token ids for each prompt, run one at a time."""
    requests = tmp_path / "prompts.jsonl"
    requests.write_text("".join(json.dumps({"id": str(i), "input_ids": p}) + "\n" for i, p in enumerate(prompts)))
    out = tmp_path / "out.jsonl"
    result = run(capsys, monkeypatch, "generate", "--model", layout, "--offload", "nvme", "--device", "cpu",
                 "--input", requests, "--output", out, "--max-new-tokens", NEW_TOKENS, "--batch-size", 1)
    assert result.code == 0, result.stderr
    lines = {row["id"]: row["token_ids"] for row in map(json.loads, out.read_text().splitlines())}
    return [lines[str(i)] for i in range(len(prompts))]


@pytest.mark.parametrize("arch", ["llama", "bloom", "gpt2", "opt"])
def test_each_client_gets_the_tokens_zerolite_generate_gives_its_prompt(arch, make_layout, capsys, monkeypatch,
                                                                         tmp_path):
    layout = make_layout(arch)
    prompts = random_prompts()
    expected = generate_cli(capsys, monkeypatch, tmp_path, layout, prompts)
    with zerolite.load(layout, offload="nvme", device="cpu", show_progress=False) as lm:
        # 4 rows for 6 clients: some wait; 8 tokens a step: the longer prompts join over several steps
        with LiveServer(lm, ServeSettings(max_batch=4, step_tokens=8)) as server:
            def client(i):
                time.sleep(0.01 * i)  # arrivals spread over the first steps
                return complete(server.url, prompts[i], stream=i % 2 == 0, model=server.served.name)

            with ThreadPoolExecutor(len(prompts)) as pool:
                answers = list(pool.map(client, range(len(prompts))))
            steps = server.metric("zerolite_step_seconds_count")
            generated = server.metric("zerolite_generated_tokens_total")
    assert [a["ids"] for a in answers] == expected
    assert steps < generated, "no step served two clients"


@pytest.mark.cuda
def test_the_decode_loop_runs_the_model_on_a_gpu_from_its_own_thread(make_layout, gpu):
    prompts = random_prompts(1)[:4]
    with zerolite.load(make_layout("llama"), offload="nvme", device=gpu, gpu_memory=0, kv_offload=0.5,
                       show_progress=False) as lm:
        assert lm.plan.streamed == tuple(lm.layout.manifest.layer_names)  # every layer through the ring
        expected = [new_tokens_alone(lm, p, NEW_TOKENS) for p in prompts]
        with LiveServer(lm, ServeSettings(max_batch=3, step_tokens=8)) as server:
            with ThreadPoolExecutor(len(prompts)) as pool:
                answers = list(pool.map(lambda p: complete(server.url, p, True, server.served.name), prompts))
    assert [a["ids"] for a in answers] == expected


@pytest.fixture(scope="module")
def chat_layout(make_source, tmp_path_factory):
    """A tiny llama with a tokenizer (one token per ASCII character) and a chat template."""
    source = make_source("llama", seed=3, fresh=True)
    save_ascii_tokenizer(source, CHAT_TEMPLATE)
    layout = tmp_path_factory.mktemp("chat") / "layout"
    convert(source, layout, show_progress=False)
    return layout


@pytest.fixture(scope="module")
def chat_lm(chat_layout):
    with zerolite.load(chat_layout, offload="nvme", device="cpu", show_progress=False) as lm:
        yield lm


def test_the_openai_client_and_curl_work_streaming_and_not(chat_lm):
    from openai import OpenAI

    lm = chat_lm
    prompt = "The quick brown fox"
    ids = lm.tokenizer(prompt).input_ids
    alone = new_tokens_alone(lm, ids, NEW_TOKENS)
    # the end token ends the text, and has none of its own (this tokenizer would spell it \x02)
    expected_text = lm.tokenizer.decode(alone[:-1] if alone[-1] == lm.generation_config.eos_token_id else alone)
    with LiveServer(lm) as server:
        name = server.served.name
        client = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        assert [m.id for m in client.models.list().data] == [name]

        whole = client.completions.create(model=name, prompt=prompt, max_tokens=NEW_TOKENS, temperature=0)
        assert whole.choices[0].text == expected_text
        assert whole.usage.prompt_tokens == len(ids) and whole.usage.completion_tokens == len(alone)
        pieces = client.completions.create(model=name, prompt=prompt, max_tokens=NEW_TOKENS, temperature=0, stream=True)
        assert "".join(chunk.choices[0].text for chunk in pieces) == expected_text

        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
        chat = client.chat.completions.create(model=name, messages=messages, max_tokens=NEW_TOKENS, temperature=0)
        assert chat.choices[0].message.role == "assistant" and chat.choices[0].finish_reason in ("stop", "length")
        chunks = list(client.chat.completions.create(model=name, messages=messages, max_tokens=NEW_TOKENS,
                                                     temperature=0, stream=True,
                                                     stream_options={"include_usage": True}))
        assert chunks[0].choices[0].delta.role == "assistant"
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat.choices[0].message.content
        assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == chat.usage.total_tokens

        curl = shutil.which("curl")
        assert curl is not None, "curl is part of the set-up this test runs in"
        body = json.dumps({"model": name, "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0})
        done = subprocess.run([curl, "-sS", "--max-time", "60", server.url + "/v1/completions", "-H",
                               "Content-Type: application/json", "-d", body],
                              capture_output=True, text=True, timeout=90)
        assert json.loads(done.stdout)["choices"][0]["text"] == expected_text
        streamed = json.dumps({"model": name, "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0,
                               "stream": True})
        done = subprocess.run([curl, "-sSN", "--max-time", "60", server.url + "/v1/completions", "-H",
                               "Content-Type: application/json", "-d", streamed],
                              capture_output=True, text=True, timeout=90)
        events = [line.removeprefix("data: ") for line in done.stdout.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]) == expected_text


def test_stop_strings_n_and_seeds(chat_lm):
    lm = chat_lm
    with LiveServer(lm) as server:
        url, name = server.url, server.served.name
        full = complete(url, "abc", stream=False, model=name)["text"]
        assert len(full) >= 5, full
        stop = full[3:5]
        cut = complete(url, "abc", stream=True, model=name, stop=[stop, "never"])
        assert cut["text"] == full[:full.index(stop)] and cut["reason"] == "stop"

        sampled = {"model": name, "prompt": "abc", "max_tokens": 8, "temperature": 1.0, "seed": 7, "n": 3}
        first = httpx.post(url + "/v1/completions", json=sampled, timeout=TIMEOUT).json()["choices"]
        with ThreadPoolExecutor(4) as pool:  # the same seed, now beside other requests
            others = [pool.submit(complete, url, "xyz" * k, False, name) for k in (1, 2, 3)]
            again = httpx.post(url + "/v1/completions", json=sampled, timeout=TIMEOUT).json()["choices"]
            [o.result() for o in others]
    assert [c["index"] for c in first] == [0, 1, 2]
    assert [c["text"] for c in again] == [c["text"] for c in first]


def test_clients_that_disconnect_mid_stream_are_cancelled_and_the_others_served(make_layout):
    with zerolite.load(make_layout("llama"), offload="nvme", device="cpu", show_progress=False) as lm:
        with LiveServer(lm, ServeSettings(max_batch=32)) as server:
            name = server.served.name
            body = {"model": name, "prompt": [5, 6, 7], "max_tokens": 200, "temperature": 0, "stream": True,
                    "ignore_eos": True}

            def leave_early(_):
                with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=TIMEOUT) as answer:
                    for count, _ in enumerate(answer.iter_lines()):
                        if count >= 4:
                            return True  # leaving the block closes the connection mid-stream
                return False

            with ThreadPoolExecutor(21) as pool:
                stayer = pool.submit(complete, server.url, [9, 8, 7, 6], True, name, max_tokens=200)
                left = list(pool.map(leave_early, range(20)))
                kept = stayer.result()
            server.wait_idle()
            health = httpx.get(server.url + "/health", timeout=TIMEOUT)
            cancelled = httpx.get(server.url + "/metrics", timeout=TIMEOUT).text
        alone = new_tokens_alone(lm, [9, 8, 7, 6], 200)
    assert all(left)
    assert kept["ids"] == alone
    assert health.status_code == 200
    assert 'zerolite_sequences_finished_total{reason="cancelled"} 20.0' in cancelled


def test_a_client_that_gives_up_on_a_whole_answer_is_cancelled(make_layout, monkeypatch):
    with zerolite.load(make_layout("llama"), offload="nvme", device="cpu", show_progress=False) as lm:
        with LiveServer(lm) as server:
            step = server.decode_loop.batch.step
            # 240 steps: 2.4 s at least
            monkeypatch.setattr(server.decode_loop.batch, "step", lambda: time.sleep(0.01) or step())
            body = {"model": server.served.name, "prompt": [5, 6, 7], "max_tokens": 240, "ignore_eos": True}
            with pytest.raises(httpx.TimeoutException):
                httpx.post(server.url + "/v1/completions", json=body, timeout=0.3)
            server.wait_idle(timeout_s=2)  # well before the 240 tokens would have been done
            metrics = httpx.get(server.url + "/metrics", timeout=TIMEOUT).text
    assert 'zerolite_sequences_finished_total{reason="cancelled"} 1.0' in metrics


def test_a_full_queue_answers_429_with_retry_after(make_layout, monkeypatch):
    with zerolite.load(make_layout("llama"), offload="nvme", device="cpu", show_progress=False) as lm:
        with LiveServer(lm, ServeSettings(max_batch=1, max_queue=0)) as server:
            name = server.served.name
            gate = threading.Event()  # holds the decode loop's steps, so the one place stays taken
            step = server.decode_loop.batch.step
            monkeypatch.setattr(server.decode_loop.batch, "step", lambda: gate.wait(timeout=60) and step())
            with ThreadPoolExecutor(1) as pool:
                first = pool.submit(complete, server.url, [5, 6, 7], False, name, ignore_eos=True)
                deadline = time.monotonic() + 30
                while not server.metric("zerolite_active_sequences"):
                    assert time.monotonic() < deadline
                    time.sleep(0.02)
                refused = httpx.post(server.url + "/v1/completions", json={"model": name, "prompt": [5]},
                                     timeout=TIMEOUT)
                never = httpx.post(server.url + "/v1/completions", json={"model": name, "prompt": [5], "n": 2},
                                   timeout=TIMEOUT)  # more than the batch and the queue hold together
                gate.set()
                assert first.result()["reason"] == "length"
            later = complete(server.url, [5, 6, 7], False, name, ignore_eos=True)
    assert refused.status_code == 429
    assert int(refused.headers["retry-after"]) >= 1
    assert refused.json()["error"]["code"] == "queue_full"
    assert never.status_code == 400 and "ask for fewer" in never.json()["error"]["message"]
    assert later["reason"] == "length"


def test_a_step_that_fails_answers_its_requests_with_500_and_the_server_serves_on(make_layout, monkeypatch, capsys):
    with zerolite.load(make_layout("llama"), offload="nvme", device="cpu", show_progress=False) as lm:
        with LiveServer(lm) as server:
            name = server.served.name
            step = server.decode_loop.batch.step
            failures = iter([RuntimeError("disk on fire")])

            def failing_once():
                for failure in failures:
                    raise failure
                return step()

            monkeypatch.setattr(server.decode_loop.batch, "step", failing_once)
            failed = httpx.post(server.url + "/v1/completions", json={"model": name, "prompt": [5, 6]}, timeout=TIMEOUT)
            add = server.decode_loop.batch.add
            joins = iter([MemoryError("no room for the K/V")])

            def joining_fails_once(rows):
                for failure in joins:
                    raise failure
                return add(rows)

            monkeypatch.setattr(server.decode_loop.batch, "add", joining_fails_once)
            refused = httpx.post(server.url + "/v1/completions", json={"model": name, "prompt": [5, 6]},
                                 timeout=TIMEOUT)
            alive = httpx.get(server.url + "/health", timeout=TIMEOUT).status_code
            streamed = complete(server.url, [9, 8, 7, 6], True, name)
            whole = complete(server.url, [9, 8, 7, 6], False, name)
    assert failed.status_code == 500
    assert failed.json()["error"] == {"message": "internal error in a step: RuntimeError: disk on fire",
                                      "type": "server_error", "param": None, "code": "internal_error"}
    assert "disk on fire" in capsys.readouterr().err  # the traceback, in the server's log
    assert refused.status_code == 500 and "MemoryError" in refused.json()["error"]["message"]
    assert alive == 200
    assert streamed["ids"] == whole["ids"] and len(whole["ids"]) == NEW_TOKENS


def test_without_a_key_only_loopback_hosts_and_json_bodies_are_answered(chat_lm):
    """A web page can POST a form or text/plain to 127.0.0.1 without asking, and a name of its own
    can resolve to 127.0.0.1 (DNS rebinding): neither reaches the model."""
    with LiveServer(chat_lm) as server:
        body = json.dumps({"model": server.served.name, "prompt": "hi", "max_tokens": 2})
        plain = httpx.post(server.url + "/v1/completions", content=body, headers={"Content-Type": "text/plain"},
                           timeout=TIMEOUT)
        rebound = httpx.post(server.url + "/v1/completions", content=body, timeout=TIMEOUT,
                             headers={"Content-Type": "application/json", "Host": "attacker.example:8000"})
        local = httpx.post(server.url + "/v1/completions", content=body, timeout=TIMEOUT,
                           headers={"Content-Type": "application/json", "Host": "localhost"})
    assert plain.status_code == 415 and "application/json" in plain.json()["error"]["message"]
    assert rebound.status_code == 403 and "--api-key" in rebound.json()["error"]["message"]
    assert local.status_code == 200


def test_sampling_edges_neither_fail_nor_fail_others(chat_lm):
    with LiveServer(chat_lm) as server:
        name = server.served.name
        greedy = complete(server.url, "abc", False, name)
        tiny = complete(server.url, "abc", False, name, temperature=1e-45)        # would overflow as a divisor
        top_seed = complete(server.url, "abc", False, name, temperature=1.0, seed=2**63 - 1, n=2)
    assert tiny["ids"] == greedy["ids"]
    assert top_seed["reason"] in ("stop", "length")


KEY = "s3cret-key"
GOOD = {"model": "MODEL", "prompt": "hello", "max_tokens": 4}
CHAT = {"model": "MODEL", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
BAD_REQUESTS = [
    # (why, method, path, body (dict, or raw bytes), headers over the good ones, status, in the message)
    ("malformed JSON", "POST", "/v1/completions", b'{"model": ', {}, 400, "not valid JSON"),
    ("body not an object", "POST", "/v1/completions", b"[1, 2]", {}, 400, "JSON object"),
    ("no model", "POST", "/v1/completions", {"prompt": "hi"}, {}, 400, "'model' is required"),
    ("unknown model", "POST", "/v1/completions", {**GOOD, "model": "gpt-9"}, {}, 400, "not served here"),
    ("no prompt", "POST", "/v1/completions", {"model": "MODEL"}, {}, 400, "'prompt' is required"),
    ("prompt of the wrong type", "POST", "/v1/completions", {**GOOD, "prompt": 42}, {}, 400, "'prompt' must be"),
    ("empty prompt", "POST", "/v1/completions", {**GOOD, "prompt": ""}, {}, 400, "empty"),
    ("prompt too long", "POST", "/v1/completions", {**GOOD, "prompt": "x" * 300}, {}, 400, "shorten it"),
    ("token id past the vocabulary", "POST", "/v1/completions", {**GOOD, "prompt": [1, 5000]}, {}, 400,
     "token id 5000"),
    ("max_tokens 0", "POST", "/v1/completions", {**GOOD, "max_tokens": 0}, {}, 400, "max_tokens"),
    ("max_tokens past the context", "POST", "/v1/completions", {**GOOD, "max_tokens": 10_000}, {}, 400, "max_tokens"),
    ("temperature out of range", "POST", "/v1/completions", {**GOOD, "temperature": 7}, {}, 400, "temperature"),
    ("top_p out of range", "POST", "/v1/completions", {**GOOD, "top_p": 0}, {}, 400, "top_p"),
    ("too many choices", "POST", "/v1/completions", {**GOOD, "n": 100}, {}, 400, "n"),
    ("a typo'd parameter", "POST", "/v1/completions", {**GOOD, "max_token": 5}, {}, 400,
     "unknown parameter 'max_token'"),
    ("logprobs", "POST", "/v1/completions", {**GOOD, "logprobs": 3}, {}, 400, "logprobs"),
    ("stream_options without stream", "POST", "/v1/completions", {**GOOD, "stream_options": {"include_usage": True}},
     {}, 400, "stream_options"),
    ("stream not a boolean", "POST", "/v1/completions", {**GOOD, "stream": "maybe"}, {}, 400, "stream"),
    ("too many stop strings", "POST", "/v1/completions", {**GOOD, "stop": list("abcde")}, {}, 400, "stop"),
    ("no messages", "POST", "/v1/chat/completions", {**CHAT, "messages": []}, {}, 400, "messages"),
    ("a message's role", "POST", "/v1/chat/completions", {**CHAT, "messages": [{"role": "boss", "content": "x"}]},
     {}, 400, "role"),
    ("tools", "POST", "/v1/chat/completions", {**CHAT, "tools": [{"type": "function"}]}, {}, 400, "tools"),
    ("no API key", "POST", "/v1/completions", GOOD, {"Authorization": ""}, 401, "API key"),
    ("a wrong API key", "GET", "/v1/models", None, {"Authorization": "Bearer guess"}, 401, "API key"),
    ("unknown endpoint", "POST", "/v1/embeddings", GOOD, {}, 404, "no endpoint"),
    ("wrong method", "GET", "/v1/completions", None, {}, 405, "not allowed"),
    ("body too large", "POST", "/v1/completions", {**GOOD, "prompt": "x" * 5000}, {}, 413, "over 4096 bytes"),
    ("JSON nested past the stack", "POST", "/v1/completions", b"[" * 4000, {}, 400, "not valid JSON"),
    ("a seed past 64 bits", "POST", "/v1/completions", {**GOOD, "seed": 2**64}, {}, 400, "seed"),
    ("a form, not JSON", "POST", "/v1/completions", b"model=MODEL&prompt=hi",
     {"Content-Type": "application/x-www-form-urlencoded"}, 415, "must be JSON"),
]


def test_bad_requests_get_a_4xx_with_a_message_and_the_server_serves_on(chat_lm):
    settings = ServeSettings(api_key=KEY, max_request_bytes=4096, max_context=256)
    with LiveServer(chat_lm, settings) as server:
        name = server.served.name
        with httpx.Client(base_url=server.url, timeout=TIMEOUT,
                          headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}) as http:
            for why, method, path, body, headers, status, fragment in BAD_REQUESTS:
                if isinstance(body, dict):
                    body = json.dumps(body).replace("MODEL", name).encode()
                answer = http.request(method, path, content=body, headers=headers)
                assert answer.status_code == status, (why, answer.text)
                message = answer.json()["error"]["message"]
                assert fragment in message, (why, message)
            assert http.get("/health").status_code == 200
            # greedy: a draw could end early
            good = http.post("/v1/completions", json={**GOOD, "model": name, "temperature": 0})
            assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] == 4
            assert httpx.get(server.url + "/health", timeout=TIMEOUT).status_code == 200  # no key needed there
    assert len({why for why, *_ in BAD_REQUESTS}) >= 15


def test_serve_refuses_bad_flags_in_one_line(capsys, monkeypatch):
    result = run(capsys, monkeypatch, "serve", "--host", "0.0.0.0", "--port", "0")
    assert_one_line_error(result, "--api-key", "--insecure")
    result = run(capsys, monkeypatch, "serve", "--max-batch", "lots")
    assert_one_line_error(result, "--max-batch 'lots'")
    result = run(capsys, monkeypatch, "serve", "--draft", "self-int4")
    assert_one_line_error(result, "--draft", "batch 1")
    with __import__("socket").socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        result = run(capsys, monkeypatch, "serve", "--port", taken.getsockname()[1])
    assert_one_line_error(result, "is in use", "--port")


def test_sigterm_under_load_finishes_or_answers_every_request(make_layout):
    layout = make_layout("llama", layers=6)
    server = subprocess.Popen([sys.executable, "-m", "zerolite", "serve", "--model", str(layout), "--device", "cpu",
                               "--port", "0", "--drain-timeout", "1", "--max-batch", "8"],
                              stderr=subprocess.PIPE, text=True, env={**os.environ, "TQDM_DISABLE": "1"})
    try:
        for _, line in zip(range(10), server.stderr):  # the plan's lines, then where it listens
            if match := re.search(r"http://127\.0\.0\.1:(\d+)/v1", line):
                break
        assert match, line
        url = f"http://127.0.0.1:{match[1]}"
        name = layout.name

        def long_stream(_):
            body = {"model": name, "prompt": [5, 6, 7], "max_tokens": 240, "temperature": 0, "stream": True,
                    "ignore_eos": True}
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=TIMEOUT) as answer:
                events = [line.removeprefix("data: ") for line in answer.iter_lines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]", events[-3:]
            last = json.loads(events[-2])
            return "error" if "error" in last else last["choices"][0]["finish_reason"]

        def whole(_):
            body = {"model": name, "prompt": [9, 9], "max_tokens": 240, "temperature": 0, "ignore_eos": True}
            answer = httpx.post(url + "/v1/completions", json=body, timeout=TIMEOUT)
            assert answer.status_code in (200, 503), answer.text
            return "error" if answer.status_code == 503 else answer.json()["choices"][0]["finish_reason"]

        with ThreadPoolExecutor(6) as pool:
            futures = [pool.submit(long_stream, i) for i in range(4)] + [pool.submit(whole, i) for i in range(2)]
            deadline = time.monotonic() + 60
            while in_flight(url) < 6:  # every client's request is in the decode loop, none done yet (240 tokens each)
                assert time.monotonic() < deadline, "the clients' requests did not all arrive"
                time.sleep(0.01)
            server.send_signal(signal.SIGTERM)
            outcomes = [f.result(timeout=60) for f in futures]
        code = server.wait(timeout=60)
    finally:
        if server.poll() is None:
            server.kill()
    assert code == 0, server.stderr.read()
    assert set(outcomes) <= {"length", "stop", "error"} and len(outcomes) == 6


def in_flight(url: str) -> float:
    """Sequences running or waiting, from the server's /metrics."""
    text = httpx.get(url + "/metrics", timeout=TIMEOUT).text
    return sum(float(v) for v in re.findall(r"^zerolite_(?:active_sequences|queue_depth) (\S+)$", text, re.M))


def test_the_benchmark_runs_end_to_end(capsys, monkeypatch, make_layout, tmp_path):
    """tools/bench_serve.py on a tiny layout: a server process of its own, 1 client then 4."""
    figures, picture = tmp_path / "serve.json", tmp_path / "clients.png"
    # The machine's page cache left as it is (as root the tool drops it before each phase): dropping it
    # would slow every test running beside this one, and a tiny layout's reads time nothing here.
    monkeypatch.setattr("bench_serve.drop_page_cache", lambda: True)
    done = run_tool(capsys, monkeypatch, "bench_serve", "--model", make_layout("llama", layers=4), "--clients", "4",
                    "--prompt-tokens", "5", "--new-tokens", "6", "--spread", "0.2", "--json", figures,
                    "--plot", picture)
    assert done.code == 0, done.stderr
    report = json.loads(figures.read_text())
    assert [phase["tokens"] for phase in report["phases"].values()] == [6, 24]
    assert all(phase["ttft_p95_s"] >= phase["ttft_median_s"] > 0 for phase in report["phases"].values())
    assert report["speed_up"] > 0 and picture.stat().st_size > 0
    assert "over 1 client" in done.stdout
