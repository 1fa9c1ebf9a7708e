"""`zerolite profile`: the trace shows reads overlapping compute, the verdicts name the right limit."""

from __future__ import annotations

import json
import time

import pytest

import zerolite
from support.cli_runner import run
from support.simulated_device import SimulatedDevice
from zerolite.io.engine import IoEngine
from zerolite.planner.machine import measure_disk
from zerolite.profile.run import profile_run
from zerolite.runtime.timeline import Timeline

SLOW_DISK_S = 0.03  # a layer's read on a slow disk: 8 make a step take 240 ms, several times its compute


def slow_disk(monkeypatch) -> None:
    """IoEngine as a disk that reads one request every SLOW_DISK_S, in the order submitted: a
    ticket's bytes count as arrived (poll, wait) only once its turn has passed."""
    due: dict[int, float] = {}
    submit, wait, poll = IoEngine.submit, IoEngine.wait, IoEngine.poll

    def slow_submit(engine, *args, **kwargs):
        ticket = submit(engine, *args, **kwargs)
        due[ticket] = max([time.perf_counter(), *due.values()]) + SLOW_DISK_S
        return ticket

    def slow_wait(engine, ticket, *args, **kwargs):
        time.sleep(max(due.get(ticket, 0.0) - time.perf_counter(), 0.0))
        return max(wait(engine, ticket, *args, **kwargs), due.get(ticket, 0.0))

    def slow_poll(engine, ticket):
        return poll(engine, ticket) if time.perf_counter() >= due.get(ticket, 0.0) else None

    monkeypatch.setattr(IoEngine, "submit", slow_submit)
    monkeypatch.setattr(IoEngine, "wait", slow_wait)
    monkeypatch.setattr(IoEngine, "poll", slow_poll)


@pytest.fixture(scope="module")
def layout(make_layout):
    """A 300 MB fp32 Llama of 8 layers of 38 MB: big enough that reading a layer takes as long as
    computing it for a batch of 64 on two CPU cores, small enough to build in seconds."""
    return make_layout("llama", layers=8, tie=False, vocab_size=256, hidden_size=768, intermediate_size=3072,
                       num_attention_heads=12, num_key_value_heads=12, max_position_embeddings=128)


def profiled(layout, offload: str, depth: int, batch: int, new_tokens: int = 5, device="cpu"):
    timeline = Timeline()
    with zerolite.load(layout, offload=offload, device=device, prefetch_depth=depth, timeline=timeline, cpu_memory=0,
                       gpu_memory=0, show_progress=False) as lm:
        return profile_run(lm, timeline, batch, new_tokens, prompt_tokens=8), timeline


@pytest.mark.alone
def test_trace_shows_the_next_read_overlapping_compute_from_depth_2(capsys, monkeypatch, tmp_path, layout):
    for depth in (1, 2, 4):
        trace_file = tmp_path / f"trace-{depth}.json"
        result = run(capsys, monkeypatch, "profile", "--model", layout, "--device", "cpu", "--cpu-memory", "0",
                     "--prefetch-depth", str(depth), "--new-tokens", "4", "--json", "--trace", trace_file)
        assert result.code == 0, result.stderr
        trace = json.loads(trace_file.read_text())
        names = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"]
                 if e["ph"] == "M" and e["name"] == "thread_name"}
        spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
        tracks = {names[e["tid"]] for e in spans}
        assert {"reads (disk)", "compute", "steps"} <= tracks
        reads = [e for e in spans if names[e["tid"]] == "reads (disk)"]
        # Decode steps: in the first forward each block is also checked against its checksum.
        prefill_end = min(e["ts"] + e["dur"] for e in spans if names[e["tid"]] == "steps")
        computes = [e for e in spans if names[e["tid"]] == "compute" and e["ts"] > prefill_end]
        overlapping = 0
        for compute in computes:
            index = int(compute["name"].removeprefix("layers."))
            if index == 7:
                continue
            begin, end = compute["ts"], compute["ts"] + compute["dur"]
            nxt = f"layers.{index + 1}"
            overlapping += any(r["name"] == nxt and r["ts"] < end and r["ts"] + r["dur"] > begin for r in reads)
        pairs = sum(1 for c in computes if c["name"] != "layers.7")
        if depth == 1:
            assert overlapping == 0  # nothing is read ahead: the test can tell the difference
        else:
            assert overlapping >= 0.9 * pairs, f"depth {depth}: {overlapping} of {pairs} reads overlap compute"


@pytest.mark.alone
def test_verdict_disk_bound_when_every_block_streams_for_a_small_batch(layout):
    report, _ = profiled(layout, "nvme", depth=6, batch=1)  # 5 layers (190 MB) read ahead: the disk is kept full
    assert report.bottleneck == "disk", report.verdict
    # The step's reads are set against the read-only pass of the same blocks, repeated as decode repeats them.
    assert report.verdict.startswith("disk-bound")
    assert "% of the read-only pass's" in report.verdict, report.verdict
    assert 0.5 < report.share_of_bound < 1.5, report  # the same reads: neither far above nor far below
    # An fp32 layout: int4 or int8 weights, and a 16-bit layout, are what move fewer bytes.
    assert any("--weights int4" in advice and "--weights int8" in advice and "--dtype bf16" in advice
               for advice in report.advice), report.advice
    assert not report.slow_prefill, report


def test_a_16_bit_layout_is_not_advised_a_16_bit_layout(make_layout):
    layout = make_layout("llama", layers=2, dtype="bf16")
    report, _ = profiled(layout, "nvme", depth=2, batch=1, new_tokens=3)
    advice = " ".join(report.advice)
    assert report.dtype == "bfloat16"
    assert "--dtype" not in advice and "bf16" not in advice, advice
    if report.bottleneck == "disk":  # a tiny model may also be compute-bound here
        assert "--weights int4" in advice and "0.28x" in advice, advice


def test_an_int4_layout_not_in_bf16_is_advised_bf16_for_its_kernel(make_layout):
    fp32 = profiled(make_layout("llama", layers=2, weights="int4", group_size=32), "nvme", depth=2, batch=1,
                    new_tokens=3)[0]
    bf16 = profiled(make_layout("llama", layers=2, dtype="bf16", weights="int4", group_size=32), "nvme", depth=2,
                    batch=1, new_tokens=3)[0]
    assert fp32.weights == "int4", fp32.advice
    assert any("--dtype bf16 --weights int4" in advice for advice in fp32.advice), fp32.advice
    assert not any("--dtype bf16" in advice for advice in bf16.advice), bf16.advice
    assert not any("--weights int4" in advice for advice in bf16.advice), bf16.advice  # it is int4 already


def test_a_prefill_slow_for_its_size_is_flagged(layout):
    """A prefill made slow the way torch's CPU slow path makes it: each layer's compute sleeps
    when it sees more than one position, and only then."""
    timeline = Timeline()
    with zerolite.load(layout, offload="nvme", device="cpu", timeline=timeline, cpu_memory=0,
                       show_progress=False) as lm:
        for layer in lm.model.model.layers:
            layer.register_forward_pre_hook(lambda module, args: time.sleep(0.1) if args[0].shape[1] > 1 else None)
        report = profile_run(lm, timeline, batch_size=1, new_tokens=4, prompt_tokens=2)
    assert report.slow_prefill, report
    assert "prefill is slow for its size" in report.verdict
    assert report.prefill_compute_per_token_s > 2 * report.decode_compute_per_token_s
    assert any("--trace" in advice for advice in report.advice)


def test_verdict_compute_bound_with_everything_resident_and_a_large_batch(layout):
    report, _ = profiled(layout, "none", depth=2, batch=64)
    assert report.bottleneck == "compute" and report.io_s == 0, report.verdict


@pytest.mark.alone
def test_verdict_disk_bound_on_a_gpu_counts_the_device_idle_while_the_host_waits_for_reads(layout, monkeypatch):
    """On a GPU the host waits for the disk and the device idles meanwhile: that idle is compute
    waiting. A wait timed only from where the host queued it (after the read) missed it, and an
    H200 streaming 1.6 GB a step from a 2.2 GB/s disk was called compute-bound (679 of 707 ms).
    The engine's reads are held to one every SLOW_DISK_S, in turn: a disk slower than compute on
    any machine (the host's cache under this VM's disk may read these 300 MB faster than two cores
    compute them)."""
    slow_disk(monkeypatch)
    report, timeline = profiled(layout, "nvme", depth=6, batch=1, device=SimulatedDevice(seed=0))
    assert timeline.on("read wait"), "the host never waited for a read: nothing to count"
    assert report.bottleneck == "disk", report.verdict
    assert report.wait_s > report.compute_s, report


@pytest.mark.alone
def test_verdict_prefetch_starved_at_depth_1(layout):
    report, _ = profiled(layout, "nvme", depth=1, batch=64)
    assert report.bottleneck == "prefetch", report.verdict
    assert any("--prefetch-depth" in advice for advice in report.advice)


def test_profile_step_matches_the_timeline_it_draws(capsys, monkeypatch, tmp_path, layout):
    result = run(capsys, monkeypatch, "profile", "--model", layout, "--device", "cpu", "--new-tokens", "3", "--json",
                 "--plot", tmp_path / "timeline.png")
    assert result.code == 0, result.stderr
    report = json.loads(result.stdout)
    assert set(report) >= {"decode_step_s", "achieved_read_gbps", "share_of_bound", "overlap", "verdict", "advice"}
    assert (tmp_path / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_disk_only_reports_read_gbps(capsys, monkeypatch, tmp_path, layout):
    result = run(capsys, monkeypatch, "profile", "--disk", layout, "--json")
    assert result.code == 0, result.stderr
    assert json.loads(result.stdout)["read_gbps"] > 0
    scratch = measure_disk(tmp_path, scratch_bytes=64 << 20)  # a folder: a scratch file is written, read, removed
    assert scratch["read_gbps"] > 0 and list(tmp_path.iterdir()) == []
