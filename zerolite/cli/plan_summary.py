"""The plan in words, printed before a run: which blocks live where, the K/V cache's split, the
bytes a step streams and what that costs at the speed the disk read while loading.

    show_plan(lm, batch_size=16, tokens=80)     # on stderr, dimmed
    for line in summarize(lm, batch_size=16, tokens=80): ...
"""

from __future__ import annotations

from zerolite.memory_model import kv_bytes_per_token
from zerolite.progress import stderr
from zerolite.runtime.host_attention import HostAttendingCaches
from zerolite.runtime.kv_cache import disk_share, offloaded_share


def show_plan(lm, batch_size: int, tokens: int, chosen: bool = False) -> None:
    """Where every block and the K/V cache live, and what a step must move, before anything runs."""
    lines = summarize(lm, batch_size, tokens)
    if chosen:
        lines.append(f"batch size: {batch_size} (auto: zerolite plan's choice for this job, within what fits)")
    for line in lines:
        stderr.print(f"[dim]{line}[/dim]", highlight=False, soft_wrap=True)


def summarize(lm, batch_size: int | None = None, tokens: int | None = None) -> list[str]:
    plan, manifest, device = lm.plan, lm.layout.manifest, lm.device.name

    def size(names) -> str:
        return f"{manifest.nbytes(names) / 1e9:.2f} GB"

    tiers = [f"{len(plan.resident)} blocks resident on {device} ({size(plan.resident)}: {layer_list(plan.resident)})"]
    if plan.in_memory:
        tiers.append(f"{len(plan.in_memory)} layers in host memory "
                     f"({size(plan.in_memory)}: {layer_list(plan.in_memory)})")
    if plan.on_disk:
        source = (f"the checkpoint's {len(manifest.shards)} shard(s), in place" if manifest.in_place else "disk")
        tiers.append(f"{len(plan.on_disk)} layers streamed from {source} "
                     f"({size(plan.on_disk)} per step: {layer_list(plan.on_disk)})")
    lines = ["plan: " + "; ".join(tiers)]
    routed = [name for name in plan.on_disk if name in lm.per_expert]
    per_step = manifest.nbytes(plan.on_disk)
    if routed:
        dense = sum(manifest.block(name).dense_length for name in routed)
        experts = manifest.nbytes(routed) - dense
        share = routed_share(lm.model.config.get_text_config(), manifest.block(routed[0]).experts.count)
        per_step -= experts * (1 - share)
        lines.append(f"experts: of those layers' {experts / 1e9:.2f} GB of experts a step reads only the routed ones "
                     f"(at batch 1, {share:.0%}: {experts * share / 1e9:.2f} GB), beside their {dense / 1e9:.2f} GB "
                     "of attention, norms and routers"
                     + (f"; {plan.expert_cache / 1e9:.2f} GB of host memory keeps experts across steps"
                        if plan.expert_cache else ""))
    if lm.host_experts:
        lines.append(f"experts on the CPU: the routed experts of {len(lm.host_experts)} layers computed by the host "
                     f"from host memory ({layer_list(lm.host_experts)}); only their "
                     f"tokens' hidden states cross to and from {device}, which computes the rest")
    if manifest.quantization:
        lines[0] += f" (layer weights {manifest.quantization['weights']})"

    config = lm.model.config
    layers = config.get_text_config(decoder=True).num_hidden_layers
    fraction = lm.policy.kv_offload
    on_host = round(offloaded_share(config, fraction) * layers) if fraction else 0
    bits = lm.policy.kv_bits
    kv = f"K/V cache: {on_host} of {layers} layers in host memory" + (f", at {bits} bits" if bits < 16 else "")
    if lm.policy.kv_disk:
        on_disk = round(disk_share(config, fraction, lm.policy.kv_disk) * layers)
        kv += f"; {on_disk} on disk, a file each under {lm.parts.caches.disk.root}, read one layer ahead"
    if fraction and not on_host:
        kv += " (--kv-offload moves full-attention layers only, and this model has none)"
    if on_host and isinstance(lm.parts.caches, HostAttendingCaches):
        kv += ", attended there by the CPU" + (" (only the query and the output cross the link)"
                                               if lm.device.separate_memory else "")
    if batch_size and tokens:
        kv_bytes = batch_size * tokens * kv_bytes_per_token(config, lm.model.dtype, bits)
        kv += f", {kv_bytes / 1e9:.2f} GB in all at most (batch {batch_size} x {tokens} tokens)"
    lines.append(kv)

    world = lm.world
    if world.distributed:
        held = plan.in_host(lm.device.separate_memory)
        lines.append(f"ranks: {world.size}, {world.local_size} on this node"
                     + (", each on a GPU of its own" if lm.device.separate_memory else "")
                     + (f"; the node's ranks share one copy of what host memory holds ({size(held)})"
                        if world.local_size > 1 and held else ""))
    if plan.on_disk:
        gbps = lm.load_read_gbps
        shared = world.local_size
        lines.append(f"bound: reading {per_step / 1e9:.2f} GB per step{' at batch 1' if routed else ''} takes "
                     f"{per_step * shared / (gbps * 1e9):.3f} s at the {gbps:.2f} GB/s loading read"
                     + (f", which the {shared} ranks on this node share when they read the same disk"
                        if shared > 1 else "")
                     + "; a step takes the longer of that and its compute")
    if lm.draft is not None:
        draft = lm.draft.layout.manifest
        lines.append(f"draft: {lm.draft.layout.folder.name} held on {device} "
                     f"({draft.nbytes(b.name for b in draft.blocks) / 1e9:.2f} GB), a guess takes "
                     f"{lm.speculator.length.draft_step_s * 1e3:.1f} ms; the ring holds {lm.policy.prefetch_depth} "
                     "layers, so that the disk reads on while it guesses")
    return lines


def routed_share(config, experts: int) -> float:
    """The share of a layer's experts one token uses: top-k of them (all when the config does not say)."""
    top_k = getattr(config, "num_experts_per_tok", None)
    return min(top_k / experts, 1.0) if isinstance(top_k, int) and top_k > 0 else 1.0


def layer_list(names) -> str:
    """"embed, head, layers 0-3, 8, 10" from block names: runs of layers written as ranges."""
    others = [name for name in names if not name.startswith("layers.")]
    numbers = sorted(int(name.removeprefix("layers.")) for name in names if name.startswith("layers."))
    runs: list[list[int]] = []
    for n in numbers:
        if runs and n == runs[-1][-1] + 1:
            runs[-1].append(n)
        else:
            runs.append([n])
    spans = [str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs]
    return ", ".join(others + ([f"layers {', '.join(spans)}"] if spans else []))
