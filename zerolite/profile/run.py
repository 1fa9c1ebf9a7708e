"""`zerolite profile`: a short generation on a timeline, the machine measured beside it, and a verdict.

    report = profile_run(lm, timeline, batch_size=8, new_tokens=8)
    report.verdict        # "disk-bound: 0.30 GB move per step at 92% of the read-only pass's 2.1 GB/s; ..."

The arithmetic, per decode step (the prefill step is reported apart):
  I/O      = bytes streamed per step / the read-only pass's rate (zerolite.layout.read_pass: the engine reads
             the streamed blocks in decode order, once per decode step, with no compute), or the
             measured host-to-device bandwidth on CUDA with a memory home
  compute  = step time - time compute sat waiting for its block's bytes
  bound    = max(I/O, compute): the best a perfect overlap could do
  overlap  = step / bound (1.00 = perfect)
and the prefill is set beside decode: its compute per token against a decode step's compute per sequence.
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass, field

import torch

from zerolite.layout.read_pass import read_pass
from zerolite.lm import OffloadedLM
from zerolite.openmp import threads_may_spin
from zerolite.planner.machine import measure_host_to_device
from zerolite.quant.quantize import fewer_bytes
from zerolite.runtime.timeline import Span, Timeline

WAITING = 0.15  # compute waiting less than this share of a step is not held up by transfers
BUSY = 0.85     # a link carrying data this share of a step (or more) is the one holding it up...
FULL = 0.7      # ...unless it moves them below this share of its measured bandwidth while
                # fewer bytes are in flight than the engine's queue holds: then deeper prefetch helps
SLOW_PREFILL = 2.0  # a prefill whose compute per token is this many times decode's (or more) is off its fast path


@dataclass
class Report:
    device: str
    offload: str
    prefetch_depth: int
    batch_size: int
    new_tokens: int
    dtype: str                          # the layout's
    weights: str | None                 # "int8" or "int4" where the layers' Linear weights are quantized
    threads_spin: bool                  # torch's OpenMP threads spin while they wait (zerolite.openmp)
    read_gbps: float | None             # the read-only pass of the streamed blocks, after the run
                                        # (zerolite.layout.read_pass)
    h2d_gbps: float | None              # measured: pinned host-to-device copies (CUDA)
    streamed_bytes_per_step: int
    prompt_tokens: int
    prefill_s: float
    prefill_compute_per_token_s: float  # the prefill's compute (its waits for bytes left out) / (batch x prompt tokens)
    decode_compute_per_token_s: float   # a decode step's compute / batch
    slow_prefill: bool                  # the first above the second by SLOW_PREFILL times or more
    step_s: list[float]                 # every decode step
    decode_step_s: float                # their median
    wait_s: float                       # per step, compute waiting on bytes (median)
    link_busy: float                    # share of a step with a read (or copy) in flight (median)
    in_flight_bytes: int                # bytes in transfer at once, on average over a step (median)
    io_s: float                         # per step, streamed bytes at the read-only pass's rate (or the measured
                                        # copy rate)
    compute_s: float                    # per step, step minus waiting
    achieved_read_gbps: float | None
    share_of_bound: float               # bound / step: 1.0 when the step is as short as it can be
    overlap: float                      # step / bound: 1.0 when I/O and compute overlap perfectly
    bottleneck: str                     # "disk", "copy", "compute" or "prefetch"
    verdict: str
    advice: list[str] = field(default_factory=list)
    speculation: dict | None = None     # with a draft: guesses kept, tokens per pass, draft and model time
    experts: dict | None = None         # a mixture streamed per expert: dense and expert bytes per step, expert
                                        # cache hits, next-layer guesses (over every step, the prefill's included)

    def to_dict(self) -> dict:
        return asdict(self)


def profile_run(lm: OffloadedLM, timeline: Timeline, batch_size: int, new_tokens: int, prompt_tokens: int,
                seed: int = 0) -> Report:
    """Generates new_tokens for a batch of random prompts on the timeline, then measures the machine:
    the read-only pass over the blocks the run streamed from disk, as many passes as it had decode steps."""
    manifest = lm.layout.manifest
    plan = lm.plan
    vocab = lm.model.config.get_text_config().vocab_size
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, vocab, (batch_size, prompt_tokens), generator=generator)
    timeline.spans.clear()
    before = copy.copy(lm.speculator.stats) if lm.speculator is not None else None
    bytes_before, experts_before = lm.bytes_read, lm.expert_counts()
    lm.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=new_tokens,
                min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    lm.wait_for_reads()  # the last reads ahead land on the timeline too
    timeline.resolve()
    # Measured after the run, not before: reading the whole layout first can change how fast a
    # virtual disk then serves the run (caches below the guest), which would misjudge the run.
    # At least two slots, so that a depth-1 ring, which idles the disk, is judged against what
    # the disk can do, not against its own gaps.
    read_gbps = read_pass(lm.layout, plan.on_disk, passes=max(new_tokens - 1, 1), engine=lm.engine,
                          depth=max(lm.policy.prefetch_depth, 2))["read_gbps"] if plan.on_disk else None
    h2d_gbps = measure_host_to_device(lm.device)

    # The link a step waits on: the disk when any layer streams from it, else the copy to the GPU.
    experts = None
    if lm.per_expert:
        # Only the routed experts move: the bytes a step streams are measured, not the layers' sizes.
        experts = lm.expert_counts().since(experts_before).summary(lm.bytes_read - bytes_before, new_tokens)
        streamed = experts["dense_bytes_per_step"] + experts["expert_bytes_per_step"]
        transfer_gbps = read_gbps if plan.on_disk else h2d_gbps
    elif plan.on_disk:
        streamed, transfer_gbps = manifest.nbytes(plan.on_disk), read_gbps
    else:
        streamed = manifest.nbytes(plan.streamed)
        transfer_gbps = h2d_gbps if lm.device.separate_memory and plan.streamed else None
    report = analyse(timeline, lm, streamed, read_gbps, h2d_gbps, transfer_gbps, batch_size, new_tokens, prompt_tokens)
    report.experts = experts
    if before is not None:
        spec = lm.speculator.stats.since(before)
        tokens_per_pass = round((spec.accepted + spec.passes) / spec.passes, 3) if spec.passes else None
        report.speculation = {**spec.to_dict(), "tokens_per_pass": tokens_per_pass}
    return report


def analyse(timeline: Timeline, lm: OffloadedLM, streamed: int, read_gbps, h2d_gbps, transfer_gbps,
            batch_size: int, new_tokens: int, prompt_tokens: int) -> Report:
    steps = timeline.on("step")
    decode = steps[1:] or steps
    step_s = [s.duration for s in decode]
    waits = [sum(w.duration for w in within(timeline.on("wait"), s)) for s in decode]
    prefill_compute = max(steps[0].duration - sum(w.duration for w in within(timeline.on("wait"), steps[0])), 0.0)
    transfers = timeline.on("read") + timeline.on("copy")
    busy = [covered(transfers, s) / s.duration for s in decode]
    in_flight = [sum(overlap(t, s) * t.args.get("bytes", 0) for t in transfers) / s.duration for s in decode]
    step, wait = median(step_s), median(waits)
    io = streamed / (transfer_gbps * 1e9) if transfer_gbps else 0.0
    compute = max(step - wait, 0.0)
    bound = max(io, compute)
    prefill_per_token = prefill_compute / (batch_size * prompt_tokens)
    decode_per_token = compute / batch_size
    policy = lm.policy
    report = Report(
        device=lm.device.name, offload=policy.offload, prefetch_depth=policy.prefetch_depth,
        batch_size=batch_size, new_tokens=new_tokens, dtype=lm.layout.manifest.dtype,
        weights=(lm.layout.manifest.quantization or {}).get("weights"), threads_spin=threads_may_spin(),
        read_gbps=read_gbps, h2d_gbps=h2d_gbps, streamed_bytes_per_step=streamed, prompt_tokens=prompt_tokens,
        prefill_s=round(steps[0].duration, 4), prefill_compute_per_token_s=round(prefill_per_token, 6),
        decode_compute_per_token_s=round(decode_per_token, 6),
        slow_prefill=decode_per_token > 0 and prefill_per_token >= SLOW_PREFILL * decode_per_token,
        step_s=[round(s, 4) for s in step_s],
        decode_step_s=round(step, 4), wait_s=round(wait, 4), link_busy=round(median(busy), 3),
        in_flight_bytes=int(median(in_flight)), io_s=round(io, 4), compute_s=round(compute, 4),
        achieved_read_gbps=round(streamed / step / 1e9, 3) if streamed and step else None,
        share_of_bound=round(bound / step, 3) if step else 0.0, overlap=round(step / bound, 3) if bound else 1.0,
        bottleneck="", verdict="",
    )
    engine = lm.engine
    judge(report, transfer_gbps, "disk" if lm.plan.on_disk else "copy", engine.queue_depth * engine.chunk_bytes)
    judge_prefill(report)
    if report.weights == "int4" and report.dtype != "bfloat16" and not lm.device.separate_memory:
        report.advice.append(f"int4's CPU kernel runs only with bf16 activations, so this {report.dtype} layout "
                             "dequantises every int4 weight at every step: convert with --dtype bf16 --weights int4")
    if report.threads_spin and lm.plan.on_disk:
        report.advice.append("torch's OpenMP threads spin while they wait and take the cores the reads need (torch "
                             "was loaded before zerolite could set OMP_WAIT_POLICY=PASSIVE): import zerolite first, or "
                             "set it in the environment")
    return report


def judge(r: Report, transfer_gbps: float | None, link: str, queue_bytes: int) -> None:
    """Names what limits the step, in words, and what to change.

    From the timeline, not from bandwidth estimates (a disk's speed varies run to run): compute
    that hardly waits is the limit; compute that waits while a transfer is always in flight is
    held up by that link, unless it moves well below its measured speed with less in flight than
    the engine could keep queued; compute that waits while the link sits idle part of the step is starved by reads that
    start too late.
    """
    if r.wait_s < WAITING * r.decode_step_s:
        r.bottleneck = "compute"
        r.verdict = f"compute-bound: compute takes {r.compute_s:.3f} s of each {r.decode_step_s:.3f} s step"
        if r.streamed_bytes_per_step:
            r.verdict += f", waiting {r.wait_s:.3f} s for bytes; streaming hides behind it"
            r.advice.append("streaming costs next to nothing here: --offload none would save at most the wait")
        else:
            r.advice.append("nothing is streamed: only a faster device or a smaller dtype shortens the step")
        return
    rate = (r.achieved_read_gbps / r.link_busy / transfer_gbps
            if transfer_gbps and r.achieved_read_gbps and r.link_busy else 1.0)
    too_few = rate < FULL and r.in_flight_bytes < queue_bytes
    source = "the read-only pass's" if link == "disk" else "the measured"
    bound = f"{source} {transfer_gbps or 0:.2f} GB/s"
    if r.link_busy >= BUSY and not too_few:
        r.bottleneck = link
        share = f" at {r.achieved_read_gbps / transfer_gbps:.0%} of {bound}" if transfer_gbps else ""
        r.verdict = f"{link}-bound: {r.streamed_bytes_per_step / 1e9:.2f} GB move per step{share}"
        if r.compute_s > 0 and r.io_s > r.compute_s:
            bigger = int(r.batch_size * r.io_s / r.compute_s)
            if bigger > r.batch_size:
                r.verdict += f"; a batch of {bigger} would cost nothing more per step"
                r.advice.append(f"raise --batch-size towards {bigger}: compute ({r.compute_s:.3f} s) hides under "
                                f"the {link} ({r.io_s:.3f} s) until then")
        if advice := fewer_bytes(r.dtype, r.weights):
            r.advice.append(advice)
        r.advice.append("or keep more layers where they need no read: a larger --cpu-memory (host) or --gpu-memory "
                        "(GPU) budget, each layer kept saves its transfer")
        if r.device.startswith("cuda"):
            r.advice.append("if a larger batch does not fit on the GPU, --kv-offload 0.5 keeps half the K/V cache in "
                            "host memory")
        return
    r.bottleneck = "prefetch"
    if r.link_busy >= BUSY:
        r.verdict = (
            f"prefetch-starved: compute waits {r.wait_s:.3f} s of each {r.decode_step_s:.3f} s step while too few "
            f"bytes are in flight ({r.in_flight_bytes / 1e6:.0f} MB on average) to use the {link}: "
            f"{rate:.0%} of {bound}"
        )
    else:
        r.verdict = (
            f"prefetch-starved: compute waits {r.wait_s:.3f} s of each {r.decode_step_s:.3f} s step while the {link} "
            f"is idle {1 - r.link_busy:.0%} of it: reads start too late"
        )
    r.advice.append(f"raise --prefetch-depth to {max(r.prefetch_depth + 1, 2 * r.prefetch_depth)}, "
                    "so that more blocks are read while one computes")


def judge_prefill(r: Report) -> None:
    """A prefill computes many positions per weight it reads, so its compute per token should be
    well below a decode step's per sequence; far above, some matmul in it is off its fast path
    (torch's CPU kernels have slow paths for strided 16-bit inputs, for one)."""
    if not r.slow_prefill:
        return
    times = r.prefill_compute_per_token_s / r.decode_compute_per_token_s
    r.verdict += (f"; prefill is slow for its size: {r.prefill_compute_per_token_s * 1e3:.1f} ms of compute per token "
                  f"({r.batch_size} x {r.prompt_tokens} tokens), {times:.1f}x decode's "
                  f"{r.decode_compute_per_token_s * 1e3:.1f} ms per sequence")
    r.advice.append("the prefill runs some layer on a slow kernel (torch's CPU linear on a strided 16-bit input is "
                    "one): the prefill step's compute spans in --trace show which")


def covered(spans: list[Span], outer: Span) -> float:
    """Seconds of outer during which at least one of spans runs."""
    total, reach = 0.0, outer.start
    for s in sorted(spans, key=lambda s: s.start):
        start, end = max(s.start, reach), min(s.end, outer.end)
        if end > start:
            total += end - start
            reach = end
    return total


def overlap(span: Span, outer: Span) -> float:
    return max(min(span.end, outer.end) - max(span.start, outer.start), 0.0)


def within(spans: list[Span], outer: Span) -> list[Span]:
    return [s for s in spans if s.start >= outer.start and s.end <= outer.end]


def median(values: list[float]) -> float:
    ordered = sorted(values)
    if not ordered:
        return 0.0
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2
