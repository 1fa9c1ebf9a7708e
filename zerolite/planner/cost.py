"""The cost model: how long a policy's prefill and decode steps take on a machine, and what memory it
needs, in the manner of FlexGen's: each step is bound by the slowest of its streams.

    prediction = predict(costs, hardware, Candidate("int4", batch_size=16, host_layers=20), Job(128, 32))

Per decode step:
  disk     = the layers read from disk x their bytes / the disk's rate
  copy     = (GPU) the streamed layers' bytes and the offloaded K/V's / the host-to-device rate
  compute  = each layer's weights multiplied by the batch's rows (the probe's rate for that format
             and row count), attention over the context, and the head
  step     = max(disk, copy, compute) with two slots or more (the ring overlaps them), their sum
             with one; the copy engine idles, though, while the resident layers between two
             streamed ones (and the head) compute longer than the ring's copies ahead take, and
             the disk idles while the layers held in memory compute longer
             than it takes to fill the buffers read ahead of them (on a GPU the disk's layers
             are one stretch after the held ones, read into staging buffers of their own from the
             step before; on a CPU they are spread among them: Plan.make)
A routed mixture of experts reads and multiplies only the experts its tokens pick: the expected
distinct experts of a random router (ModelCosts.expected_experts), and reads some guessed experts
no token picks (WRONG_GUESSES, from zerolite profile's early_unused_experts_per_step on the MoE
bench model: 0.39 to 0.5 per guessed layer at batch 1). The prefill reads what a step
reads and multiplies batch x prompt rows. Filling the host tier (and the GPU's resident layers)
takes their bytes at the measured fill rate, once per job. What a policy holds in memory (K/V, the
prefill's activations, a GPU's dense copies and dequantisation) is zerolite.memory_model's count,
the one the runtime's batch sizes, budgets and preflight use, so a batch planned is one that runs.

On a GPU, the routed experts of cpu_expert_layers of the streamed layers compute on the CPU where
their bytes are (--experts cpu): the link then moves only those layers' dense parts, and the
compute chain waits for the CPU's experts (zerolite.planner.cpu_experts.cpu_layer_seconds) in place
of the GPU's. Those layers are spread among the others (zerolite.runtime.parts.host_expert_layers),
so each streamed layer is priced at the mean of the two: the link copies some layers' experts while
the CPU computes others' (zerolite.planner.experts_side chooses how many).
"""

from __future__ import annotations

from dataclasses import dataclass

from zerolite.io import engine
from zerolite.memory_model import prefill_activation_bytes
from zerolite.planner.compute_probe import LAYER_CONTEXT
from zerolite.planner.cpu_experts import cpu_layer_seconds
from zerolite.planner.hardware import RUNTIME_BYTES, Hardware, at
from zerolite.planner.kv_costs import KvStep, kv_memory, kv_step
from zerolite.planner.model_costs import ModelCosts

WRONG_GUESSES = 0.45   # experts per layer read early on a guess that no token then picks


@dataclass(frozen=True)
class Job:
    prompt_tokens: int
    new_tokens: int
    prompts: int | None = None   # the job's prompts (None: one batch's worth)


@dataclass(frozen=True)
class Candidate:
    weights: str                 # "stored", "int8" or "int4"
    batch_size: int
    host_layers: int             # layers kept in host memory (on a CPU: in memory, not streamed from disk)
    gpu_layers: int = 0          # layers resident on the GPU
    kv_offload: float = 0.0      # share of the layers whose K/V live in host memory (GPU)
    prefetch_depth: int = 2
    cpu_expert_layers: int = 0   # of the streamed layers, those whose routed experts the CPU computes (GPU, mixture)
    kv_bits: int = 16            # the K/V cache's bits (--kv-bits)
    kv_disk: float = 0.0         # share of the layers whose K/V lives on disk
    kv_attention: str = "device"  # attention over the K/V off the GPU: copied to the "device", or on the "cpu"
    micro_batches: int = 1       # device micro-batches per pass over the weights


@dataclass(frozen=True)
class Prediction:
    candidate: Candidate
    prefill_s: float
    decode_step_s: float
    disk_s: float                # per decode step
    copy_s: float
    compute_s: float
    bottleneck: str              # "disk", "copy", "compute", or "cpu" (compute, the CPU's experts the larger part)
    fill_s: float                # loading the host tier and resident layers, once
    tokens_per_s: float          # a batch's new tokens over its prefill and decode
    job_s: float                 # the whole job: fill, then its batches one after another
    host_bytes: int
    gpu_bytes: int
    cpu_memory: int              # the budgets that give this policy to generate (--cpu-memory, --gpu-memory)
    gpu_memory: int
    cpu_s: float = 0.0           # per decode step, of compute: the CPU's experts and attention (and their round trips)
    experts: str | None = None   # a mixture's routed experts on a GPU: "device", "cpu", or "split" (some layers each);
                                 # None for a dense model, or with nothing to choose (no GPU, or no layer streamed)

    def fits(self, hardware: Hardware) -> bool:
        return self.host_bytes <= hardware.host_ram and (not hardware.gpu or self.gpu_bytes <= hardware.gpu_ram)


class Rates:
    """What a layer's work, the step's own and the head's take at a count of rows, for one model on
    one machine: the search prices tens of thousands of candidates that ask for the same few row
    counts (each an interpolation of probed figures), so each answer is kept once worked out."""

    def __init__(self, costs: ModelCosts, hardware: Hardware):
        self.costs, self.hardware = costs, hardware
        self._kept: dict[tuple, object] = {}

    def _once(self, key: tuple, work):
        if key not in self._kept:
            self._kept[key] = work()
        return self._kept[key]

    def matmuls(self, weights: str, rows: float, positions: float) -> float:
        """A layer's matmuls at the probe's rates (the stored format's brought to agree with the
        probe of the model's own layer: agreement) and its attention's FLOPs."""
        return self._once(("matmuls", weights, rows, positions),
                          lambda: self.probed_matmuls(weights, rows, positions) * self.agreement(weights, rows))

    def probed_matmuls(self, weights: str, rows: float, positions: float) -> float:
        costs, hardware = self.costs, self.hardware

        def work() -> float:
            itemsize = costs.dtype.itemsize
            seconds = hardware.seconds(weights, costs.dense_weights, rows, itemsize)
            if costs.experts:
                picked = costs.expected_experts(rows)
                seconds += picked * hardware.seconds("stored", costs.expert_weights,
                                                     rows * costs.experts_per_token / picked, itemsize)
            return seconds + hardware.flop_seconds(4 * rows * positions * costs.attention_width)
        return self._once(("probed matmuls", weights, rows, positions), work)

    def agreement(self, weights: str, rows: float) -> float:
        """1, or where the stored format's matmul rates price a layer's matmuls at rows above what
        the probe of the model's own layer took whole, the share that brings them down to it (at
        the largest batch probed past it). The layer probe is the model's own layer run as a run
        runs it; the matmul probe is one shape of matrix, and one timed while other work took the
        cores once priced a layer at 7x the layer probe's time, its surplus then dropped as a
        negative remainder (beyond) instead of setting the rates right."""
        probed = self.hardware.layer_seconds
        if weights != "stored" or probed is None:
            return 1.0

        def work() -> float:
            at_rows = min(rows, max(probed))
            return min(1.0, at(probed, at_rows) / self.probed_matmuls("stored", at_rows, LAYER_CONTEXT))
        return self._once(("agreement", min(rows, max(probed))), work)

    def beyond(self, rows: float) -> float:
        """What the probe of the model's own layer took beyond its matmuls (norms, attention's small
        ops, routing), at a batch probed or between two."""
        return self._once(("beyond", rows), lambda: max(at(self.hardware.layer_seconds, rows)
                                                        - self.matmuls("stored", rows, LAYER_CONTEXT), 0.0))

    def layer(self, weights: str, rows: int, tokens_in_context: float, prefill: bool) -> float:
        """One layer's compute for rows rows, each attending over tokens_in_context positions."""
        return self._once(("layer", weights, rows, tokens_in_context, prefill),
                          lambda: self._layer(weights, rows, tokens_in_context, prefill))

    def _layer(self, weights: str, rows: int, tokens_in_context: float, prefill: bool) -> float:
        # a causal prefill attends to half, on average
        positions = tokens_in_context / 2 if prefill else tokens_in_context
        own = self.matmuls(weights, rows, positions)
        if self.hardware.layer_seconds is None:
            return own
        before, last = sorted(self.hardware.layer_seconds)[-2:]
        if rows <= last:
            return own + self.beyond(rows)
        # Past the largest batch probed, on the line through the last two: a cost per op stays, a
        # cost per row grows. In proportion to the rows instead, a memory-bound layer's timing noise
        # at 16 rows (where a busy machine's probe may stop) became seconds at a prefill's thousands.
        return own + self.beyond(last) + max(self.beyond(last) - self.beyond(before), 0.0) * (rows - last) / (
            last - before)

    def step_overhead(self, rows: int, sequences: int) -> float:
        """A step's cost besides its layers over rows rows, and the head's over sequences rows (one a sequence)."""
        costs, hardware = self.costs, self.hardware
        return self._once(("step", rows, sequences),
                          lambda: (at(hardware.step_seconds, rows) if hardware.step_seconds else 0.0)
                          + hardware.seconds("stored", costs.head_weights, sequences, costs.dtype.itemsize)
                          * self.agreement("stored", sequences))

    def gpu_experts(self, rows: int) -> float:
        """What the GPU's matmuls of a layer's routed experts take (as matmuls() counts them)."""
        costs = self.costs

        def work() -> float:
            picked = costs.expected_experts(rows)
            return picked * self.hardware.seconds("stored", costs.expert_weights,
                                                  rows * costs.experts_per_token / picked, costs.dtype.itemsize)
        return self._once(("gpu experts", rows), work)

    def cpu_experts(self, rows: int) -> float:
        return self._once(("cpu experts", rows), lambda: cpu_layer_seconds(self.costs, self.hardware, rows))

    def kv_step(self, c: Candidate, tokens_in_context: float, prefill: bool) -> KvStep:
        """zerolite.planner.kv_costs.kv_step, by what of c it reads: the K/V's and the batch's."""
        key = ("kv step", *kv_fields(c), tokens_in_context, prefill)
        return self._once(key, lambda: kv_step(self.costs, self.hardware, c, c.batch_size, tokens_in_context, prefill))

    def batch_memory(self, c: Candidate, job: Job) -> tuple[float, float]:
        return self._once(("batch memory", *kv_fields(c), job), lambda: batch_memory(self.costs, self.hardware, c, job))


def kv_fields(c: Candidate) -> tuple:
    """What of a candidate its batch's K/V and activations depend on."""
    return c.batch_size, c.micro_batches, c.kv_bits, c.kv_offload, c.kv_disk, c.kv_attention


def predict(costs: ModelCosts, hardware: Hardware, c: Candidate, job: Job, rates: Rates | None = None) -> Prediction:
    """rates: the search's, kept across its candidates (else one for this prediction)."""
    rates = rates or Rates(costs, hardware)
    fmt = costs.formats[c.weights]
    b, layers = c.batch_size, costs.layers
    disk_layers = layers - c.host_layers - c.gpu_layers
    streamed_layers = layers - c.gpu_layers
    context = job.prompt_tokens + job.new_tokens / 2  # a decode step's, on average
    micro = -(-b // c.micro_batches)  # sequences in a micro-batch

    dense_part = fmt.layer_bytes - costs.experts * fmt.expert_bytes  # a mixture's layer less its experts

    def step_bytes(tokens: int, guessed: bool = True) -> float:
        """Bytes a streamed layer moves for a forward over tokens tokens: a routed mixture's dense
        part, the experts its tokens pick, and (where the layer before guessed them) the guessed
        experts no token picked."""
        if not costs.experts:
            return fmt.layer_bytes
        picked = costs.expected_experts(tokens)
        wrong = min(WRONG_GUESSES, costs.experts - picked) if guessed else 0.0
        return fmt.layer_bytes - (costs.experts - picked - wrong) * fmt.expert_bytes

    def dequantize() -> float:
        """A described GPU's dequantisation of a streamed quantized layer (read its codes, write and
        read the dense weights) at its memory rate: a GPU measured here has it in its probe."""
        if hardware.compute is not None or c.weights == "stored" or not hardware.gpu_gbps:
            return 0.0
        return (fmt.layer_bytes + 2 * fmt.dense_bytes) / (hardware.gpu_gbps * 1e9)

    def step(tokens: int, tokens_in_context: float, prefill: bool) -> tuple[float, float, float, float, float]:
        """A prefill (tokens: the prompt's) or decode step (1) of the batch, in micro-batches of micro
        sequences: the weights moved once, each micro-batch computed in turn while a layer is loaded."""
        rows = b * tokens
        # A ring with a slot for every streamed layer keeps them there after the first forward: a
        # decode step then reads and copies nothing (tests/test_timed_device.py). Counted on a GPU
        # alone for now: on a CPU the search would then pick a deep ring over held layers.
        kept = hardware.gpu and not prefill and streamed_layers <= c.prefetch_depth
        moved, rate = 0 if kept else step_bytes(rows), hardware.disk_gbps * 1e9
        # The share of the streamed layers whose experts the CPU computes: their reads are the same,
        # their copies only the dense part, their experts' time the CPU's instead of the GPU's.
        on_cpu = c.cpu_expert_layers / streamed_layers if c.cpu_expert_layers else 0.0
        copied = (1 - on_cpu) * moved + (0 if kept else on_cpu * dense_part)
        one = c.micro_batches * rates.cpu_experts(micro * tokens) if on_cpu else 0.0
        cpu = c.cpu_expert_layers * one
        instead = on_cpu * (one - c.micro_batches * rates.gpu_experts(micro * tokens)) if on_cpu else 0.0
        disk = disk_layers * moved / rate
        if costs.experts and disk_layers and not kept:
            # The first layer read from disk has no layer before it to guess its experts (nor to
            # guess wrong): they are read once its router has picked them, with nothing to overlap.
            disk += (step_bytes(rows, guessed=False) - moved + costs.expected_experts(rows) * fmt.expert_bytes) / rate
        kv = rates.kv_step(c, tokens_in_context, prefill)
        disk += kv.disk_s
        copy = kv.copy_s
        if hardware.gpu:
            copy += streamed_layers * copied / (hardware.h2d_gbps * 1e9)
        one_pass = rates.layer(c.weights, micro * tokens, tokens_in_context, prefill)
        per_layer = c.micro_batches * one_pass
        compute = layers * per_layer + c.micro_batches * rates.step_overhead(micro * tokens, micro)
        compute += kv.compute_s
        per_layer += kv.compute_s / layers  # attention over each layer's K/V, as it computes
        cpu += kv.cpu_s
        # a streamed one's, on average: its experts where they compute, and its dequantisation
        streamed_extra = instead + c.micro_batches * dequantize()
        compute += streamed_layers * streamed_extra
        per_layer += streamed_extra
        if copy and streamed_layers and c.prefetch_depth >= 2 and not kept:
            # The copy engine idles where what computes between two streamed layers (resident
            # layers, and the head at the step's turn) takes longer than the copies the ring has
            # queued ahead: prefetch_depth - 1. On a GPU the resident layers are spread among the
            # streamed ones (Plan.make), a mixture's read per expert excepted: one stretch first.
            between = compute - streamed_layers * per_layer
            ahead = (c.prefetch_depth - 1) * copied / (hardware.h2d_gbps * 1e9)
            gaps = 1 if costs.experts else streamed_layers
            copy += gaps * max(between / gaps - ahead, 0.0)
        if disk_layers and c.prefetch_depth >= 2 and not kept:
            # While the layers held in memory compute, the disk reads ahead only as far as its
            # buffers reach; the rest of that time it idles. On a GPU, and for a mixture's layers
            # read per expert, the disk's layers are one stretch (Plan.make): on a GPU its next
            # prefetch_depth blocks are read into staging buffers of their own whatever the ring's
            # place (zerolite.runtime.slots), the ring reaches as many past the held ones. Otherwise
            # they are spread among the held ones: past each gap, the ring's other slots.
            # The K/V of the held layers that lives on disk is read meanwhile (a layer ahead of each).
            held = compute - disk_layers * per_layer
            held_kv = kv.disk_s * (layers - disk_layers) / layers
            if hardware.gpu or costs.experts:
                disk += max(held - c.prefetch_depth * moved / rate - held_kv, 0.0)
            else:
                disk += disk_layers * max((held - held_kv) / disk_layers - (c.prefetch_depth - 1) * moved / rate, 0.0)
        total = max(disk, copy, compute) if c.prefetch_depth >= 2 else disk + copy + compute
        return total, disk, copy, compute, cpu

    prefill, *_ = step(job.prompt_tokens, job.prompt_tokens, prefill=True)
    decode, disk, copy, compute, cpu = step(1, context, prefill=False)
    bottleneck = max((disk, "disk"), (copy, "copy"), (compute, "cpu" if 2 * cpu > compute else "compute"))[1]

    held_host, held_gpu = weight_memory(costs, hardware, c)
    batch_host, batch_gpu = rates.batch_memory(c, job)
    host_tier = c.host_layers * engine.host_bytes(fmt.layer_bytes)  # as Plan.make counts a layer held in host memory
    fill = host_tier / (hardware.fill_gbps * 1e9)
    if hardware.gpu:
        fill += c.gpu_layers * fmt.layer_bytes / (min(hardware.disk_gbps, hardware.h2d_gbps) * 1e9)
    batch_s = prefill + (job.new_tokens - 1) * decode
    experts = None
    if hardware.gpu and costs.experts and streamed_layers:
        experts = {0: "device", streamed_layers: "cpu"}.get(c.cpu_expert_layers, "split")
    rounds = -(-(job.prompts or b) // b)
    return Prediction(
        candidate=c, prefill_s=prefill, decode_step_s=decode, disk_s=disk, copy_s=copy, compute_s=compute,
        bottleneck=bottleneck, fill_s=fill, tokens_per_s=b * job.new_tokens / batch_s, job_s=fill + rounds * batch_s,
        host_bytes=int(held_host + batch_host), gpu_bytes=int(held_gpu + batch_gpu), cpu_memory=host_tier,
        gpu_memory=fmt.always_bytes + c.gpu_layers * on_gpu(costs, c.weights) if hardware.gpu else 0, cpu_s=cpu,
        experts=experts,
    )


def weight_memory(costs: ModelCosts, hardware: Hardware, c: Candidate) -> tuple[int, int]:
    """(host bytes, GPU bytes) c's weights take where they live, with the ring's slots, the
    dequantisation's workspace, the process and a described GPU's context: whatever the batch."""
    fmt = costs.formats[c.weights]
    streamed_layers = costs.layers - c.gpu_layers
    disk_layers = streamed_layers - c.host_layers
    host_tier = c.host_layers * engine.host_bytes(fmt.layer_bytes)  # as Plan.make counts a layer held in host memory
    ring = c.prefetch_depth * fmt.layer_bytes if streamed_layers else 0
    if not hardware.gpu:
        return fmt.always_bytes + host_tier + (ring if disk_layers else 0) + RUNTIME_BYTES, 0
    # Where the CPU computes every streamed layer's experts, the GPU's slots hold dense parts alone
    # (zerolite.runtime.budget.device_slot_bytes); a split's must hold the other layers' experts too.
    every_on_cpu = streamed_layers and c.cpu_expert_layers == streamed_layers
    dense_part = fmt.layer_bytes - costs.experts * fmt.expert_bytes
    ring_on_gpu = c.prefetch_depth * dense_part if every_on_cpu else ring
    gpu = (fmt.always_bytes + c.gpu_layers * on_gpu(costs, c.weights) + ring_on_gpu + fmt.workspace_bytes
           + hardware.gpu_context)
    return host_tier + ring + RUNTIME_BYTES, gpu


def batch_memory(costs: ModelCosts, hardware: Hardware, c: Candidate, job: Job) -> tuple[float, float]:
    """(host bytes, GPU bytes) c's batch takes: its K/V where it lives (zerolite.planner.kv_costs) and
    one micro-batch's prefill activations, its attention scores over the prompt included (memory_model)."""
    kv_host, kv_gpu = kv_memory(costs, hardware, c, job.prompt_tokens + job.new_tokens)
    micro = -(-c.batch_size // c.micro_batches)
    activations = micro * prefill_activation_bytes(costs.shape, job.prompt_tokens, costs.dtype)
    if hardware.gpu:
        return kv_host, kv_gpu + activations
    return kv_host + activations, 0.0


def on_gpu(costs: ModelCosts, weights: str) -> int:
    """What a layer resident on a GPU takes: a quantized one is kept dequantised beside its bytes."""
    fmt = costs.formats[weights]
    return fmt.layer_bytes + fmt.dense_bytes
