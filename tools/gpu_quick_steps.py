"""tools/gpu_quick.py's shapes and its first steps, each run in a process of its own (Child): the
machine, pinned host-to-device copies, int4/int8/bf16 matmuls, the model folder. On a GPU they use
zerolite's CudaDevice; in a dry run the simulated device (tests/support/simulated_device.py) and tiny shapes.
Each step saves its figures as it gets them (Child.save), so that a kill leaves what was measured."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MiB = 1 << 20


@dataclass(frozen=True)
class Shapes:
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    layers: int
    vocab: int
    copy_sizes: tuple[int, ...]     # bytes; the last is a layer's
    matmul_rows: tuple[int, ...]
    batches: tuple[int, ...]
    prompt: int                     # tokens of the streaming cases' prompts
    kv_prompt: int                  # the kv case's
    new_tokens: int                 # greedy tokens of each generate (the first is the prefill's)
    disk_new_tokens: int

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def layer_params(self) -> int:
        """A Llama decoder layer's weights: q, k, v, o, gate, up, down and two norms."""
        h, kv = self.hidden, self.kv_heads * self.head_dim
        return 2 * h * h + 2 * h * kv + 3 * h * self.intermediate + 2 * h

    @property
    def layer_bytes(self) -> int:
        return 2 * self.layer_params  # bf16

    def kv_bytes_per_token(self) -> int:
        """One token's K and V in one layer, bf16: zerolite.memory_model's count, over the layers."""
        import torch
        from transformers import LlamaConfig

        from zerolite.memory_model import kv_bytes_per_token

        return kv_bytes_per_token(LlamaConfig(**llama_config(self)), torch.bfloat16) // self.layers


REAL = Shapes(hidden=8192, intermediate=28672, heads=64, kv_heads=8, layers=8, vocab=4096,
              copy_sizes=(256 * MiB, 0), matmul_rows=(1, 16, 64, 256), batches=(1, 32), prompt=8, kv_prompt=1024,
              new_tokens=6, disk_new_tokens=3)
TINY = Shapes(hidden=128, intermediate=384, heads=4, kv_heads=2, layers=8, vocab=512,
              copy_sizes=(1 * MiB, 0), matmul_rows=(1, 16, 64, 256), batches=(1, 32), prompt=8, kv_prompt=64,
              new_tokens=4, disk_new_tokens=3)
LAYER_70B_BYTES = REAL.layer_bytes  # 1,711,308,800


def shapes(dry: bool) -> Shapes:
    return TINY if dry else REAL


def copy_sizes(s: Shapes) -> list[int]:
    return [size or s.layer_bytes for size in s.copy_sizes]


STREAM_CASES = {
    # name: (zerolite.load's policy keywords, apart from gpu_memory for "resident"), what it measures
    "pinned": (dict(offload="cpu", gpu_memory=0), "every layer streamed from pinned host memory"),
    "resident": (dict(offload="cpu"), "4 layers resident on the device, 4 streamed from pinned host memory"),
    "disk": (dict(offload="nvme", cpu_memory=0, gpu_memory=0), "every layer read from disk, nothing held"),
    "kv": (dict(offload="cpu", gpu_memory=0, kv_offload=0.5),
           "every layer streamed from pinned memory, half the layers' K/V in host memory, a long prompt"),
}


def write_atomically(path: Path, text: str) -> None:
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    os.replace(partial, path)


def filesystem_type(path: Path) -> str | None:
    """The type of the filesystem path lies on (/proc/mounts' longest mount point above it)."""
    best, kind = "", None
    with contextlib.suppress(OSError):
        real = str(path.resolve())
        for line in Path("/proc/mounts").read_text().splitlines():
            parts = line.split()
            if (len(parts) >= 3 and (real == parts[1] or real.startswith(parts[1].rstrip("/") + "/"))
                    and len(parts[1]) >= len(best)):
                best, kind = parts[1], parts[2]
    return kind


def run_quietly(command: list[str], timeout: int = 10) -> str | None:
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
        return done.stdout.strip() if done.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


class Child:
    def __init__(self, name: str, args: argparse.Namespace):
        self.name = name
        self.dry = args.dry_run
        self.shapes = shapes(self.dry)
        self.scratch: Path = args.scratch
        self.out: Path = args.out
        self.deadline: float = args.deadline
        self.results: dict = {}
        self.path = self.scratch / "results" / f"{name}.json"
        self._device = None

    def save(self, **values) -> None:
        self.results.update(values)
        write_atomically(self.path, json.dumps(self.results, indent=1, default=str))

    def left(self) -> float:
        return self.deadline - time.time()

    @property
    def device(self):
        """A zerolite Device: the GPU, or in a dry run the simulated one (tests/support/simulated_device.py)."""
        if self._device is None:
            if self.dry:
                sys.path.insert(0, str(ROOT / "tests"))
                from support.simulated_device import SimulatedDevice

                self._device = SimulatedDevice(seed=0, memory_bytes=4 << 30)
            else:
                import torch

                from zerolite.io.device import CudaDevice

                self._device = CudaDevice(torch.device("cuda", 0))
            self._device.adopt_thread()
        return self._device

    def prior(self, name: str) -> dict:
        """An earlier step's results (the folder's path)."""
        path = self.scratch / "results" / f"{name}.json"
        return json.loads(path.read_text()) if path.is_file() else {}


def step_machine(c: Child) -> None:
    import platform

    import psutil

    nodes = {}
    for node in sorted(Path("/sys/devices/system/node").glob("node[0-9]*")):
        with contextlib.suppress(OSError):
            nodes[node.name] = (node / "cpulist").read_text().strip()
    c.save(python=platform.python_version(), cpus=os.cpu_count(), cpus_usable=len(os.sched_getaffinity(0)),
           host_memory_gib=round(psutil.virtual_memory().total / 2**30, 1), numa_nodes=nodes or None,
           scratch_fs=filesystem_type(c.scratch), kernel=platform.release())
    fields = ["name", "memory.total", "driver_version", "pcie.link.gen.current", "pcie.link.gen.max",
              "pcie.link.width.current", "pcie.link.width.max", "pci.bus_id", "clocks.max.sm", "power.limit"]
    smi = run_quietly(["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits"])
    if smi:
        values = dict(zip(fields, [v.strip() for v in smi.splitlines()[0].split(",")]))
        bus = values.get("pci.bus_id", "")
        sysfs_bus = (bus[-12:] if len(bus) >= 12 else bus).lower()  # 00000000:18:00.0 -> 0000:18:00.0
        numa = None
        with contextlib.suppress(OSError, ValueError):
            numa = int(Path(f"/sys/bus/pci/devices/{sysfs_bus}/numa_node").read_text())
        c.save(nvidia_smi=values, driver=values.get("driver_version"), gpu_numa_node=numa,
               pcie=f"gen {values.get('pcie.link.gen.current')} x{values.get('pcie.link.width.current')} / "
                    f"gen {values.get('pcie.link.gen.max')} x{values.get('pcie.link.width.max')}")
        c.save(topology=run_quietly(["nvidia-smi", "topo", "-m"]))
    else:
        c.save(nvidia_smi=None, driver=None, pcie=None, gpu_numa_node=None)
    import torch
    import transformers

    c.save(torch=torch.__version__, cuda=torch.version.cuda, transformers=transformers.__version__)
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        c.save(gpu={"name": p.name, "memory_gib": round(p.total_memory / 2**30, 1),
                    "capability": f"{p.major}.{p.minor}", "multiprocessors": p.multi_processor_count})
    else:
        c.save(gpu={"name": "simulated device" if c.dry else None, "memory_gib": None})


class Clock:
    """Times work queued on a stream: device events on a GPU (and the simulated device), so the host's
    queueing is not counted."""

    def __init__(self, device, stream=None):
        self.device, self.stream = device, stream

    @contextlib.contextmanager
    def time(self, into: list):
        begin = self.device.record(self.stream, timing=True)
        yield
        end = self.device.record(self.stream, timing=True)
        end.synchronize()
        into.append(begin.elapsed_time(end) / 1e3)


def step_copy(c: Child) -> None:
    import torch

    device = c.device
    stream = device.new_stream()
    rates = []
    c.save(rates=rates)
    # Large matmuls (~1 TFLOP each on a GPU): a few dozen queued outlast the copies, well within the
    # launch queue (a full queue would block the host, and the copies would be queued after the matmuls ran).
    side = 8192 if not c.dry else 256
    weight = torch.randn(side, side, dtype=torch.bfloat16, device=device.torch_device)
    activations = torch.randn(side, side, dtype=torch.bfloat16, device=device.torch_device)
    for nbytes in copy_sizes(c.shapes):
        label = "256 MiB" if nbytes == c.shapes.copy_sizes[0] else "layer"
        host = device.pinned_empty(nbytes)
        host.fill_(1)
        target = device.empty(nbytes)
        device.wait_stream(stream, device.compute_stream())  # target comes from compute's memory
        device.copy(target, host, stream)  # warm
        device.synchronize(stream)
        repeats = max(2, min(20, int(4e9 // nbytes))) if not c.dry else 3
        seconds: list[float] = []
        with Clock(device, stream).time(seconds):
            for _ in range(repeats):
                device.copy(target, host, stream)
        result = {"label": f"{label} alone", "bytes": nbytes, "repeats": repeats, "seconds": seconds[0],
                  "gbps": round(nbytes * repeats / seconds[0] / 1e9, 3)}
        rates.append(result)
        c.save(rates=rates)
        # Beside matmuls: enough of them queued on compute to outlast the copies (1.5x their time alone).
        def copies(target=target, host=host, repeats=repeats) -> None:
            for _ in range(repeats):
                device.copy(target, host, stream)

        covered, beside = beside_matmuls(c, device, stream, copies, seconds[0] * 1.5, weight, activations)
        result.update(beside_gbps=round(nbytes * repeats / beside / 1e9, 3), beside_seconds=beside,
                      matmul_covered=covered)
        c.save(rates=rates)
        if not c.dry:  # an idle GPU's link may have stepped down to a lower generation when the machine step read it
            c.save(pcie_after_copies=run_quietly(["nvidia-smi",
                                                  "--query-gpu=pcie.link.gen.current,pcie.link.width.current",
                                                  "--format=csv,noheader"]))
        del host, target
    device.synchronize()
    try:
        numa = numa_copy_rates(device, stream)
        if numa:
            c.save(numa_rates=numa)
    except Exception as e:  # an extra: its failure costs only itself
        c.save(numa_error=f"{type(e).__name__}: {e}")


def cpu_list(text: str) -> set[int]:
    """A sysfs cpulist ("0-15,32-47") as a set."""
    cpus: set[int] = set()
    for part in filter(None, text.strip().split(",")):
        low, _, high = part.partition("-")
        cpus.update(range(int(low), int(high or low) + 1))
    return cpus


def numa_copy_rates(device, stream, nodes_dir: Path = Path("/sys/devices/system/node"),
                    nbytes: int = 256 * MiB) -> dict:
    """Where the machine has several NUMA nodes: the pinned rate from host memory on each (pages are
    placed where the thread that pins them, and so first touches them, runs)."""
    nodes = {}
    for node in sorted(nodes_dir.glob("node[0-9]*")):
        with contextlib.suppress(OSError, ValueError):
            nodes[node.name] = cpu_list((node / "cpulist").read_text()) & os.sched_getaffinity(0)
    nodes = {name: cpus for name, cpus in nodes.items() if cpus}
    if len(nodes) < 2:
        return {}
    repeats, rates = 8, {}
    target = device.empty(nbytes)
    device.wait_stream(stream, device.compute_stream())
    allowed = os.sched_getaffinity(0)
    # Each node's pages where the pinning thread runs: zerolite's own placement on the GPU's node set aside.
    placement = getattr(device, "numa_node", None)
    device.numa_node = None
    try:
        for name, cpus in nodes.items():
            os.sched_setaffinity(0, cpus)
            host = device.pinned_empty(nbytes)
            device.copy(target, host, stream)
            device.synchronize(stream)
            seconds: list[float] = []
            with Clock(device, stream).time(seconds):
                for _ in range(repeats):
                    device.copy(target, host, stream)
            rates[name] = round(nbytes * repeats / seconds[0] / 1e9, 3)
            del host
    finally:
        os.sched_setaffinity(0, allowed)
        device.numa_node = placement
    return rates


def beside_matmuls(c: Child, device, stream, copies, span_s: float, weight, activations) -> tuple[bool, float]:
    """Queues matmuls on compute for about span_s, then copies on stream; returns (whether the matmuls
    lasted at least as long as the copies, the copies' seconds)."""
    import torch.nn.functional as F

    if c.dry:  # the simulated device's compute runs on the calling thread: matmuls on a thread of their own
        stop = threading.Event()
        thread = threading.Thread(
            target=lambda: [F.linear(activations, weight) for _ in iter(lambda: stop.is_set(), True)], daemon=True)
        thread.start()
        seconds: list[float] = []
        with Clock(device, stream).time(seconds):
            copies()
        covered = thread.is_alive()
        stop.set()
        thread.join()
        return covered, seconds[0]
    F.linear(activations, weight)  # cuBLAS's first call of a shape sets up: not what one costs
    one: list[float] = []
    with Clock(device).time(one):
        for _ in range(3):
            F.linear(activations, weight)
    count = max(1, min(500, int(span_s / (one[0] / 3)) + 1))
    matmul_begin = device.record(timing=True)
    for _ in range(count):
        F.linear(activations, weight)
    matmul_end = device.record(timing=True)
    begin = device.record(stream, timing=True)
    copies()
    end = device.record(stream, timing=True)
    device.synchronize()
    copy_s = begin.elapsed_time(end) / 1e3
    return matmul_begin.elapsed_time(matmul_end) / 1e3 >= copy_s, copy_s


def step_matmul(c: Child) -> None:
    import torch
    import torch.nn.functional as F

    from zerolite.quant.int4_packing import CANDIDATES, cpu_packing
    from zerolite.quant.linear import Int4Linear, Int8Linear
    from zerolite.quant.quantize import WeightScheme

    device = c.device
    on = device.torch_device
    cuda = on.type == "cuda"
    k, n, group = (8192, 28672, 64) if not c.dry else (256, 512, 64)
    c.save(in_features=k, out_features=n, group_size=group, rows=[], errors={})
    errors: dict = {}
    generator = torch.Generator(device=on).manual_seed(0)
    dense = (torch.randn(n, k, device=on, dtype=torch.bfloat16, generator=generator) * 0.02)
    q = torch.randint(0, 16, (n, k), device=on, dtype=torch.uint8, generator=generator)
    scale = (torch.rand(n, k // group, device=on, dtype=torch.bfloat16, generator=generator) * 0.01 + 0.001)
    zero = (torch.randn(n, k // group, device=on, dtype=torch.bfloat16, generator=generator) * 0.01)
    scale_zero = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous()  # [groups, n, 2]: the kernels' form

    # Today's GPU path: the modules zerolite installs, dequantising at every call (dequantize=True, as on a device
    # with memory of its own). The packed bytes' order does not change the time.
    try:
        packing = cpu_packing()
    except Exception:  # this torch packs in a form zerolite does not read on this CPU: any order times the same
        packing = CANDIDATES[0]
    int4_today = Int4Linear(n, k, WeightScheme("int4", group, packing, torch.__version__), torch.bfloat16, None, True)
    int4_today.weight = torch.randint(0, 256, (n, k // 2), device=on, dtype=torch.uint8, generator=generator)
    int4_today.weight_scale_zero = scale_zero
    int8_today = Int8Linear(n, k, torch.bfloat16, None, True)
    int8_today.weight = torch.randint(-127, 128, (n, k), device=on, dtype=torch.int8, generator=generator)
    int8_today.weight_scale = scale[:, 0].contiguous()

    fused4 = None
    try:
        if cuda:
            packed_pairs = (q[:, ::2] << 4 | q[:, 1::2]).contiguous()  # uint8 [n, k/2], even columns high
            packed4 = torch.ops.aten._convert_weight_to_int4pack(packed_pairs, 8)
            fused4 = lambda x: torch.ops.aten._weight_int4pack_mm(x, packed4, group, scale_zero)  # noqa: E731
        else:
            packed4 = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 8)
            fused4 = lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed4, group, scale_zero)  # noqa: E731
        reference = ((q.to(torch.bfloat16) - 8).reshape(n, k // group, group) * scale[..., None]
                     + zero[..., None]).reshape(n, k)
        x = torch.randn(16, k, device=on, dtype=torch.bfloat16, generator=generator)
        want, got = F.linear(x, reference).float(), fused4(x).float()
        c.save(int4_fused_max_rel_err=round(float((want - got).abs().max() / want.abs().max()), 5))
        del reference
    except Exception as e:
        errors["int4 fused"] = f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
        fused4 = None
    int8_weight, int8_scale = int8_today.weight, int8_today.weight_scale
    fused8 = lambda x: torch.ops.aten._weight_int8pack_mm(x, int8_weight, int8_scale)  # noqa: E731
    variants = {"bf16": lambda x: F.linear(x, dense), "int8_today": int8_today, "int8_fused": fused8,
                "int4_today": int4_today, "int4_fused": fused4}
    c.save(errors=errors)
    rows_out = []
    iterations = 20 if not c.dry else 3
    for rows in c.shapes.matmul_rows:
        x = torch.randn(rows, k, device=on, dtype=torch.bfloat16, generator=generator)
        result = {"rows": rows}
        for name, run in variants.items():
            if run is None:
                continue
            try:
                with torch.no_grad():
                    for _ in range(2):
                        run(x)
                    seconds: list[float] = []
                    with Clock(device).time(seconds) if cuda else host_time(seconds):
                        for _ in range(iterations):
                            run(x)
                result[f"{name}_ms"] = round(seconds[0] / iterations * 1e3, 4)
            except Exception as e:
                errors.setdefault(name, f"{type(e).__name__}: {' '.join(str(e).split())[:300]}")
        weight_bytes = {"bf16": 2 * n * k, "int8_today": n * k, "int8_fused": n * k, "int4_today": n * k // 2,
                        "int4_fused": n * k // 2}
        for name, nbytes in weight_bytes.items():
            if result.get(f"{name}_ms"):
                result[f"{name}_weight_gbps"] = round(nbytes / (result[f"{name}_ms"] / 1e3) / 1e9, 1)
        rows_out.append(result)
        c.save(rows=rows_out, errors=errors)


@contextlib.contextmanager
def host_time(into: list):
    started = time.perf_counter()
    yield
    into.append(time.perf_counter() - started)


def llama_config(s: Shapes) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": s.hidden,
            "intermediate_size": s.intermediate, "num_attention_heads": s.heads, "num_key_value_heads": s.kv_heads,
            "num_hidden_layers": s.layers, "vocab_size": s.vocab, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
            "rope_theta": 500000.0, "tie_word_embeddings": False, "hidden_act": "silu", "attention_bias": False,
            "mlp_bias": False, "head_dim": s.head_dim, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
            "dtype": "bfloat16", "torch_dtype": "bfloat16"}


def layer_tensors(s: Shapes, i: int) -> list[tuple[str, tuple[int, ...]]]:
    h, kv, p = s.hidden, s.kv_heads * s.head_dim, f"model.layers.{i}."
    return sorted([(p + "input_layernorm.weight", (h,)), (p + "post_attention_layernorm.weight", (h,)),
                   (p + "self_attn.q_proj.weight", (h, h)), (p + "self_attn.k_proj.weight", (kv, h)),
                   (p + "self_attn.v_proj.weight", (kv, h)), (p + "self_attn.o_proj.weight", (h, h)),
                   (p + "mlp.gate_proj.weight", (s.intermediate, h)), (p + "mlp.up_proj.weight", (s.intermediate, h)),
                   (p + "mlp.down_proj.weight", (h, s.intermediate))])


def write_safetensors(path: Path, tensors: list[tuple[str, tuple[int, ...]]], pattern: memoryview,
                      norms: memoryview) -> int:
    """A bf16 safetensors file of these tensors: matrices filled from pattern (small random values,
    repeated), norm weights with ones; fsynced. Returns its bytes."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape in tensors:
        nbytes = 2
        for d in shape:
            nbytes *= d
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % 4096)  # the data starts page-aligned
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        for name, shape in tensors:
            left = header[name]["data_offsets"][1] - header[name]["data_offsets"][0]
            source = norms if len(shape) == 1 else pattern
            while left:
                chunk = source[: min(left, len(source))]
                f.write(chunk)
                left -= len(chunk)
        f.flush()
        os.fsync(f.fileno())
    return 8 + len(raw) + offset


def drop_cached(paths: list[Path]) -> bool:
    """Evicts the files from the page cache (fadvise works without root on clean pages), and drops
    the whole cache where allowed; says whether the latter worked."""
    from zerolite.planner.machine import drop_page_cache

    for path in paths:
        with contextlib.suppress(OSError):
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    return drop_page_cache()


def disk_read_rate(path: Path, limit_s: float) -> dict:
    """The disk's own rate: path (a layer's shard, out of the page cache) read through zerolite's
    engine in 256 MiB requests, O_DIRECT, for at most limit_s."""
    from zerolite.io.engine import ALIGNMENT, IoEngine, aligned_empty

    engine = IoEngine()
    request = 256 * MiB
    buffer = aligned_empty(request)
    size = path.stat().st_size // ALIGNMENT * ALIGNMENT
    done, started = 0, time.perf_counter()
    while done < size and time.perf_counter() - started < limit_s:
        nbytes = min(request, size - done)
        engine.read(path, buffer[:nbytes], done)
        done += nbytes
    seconds = time.perf_counter() - started
    return {"disk_read_bytes": done, "disk_read_s": round(seconds, 3), "disk_gbps": round(done / seconds / 1e9, 3),
            "disk_engine": engine.backend}


def step_folder(c: Child) -> None:
    import concurrent.futures

    import torch

    from zerolite.convert.resolve import ensure_layout
    from zerolite.layout.folder import Layout

    s = c.shapes
    source = c.scratch / ("llama70b-8layers" if not c.dry else "tiny-8layers")
    config = llama_config(s)
    marker = source / ".complete"
    shards = {f"model-{i + 1:05d}-of-{s.layers + 1:05d}.safetensors": layer_tensors(s, i) for i in range(s.layers)}
    shards[f"model-{s.layers + 1:05d}-of-{s.layers + 1:05d}.safetensors"] = [
        ("lm_head.weight", (s.vocab, s.hidden)), ("model.embed_tokens.weight", (s.vocab, s.hidden)),
        ("model.norm.weight", (s.hidden,))]
    reused = marker.is_file() and json.loads(marker.read_text()) == config
    c.save(source=str(source), layers=s.layers, layer_bytes=s.layer_bytes, reused=reused)
    if not reused:
        shutil.rmtree(source, ignore_errors=True)
        source.mkdir(parents=True)
        (source / "config.json").write_text(json.dumps(config, indent=1))
        (source / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2,
                                                                   "pad_token_id": 0}))
        weight_map = {name: shard for shard, tensors in shards.items() for name, _ in tensors}
        pattern = memoryview((torch.randn(32 * MiB // 2, generator=torch.Generator().manual_seed(0)) * 0.02)
                             .to(torch.bfloat16).view(torch.uint8).numpy().tobytes())
        norms = memoryview(torch.ones(max(s.hidden, 4096), dtype=torch.bfloat16).view(torch.uint8).numpy().tobytes())
        started = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(4) as pool:  # writes release the GIL: one file per writer
            sizes = list(pool.map(lambda item: write_safetensors(source / item[0], item[1], pattern, norms),
                                  shards.items()))
        write_s = time.perf_counter() - started
        total = sum(sizes)
        (source / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                         "weight_map": weight_map}))
        marker.write_text(json.dumps(config))
        c.save(bytes=total, write_s=round(write_s, 2), write_gbps=round(total / write_s / 1e9, 3))
    else:
        c.save(bytes=sum((source / shard).stat().st_size for shard in shards))
    c.save(cache_dropped=drop_cached([source / shard for shard in shards]))
    from zerolite.io.engine import supports_direct_io

    first = source / next(iter(shards))
    c.save(direct_io=supports_direct_io(first))
    c.save(**disk_read_rate(first, limit_s=6.0))
    started = time.perf_counter()
    folder = ensure_layout(str(source), c.scratch / "layouts", None, False, False)
    manifest = Layout.open(folder).manifest
    layers = set(manifest.layer_names)
    c.save(layout=str(folder), in_place=bool(manifest.in_place),
           plan_in_place_s=round(time.perf_counter() - started, 2),
           block_bytes={b.name: b.length for b in manifest.blocks},
           always_bytes=manifest.nbytes(b.name for b in manifest.blocks if b.name not in layers),
           widest_layer_bytes=max(manifest.block(name).length for name in layers))
