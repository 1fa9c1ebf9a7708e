"""tools/gpu_quick.py's streaming steps: the 70B-shaped folder streamed in place through zerolite.load
in each of STREAM_CASES' policies, and a torch.profiler trace of two decode steps summarised as the
copy stream's busy share, its longest gap and the copies' overlap with kernels."""

from __future__ import annotations

import contextlib
import gzip
import json
import statistics
import threading
import time
from pathlib import Path

from gpu_quick_steps import STREAM_CASES, Child, drop_cached


def prompts(vocab: int, batch: int, length: int):
    import torch

    return torch.randint(3, vocab, (batch, length), generator=torch.Generator().manual_seed(1234))


def stream_case(c: Child, case: str) -> None:
    import torch

    import zerolite
    from zerolite.generate.stats import StepClock

    folder = c.prior("folder")
    if "layout" not in folder:
        raise RuntimeError("the folder step left no layout: nothing to stream")
    s = c.shapes
    policy = dict(STREAM_CASES[case][0])
    if case == "resident":  # the head, embeddings and norm always resident, then 4 layers
        policy["gpu_memory"] = (folder["always_bytes"] + 4 * folder["widest_layer_bytes"]
                                + folder["widest_layer_bytes"] // 2)
    new_tokens = s.disk_new_tokens if case == "disk" else s.new_tokens
    prompt = s.kv_prompt if case == "kv" else s.prompt
    if case == "disk":
        c.save(cache_dropped=drop_cached([Path(p) for p in Path(folder["source"]).glob("*.safetensors")]))
    c.save(policy={k: v for k, v in policy.items()}, new_tokens=new_tokens, prompt_tokens=prompt, batches={})
    started = time.perf_counter()
    lm = zerolite.load(folder["layout"], device=c.device, show_progress=False, **policy)
    blocks = folder["block_bytes"]
    plan = {"resident_layers": sum(1 for name in lm.plan.resident if name in lm.layout.manifest.layer_names),
            "streamed": len(lm.plan.streamed), "on_disk": len(lm.plan.on_disk),
            "resident": list(lm.plan.resident), "prefetch_depth": lm.policy.prefetch_depth,
            "io_backend": lm.engine.backend}
    streamed_bytes = sum(blocks[name] for name in lm.plan.streamed)
    c.save(load_s=round(time.perf_counter() - started, 2), plan=plan, streamed_bytes=streamed_bytes)
    batches: dict = {}

    def recorder(batch: int, read_before: int, began: float):
        """A StepClock for one batch, and the record it calls after each step."""

        def record(done: bool) -> None:
            """The batch's figures so far, saved after a slow step too (a second or more: from disk), so that
            a kill mid-batch leaves its steps; saving after a fast one would add to the next step's time."""
            if not done and (len(clock.times) < 2 or clock.times[-1] - clock.times[-2] < 1.0):
                return
            steps = [b - a for a, b in zip(clock.times[1:], clock.times[2:])]
            median = statistics.median(steps) if steps else None
            forwards = max(len(clock.times) - 1, 1)
            kv_bytes = 0
            if policy.get("kv_offload"):  # the host layers' K/V crosses the link at every step (an estimate)
                seq = prompt + new_tokens // 2
                kv_bytes = int(policy["kv_offload"] * s.layers) * batch * seq * s.kv_bytes_per_token()
            batches[str(batch)] = {
                "median_step_s": round(median, 5) if median else None, "steps": len(steps),
                "step_s": [round(x, 5) for x in steps], "prefill_s": round(clock.prefill_s, 4),
                "tokens_per_s": round(batch / median, 2) if median else None,
                "generate_s": round(time.perf_counter() - began, 2), "weight_bytes_per_step": streamed_bytes,
                "kv_bytes_per_step_estimate": kv_bytes, "moved_bytes_per_step": streamed_bytes + kv_bytes,
                "read_gb_per_forward": round((lm.bytes_read - read_before) / forwards / 1e9, 3),
                **({} if done else {"partial": True}),
            }
            c.save(batches=batches)

        clock = StepClock(lambda rows: record(False))
        return clock, record

    previous_s = 0.0
    try:
        for batch in s.batches:
            if previous_s and c.left() < previous_s * 1.3 + 5:
                batches[str(batch)] = {"skipped": f"{c.left():.0f} s left, the batch before took {previous_s:.0f} s"}
                c.save(batches=batches)
                continue
            ids = prompts(s.vocab, batch, prompt)
            began = time.perf_counter()
            clock, record = recorder(batch, lm.bytes_read, began)
            try:
                with torch.no_grad():
                    lm.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                min_new_tokens=new_tokens, do_sample=False, pad_token_id=0, streamer=clock)
            except Exception as e:
                batches[str(batch)] = {**batches.get(str(batch), {}),
                                       "error": f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"}
                c.save(batches=batches)
                continue
            previous_s = time.perf_counter() - began
            record(True)
        peak = lm.device.peak_allocated()
        c.save(peak_device_gib=round(peak / 2**30, 2) if peak else None)
    finally:
        lm.close()


def intervals_from_trace(trace: dict) -> list[tuple[str, object, float, float]]:
    """(kind, stream, start µs, end µs) of the GPU work in a torch.profiler chrome trace: "copy" for a
    host-to-device memcpy, "kernel" for a kernel (memsets and other copies left out)."""
    events = trace.get("traceEvents", []) if isinstance(trace, dict) else trace
    found = []
    for e in events:
        if e.get("ph") != "X" or "dur" not in e:
            continue
        category, name = str(e.get("cat", "")).lower(), str(e.get("name", ""))
        args = e.get("args") or {}
        stream = args.get("stream", e.get("tid"))
        start = float(e["ts"])
        # Kineto names a copy "Memcpy HtoD (Pinned -> Device)"; torch's own exporter "Memcpy", its kind in args
        if category == "gpu_memcpy" and ("HtoD" in name or args.get("copy kind") == "HtoD"):
            found.append(("copy", stream, start, start + float(e["dur"])))
        elif category == "kernel":
            found.append(("kernel", stream, start, start + float(e["dur"])))
    return found


def union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def length(spans: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in spans)


def intersect(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def summarize(intervals: list[tuple[str, object, float, float]], unit_s: float = 1e-6) -> dict:
    """The copy stream (the one with the most host-to-device copy time): its busy share of the window
    (first to last GPU work), its longest gap, and the share of its busy time that kernels on other
    streams ran beside it."""
    if not intervals:
        return {"window_ms": None, "copy_busy_share": None, "longest_copy_gap_ms": None, "overlap_share": None,
                "kernel_busy_share": None, "copies": 0, "kernels": 0}
    by_stream: dict = {}
    for kind, stream, start, end in intervals:
        if kind == "copy":
            by_stream[stream] = by_stream.get(stream, 0.0) + end - start
    copy_stream = max(by_stream, key=by_stream.get) if by_stream else None
    copies = union([(a, b) for kind, stream, a, b in intervals if kind == "copy" and stream == copy_stream])
    kernels = union([(a, b) for kind, stream, a, b in intervals if kind == "kernel" and stream != copy_stream])
    start, end = min(a for _, _, a, _ in intervals), max(b for _, _, _, b in intervals)
    window = max(end - start, 1e-12)
    edges = [start, *[x for span in copies for x in span], end]
    gaps = [edges[i + 1] - edges[i] for i in range(0, len(edges) - 1, 2)]
    busy = length(copies)
    ms = unit_s * 1e3
    return {"window_ms": round(window * ms, 3), "copy_stream": str(copy_stream),
            "copy_busy_share": round(busy / window, 4),
            "longest_copy_gap_ms": round(max(gaps) * ms, 3) if gaps else None,
            "overlap_share": round(intersect(copies, kernels) / busy, 4) if busy else None,
            "kernel_busy_share": round(length(kernels) / window, 4),
            "copies": sum(1 for kind, *_ in intervals if kind == "copy"),
            "kernels": sum(1 for kind, *_ in intervals if kind == "kernel")}


@contextlib.contextmanager
def simulated_intervals(device, into: list):
    """On the simulated device, which a profiler cannot see: each copy's landing on its stream's
    thread, and each operation compute runs on the calling thread, on the host clock (seconds)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    original = device._landing

    def landing(dst, src, delayed):
        land = original(dst, src, delayed)

        def timed():
            started = time.perf_counter()
            land()
            into.append(("copy", threading.current_thread().name, started, time.perf_counter()))
        return timed

    class Kernels(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            started = time.perf_counter()
            result = func(*args, **(kwargs or {}))
            if not func.is_view:
                into.append(("kernel", "compute", started, time.perf_counter()))
            return result

    device._landing = landing
    try:
        with Kernels():
            yield
    finally:
        device._landing = original


def step_profile(c: Child) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    import zerolite
    from zerolite.hf import cache_keyword

    folder = c.prior("folder")
    if "layout" not in folder:
        raise RuntimeError("the folder step left no layout: nothing to profile")
    s = c.shapes
    device = c.device
    lm = zerolite.load(folder["layout"], device=device, show_progress=False, **STREAM_CASES["pinned"][0])
    batches: dict = {}
    c.save(batches=batches)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if not c.dry else [])
    try:
        for batch in s.batches:
            if c.left() < 10:
                batches[str(batch)] = {"skipped": f"{c.left():.0f} s left"}
                continue
            ids = prompts(s.vocab, batch, s.prompt).to(lm.torch_device)
            with torch.no_grad():
                lm.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, min_new_tokens=2,
                            do_sample=False, pad_token_id=0)  # warm: the schedule is recorded on the first forward
                cache = lm.new_cache()
                given = {cache_keyword(): cache, "use_cache": True}
                logits = lm.model(input_ids=ids, **given).logits
                token = logits[:, -1:].argmax(-1)
                device.synchronize()
                simulated: list = []
                with profile(activities=activities) as prof, \
                        (simulated_intervals(device, simulated) if c.dry else contextlib.nullcontext()):
                    for _ in range(2):
                        logits = lm.model(input_ids=token, **given).logits
                        token = logits[:, -1:].argmax(-1)
                    device.synchronize()
            trace_path = c.scratch / f"trace-{batch}.json"
            prof.export_chrome_trace(str(trace_path))
            trace = json.loads(trace_path.read_text())
            if c.dry:
                result = {**summarize(simulated, unit_s=1.0),
                          "source": "simulated device (copy landings, compute's operations)"}
            else:
                result = {**summarize(intervals_from_trace(trace)), "source": "torch.profiler (CUDA)"}
            # The decode steps ran on the cache: the prompt and the two tokens (one would mean each step began anew).
            result["cache_tokens"] = int(cache.get_seq_length())
            result["trace_events"] = len(trace.get("traceEvents", [])) if isinstance(trace, dict) else len(trace)
            batches[str(batch)] = result
            if batch == s.batches[0]:
                with gzip.open(c.out / "gpu_quick_trace.json.gz", "wt") as f:
                    json.dump(trace, f)
            c.save(batches=batches)
        if not c.dry and all(r.get("copies", 0) == 0 for r in batches.values() if "skipped" not in r):
            c.save(note="no host-to-device copies in the trace: the profiler saw no CUDA activity (CUPTI unavailable?)")
    finally:
        lm.close()
