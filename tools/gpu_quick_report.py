"""tools/gpu_quick.py's report: figures derived from the steps' (a streaming step's bytes over its time
against the pinned and disk rates, the headline the issue asks for), and the markdown written beside the JSON."""

from __future__ import annotations

import contextlib
import re

from gpu_quick_steps import STREAM_CASES

SANITIZER_FINDING = "CSAN detected a possible data race"


def tests_summary(output: str, command: list[str], returncode: int | None) -> dict:
    """pytest's closing counts; where it was stopped before printing them, the counts of its verbose
    per-test lines so far (partial); the failures' lines, and each sanitizer finding's first lines."""
    counts, partial = {}, False
    lines = output.splitlines()
    for line in reversed(lines):
        found = re.findall(r"(\d+) (passed|failed|errors?|skipped|xfailed|xpassed|deselected)\b", line)
        if found and re.search(r" in [\d.]+s", line):
            counts = {what: int(n) for n, what in found}
            break
    else:
        for line in lines:
            verdict = re.search(r"\b(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b", line)
            if verdict and "::" in line and not line.startswith(("FAILED ", "ERROR ")):
                key = verdict[1].lower()
                counts[key] = counts.get(key, 0) + 1
        partial = True
    findings = ["\n".join(lines[i:i + 6]) for i, line in enumerate(lines) if SANITIZER_FINDING in line]
    failed = [line for line in lines if line.startswith(("FAILED ", "ERROR "))]
    if partial:  # no short summary either: the failures from their per-test lines
        failed = [line for line in lines if "::" in line and re.search(r"\b(FAILED|ERROR)\b", line)]
    return {"command": " ".join(command[1:]), "returncode": returncode, "counts": counts, "partial": partial,
            "sanitizer_findings": findings, "failed": failed[:30]}


def headline(name: str, data: dict) -> str:
    """The step's main figures, for the progress line."""
    with contextlib.suppress(Exception):
        if name == "machine":
            return f": {data.get('gpu', {}).get('name')} {data.get('pcie')}"
        if name == "copy":
            return ": " + ", ".join(f"{r['label']} {r['gbps']} GB/s" for r in data.get("rates", []))
        if name == "matmul":
            return ": " + ", ".join(f"{row['rows']} rows int4 today/fused/bf16 {row.get('int4_today_ms')}/"
                                    f"{row.get('int4_fused_ms')}/{row.get('bf16_ms')} ms"
                                    for row in data.get("rows", []))
        if name.startswith("stream-"):
            return ": " + ", ".join(f"batch {b}: step {r.get('median_step_s')} s"
                                    for b, r in data.get("batches", {}).items())
        if name == "profile":
            return ": " + ", ".join(f"batch {b}: copy busy {r.get('copy_busy_share')}"
                                    for b, r in data.get("batches", {}).items())
        if name.startswith("tests"):
            return f": {data.get('counts')}, sanitizer findings {len(data.get('sanitizer_findings', []))}"
    return ""


def derive(report: dict) -> None:
    """Each streaming case's bytes per step over its time, against the pinned rate at a layer's size."""
    rates = {r["label"]: r for r in report.get("copy", {}).get("rates", [])}
    layer = rates.get("layer alone", {}).get("gbps")
    disk = report.get("folder", {}).get("disk_gbps")
    report["pinned_gbps"], report["disk_gbps"] = layer, disk
    for name, case in report["streaming"].items():
        for result in case.get("batches", {}).values():
            step, moved = result.get("median_step_s"), result.get("moved_bytes_per_step")
            if step and moved:
                result["moved_gbps"] = round(moved / step / 1e9, 3)
                result["share_of_pinned_rate"] = round(moved / step / 1e9 / layer, 3) if layer else None
                result["link_bound_step_s"] = round(moved / (layer * 1e9), 4) if layer else None
                if name == "disk" and disk:  # its bound is the disk's rate, lower than the link's
                    result["share_of_disk_rate"] = round(moved / step / 1e9 / disk, 3)
                    result["disk_bound_step_s"] = round(moved / (disk * 1e9), 4)
    report["headline"] = headline_figures(report)


def headline_figures(report: dict) -> dict:
    """What the issue asks the note to quote: the link-busy share, the step against the link bound,
    int4's speed against bf16."""
    figures: dict = {"pinned_gbps_at_a_layer": report.get("pinned_gbps"), "disk_gbps": report.get("disk_gbps")}
    with contextlib.suppress(Exception):
        figures["pinned_gbps_at_a_layer_beside_matmuls"] = report["copy"]["rates"][1]["beside_gbps"]
    figures = {k: v for k, v in figures.items() if v is not None}
    for batch in ("1", "32"):
        with contextlib.suppress(Exception):
            figures[f"copy_busy_share_batch_{batch}"] = report["profile"]["batches"][batch]["copy_busy_share"]
            figures[f"longest_copy_gap_ms_batch_{batch}"] = report["profile"]["batches"][batch]["longest_copy_gap_ms"]
    for batch in ("1", "32"):
        with contextlib.suppress(Exception):
            pinned = report["streaming"]["pinned"]["batches"][batch]
            figures[f"pinned_step_s_batch_{batch}"] = pinned["median_step_s"]
            figures[f"pinned_link_bound_s_batch_{batch}"] = pinned.get("link_bound_step_s")
            figures[f"pinned_share_of_link_batch_{batch}"] = pinned.get("share_of_pinned_rate")
    for row in report.get("matmul", {}).get("rows", []):
        for variant in ("int4_fused", "int4_today"):
            speedup = ratio(row.get("bf16_ms"), row.get(f"{variant}_ms"))
            if speedup is not None:
                figures[f"{variant}_vs_bf16_rows_{row['rows']}"] = speedup
    return figures


def cell(value) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def markdown(report: dict) -> str:
    m = report.get("machine", {})
    gpu = m.get("gpu") or {}
    parts = [f"# zerolite gpu_quick{' (dry run: simulated device, tiny shapes)' if report['dry_run'] else ''}",
             f"{report['started']}, commit {report.get('commit') or 'unknown'}, budget {report['budget_s']} s"
             + (f", took {report['seconds']} s" if "seconds" in report else "")]

    figures = report.get("headline") or {}
    parts.append("## Headline\n\n"
                 + (table(["figure", "value"], [[k, v] for k, v in figures.items()]) if figures else "nothing yet")
                 + "\n\n(copy busy share: of the profiled decode steps' GPU time; share of link: a step's bytes "
                 "over its time over the pinned rate at a layer's size; x vs bf16: bf16's time over the variant's, "
                 "above 1 faster)")
    parts.append("## Steps\n\n" + table(["step", "status", "seconds", "limit s", "error"],
                                        [[n, s["status"], s.get("seconds"), s.get("limit_s"),
                                          s.get("error") or s.get("why")]
                                         for n, s in report["steps"].items()]))

    parts.append("## Machine\n\n" + table(["what", "value"], [
        ["GPU", gpu.get("name")], ["GPU memory (GiB)", gpu.get("memory_gib")], ["driver", m.get("driver")],
        ["PCIe (current / max)", m.get("pcie")], ["GPU's NUMA node", m.get("gpu_numa_node")],
        ["NUMA nodes", m.get("numa_nodes")],
        ["CPUs (usable / all)", f"{m.get('cpus_usable')} / {m.get('cpus')}" if m else None],
        ["host memory (GiB)", m.get("host_memory_gib")], ["scratch filesystem", m.get("scratch_fs")],
        ["torch / CUDA", f"{m.get('torch')} / {m.get('cuda')}" if m else None],
        ["transformers", m.get("transformers")], ["python", m.get("python")]]))

    copy = report.get("copy", {})
    parts.append("## Pinned host-to-device copies\n\n"
                 + (f"PCIe link right after the copies (generation, width): {copy['pcie_after_copies']}\n\n"
                    if copy.get("pcie_after_copies") else "")
                 + (f"256 MiB from host memory on each NUMA node (GB/s; the GPU's node: {m.get('gpu_numa_node')}): "
                    f"{copy['numa_rates']}\n\n" if copy.get("numa_rates") else "") + table(
        ["size", "MB", "GB/s", "repeats", "beside matmuls: GB/s", "matmuls covered the copies"],
        [[r["label"], round(r["bytes"] / 1e6, 1), r.get("gbps"), r.get("repeats"), r.get("beside_gbps"),
          r.get("matmul_covered")]
         for r in copy.get("rates", []) if "alone" in r["label"]]))

    mm = report.get("matmul", {})
    parts.append(f"## Matmuls, weight {mm.get('in_features')} x {mm.get('out_features')} "
                 "(ms per call; x: against bf16)\n\n"
                 + table(["rows", "bf16", "int8 today", "int8 fused", "int4 today", "int4 fused", "int4 fused x",
                          "int4 today x"],
                         [[r["rows"], r.get("bf16_ms"), r.get("int8_today_ms"), r.get("int8_fused_ms"),
                           r.get("int4_today_ms"), r.get("int4_fused_ms"),
                           ratio(r.get("bf16_ms"), r.get("int4_fused_ms")),
                           ratio(r.get("bf16_ms"), r.get("int4_today_ms"))] for r in mm.get("rows", [])])
                 + "".join(f"\n\n{k}: {v}" for k, v in mm.get("errors", {}).items())
                 + (f"\n\nfused int4 against its dense weight, max relative error: {mm.get('int4_fused_max_rel_err')}"
                    if "int4_fused_max_rel_err" in mm else ""))

    f = report.get("folder", {})
    parts.append("## Model folder\n\n" + table(["what", "value"], [
        ["layers x bytes", f"{f.get('layers')} x {f.get('layer_bytes')}" if f else None],
        ["GB written", gb(f.get("bytes"))], ["write s (with fsync)", f.get("write_s")],
        ["write GB/s", f.get("write_gbps")], ["page cache dropped", f.get("cache_dropped")],
        ["disk read GB/s (a layer's shard, O_DIRECT, 256 MiB requests)", f.get("disk_gbps")],
        ["reused", f.get("reused")], ["O_DIRECT opens", f.get("direct_io")], ["in-place layout", f.get("layout")]]))

    rows = []
    for name, case in report["streaming"].items():
        for batch, r in case.get("batches", {}).items():
            note = r.get("error") or r.get("skipped") or (f"{r['share_of_disk_rate']} of the disk's rate"
                                                          if "share_of_disk_rate" in r else None)
            rows.append([name, batch, r.get("median_step_s"), r.get("steps"), r.get("tokens_per_s"),
                         gb(r.get("moved_bytes_per_step")), r.get("moved_gbps"), r.get("share_of_pinned_rate"),
                         r.get("link_bound_step_s"), r.get("read_gb_per_forward"), note])
    parts.append(f"## Streaming in place (pinned rate {cell(report.get('pinned_gbps'))} GB/s)\n\n"
                 + "\n".join(f"- {name}: {STREAM_CASES[name][1]}; " + plan_line(case)
                             for name, case in report["streaming"].items())
                 + "\n\n" + table(["case", "batch", "median step s", "steps", "tokens/s", "GB moved/step", "GB/s",
                                   "of pinned rate", "link bound s", "GB read/forward", "note"], rows))

    prof = report.get("profile", {})
    parts.append("## Profile of two decode steps (every layer streamed from pinned memory)\n\n" + table(
        ["batch", "window ms", "copy busy share", "longest copy gap ms", "copy/kernel overlap", "kernel busy share",
         "copies", "kernels", "cache tokens after", "source"],
        [[b, r.get("window_ms"), r.get("copy_busy_share"), r.get("longest_copy_gap_ms"), r.get("overlap_share"),
          r.get("kernel_busy_share"), r.get("copies"), r.get("kernels"), r.get("cache_tokens"), r.get("source")]
         for b, r in prof.get("batches", {}).items()])
        + (f"\n\n{prof['note']}" if prof.get("note") else ""))

    tests = report.get("tests", {})
    lines = []
    for name, t in tests.items():
        lines.append(f"- {name}: `{t.get('command')}`: {t.get('counts') or 'no test ran'}"
                     + (" (stopped before pytest's summary: counted from its lines)" if t.get("partial") else "")
                     + "; "
                     + (f"sanitizer findings: {len(t.get('sanitizer_findings', []))}" if t.get("sanitizer")
                        else "no sanitizer"))
        lines += [f"  - {line}" for line in t.get("failed", [])]
        lines += ["```\n" + finding + "\n```" for finding in t.get("sanitizer_findings", [])[:5]]
    parts.append("## CUDA tests (real device only)\n\n" + ("\n".join(lines) or "not run"))
    return "\n\n".join(parts) + "\n"


def ratio(a, b):
    """a / b to 3 significant figures (a tiny ratio is a figure too, not 0); None without both."""
    return float(f"{a / b:.3g}") if a and b else None


def gb(nbytes):
    return round(nbytes / 1e9, 3) if nbytes else None


def plan_line(case: dict) -> str:
    plan = case.get("plan")
    if not plan:
        return case.get("error", "not run")
    return (f"resident layers {plan['resident_layers']}, streamed {plan['streamed']}, "
            f"of them from disk {plan['on_disk']}; "
            f"ring {plan['prefetch_depth']}, engine {plan.get('io_backend')}; load {case.get('load_s')} s")
