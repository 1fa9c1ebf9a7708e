"""zerolite profile's reports: one run's table and verdict, or one row per rank and the job's totals."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table


def rank_totals(every: list[dict]) -> dict:
    """A torchrun profile's job: tokens/s and read rates add up over ranks running at once."""
    return {
        "ranks": len(every),
        "decode_tokens_per_s": sum(r["batch_size"] / r["decode_step_s"] for r in every),
        "streamed_bytes_per_step": sum(r["streamed_bytes_per_step"] for r in every),
        "achieved_read_gbps": sum(r["achieved_read_gbps"] or 0 for r in every) or None,
        "read_gbps": sum(r["read_gbps"] or 0 for r in every) or None,
    }


def show_rank_reports(every: list[dict], totals: dict) -> None:
    """One row per rank, then the job's totals, and each rank's verdict."""
    first = every[0]
    table = Table(title=f"zerolite profile: {first['offload']} offload, {len(every)} ranks, "
                        f"depth {first['prefetch_depth']}, batch {first['batch_size']} each")
    for column in ("rank", "device", "decode step", "tokens/s", "streamed per step", "achieved read", "read-only pass",
                   "limited by"):
        table.add_column(column, justify="left" if column in ("device", "limited by") else "right")

    def rate(gbps):
        return f"{gbps:.2f} GB/s" if gbps else "-"

    for rank, r in enumerate(every):
        table.add_row(str(rank), r["device"], f"{r['decode_step_s'] * 1e3:.1f} ms",
                      f"{r['batch_size'] / r['decode_step_s']:.1f}", f"{r['streamed_bytes_per_step'] / 1e9:.3f} GB",
                      rate(r["achieved_read_gbps"]), rate(r["read_gbps"]), r["bottleneck"])
    table.add_row("all", "", "", f"{totals['decode_tokens_per_s']:.1f}",
                  f"{totals['streamed_bytes_per_step'] / 1e9:.3f} GB", rate(totals["achieved_read_gbps"]),
                  rate(totals["read_gbps"]), "", style="bold")
    out = Console()
    out.print(table)
    for rank, r in enumerate(every):
        out.print(f"rank {rank}: {r['verdict']}")


def show_report(report) -> None:
    table = Table(title=f"zerolite profile: {report.offload} offload on {report.device}, "
                        f"depth {report.prefetch_depth}, batch {report.batch_size}")
    table.add_column("measure")
    table.add_column("value", justify="right")

    def rate(gbps):
        return f"{gbps:.2f} GB/s" if gbps is not None else "-"

    rows = [
        ("disk read bandwidth (read-only pass of the streamed blocks)", rate(report.read_gbps)),
        ("host-to-device bandwidth (measured)", rate(report.h2d_gbps)),
        ("prefill step", f"{report.prefill_s * 1e3:.1f} ms"),
        ("  compute per token (decode's per sequence)",
         f"{report.prefill_compute_per_token_s * 1e3:.2f} ms ({report.decode_compute_per_token_s * 1e3:.2f} ms)"
         + (" slow" if report.slow_prefill else "")),
        ("decode step (median)", f"{report.decode_step_s * 1e3:.1f} ms"),
        ("  compute waiting for bytes", f"{report.wait_s * 1e3:.1f} ms"),
        ("  compute", f"{report.compute_s * 1e3:.1f} ms"),
        ("  I/O at the read-only pass's rate" if report.read_gbps else "  I/O at the measured bandwidth",
         f"{report.io_s * 1e3:.1f} ms"),
        ("streamed per step", f"{report.streamed_bytes_per_step / 1e9:.3f} GB"),
        ("achieved read rate", rate(report.achieved_read_gbps)),
        ("share of the bound", f"{report.share_of_bound:.0%}"),
        ("overlap (step / max(I/O, compute))", f"{report.overlap:.2f}"),
        ("transfers in flight",
         f"{report.link_busy:.0%} of the step, {report.in_flight_bytes / 1e6:.0f} MB on average"),
    ]
    if (experts := report.experts) is not None:
        rows += [
            ("  of it dense parts / experts", f"{experts['dense_bytes_per_step'] / 1e9:.3f} GB / "
                                              f"{experts['expert_bytes_per_step'] / 1e9:.3f} GB"),
            ("  expert cache hits",
             "-" if experts["expert_cache_hit_rate"] is None else f"{experts['expert_cache_hit_rate']:.0%}"),
            ("  next-layer expert guesses routed to",
             "-" if experts["prefetch_guess_rate"] is None else f"{experts['prefetch_guess_rate']:.0%}"),
        ]
    if (spec := report.speculation) is not None:
        rows += [
            ("draft: guesses kept",
             f"{spec['accepted_tokens']} of {spec['draft_tokens']} ({spec['acceptance_rate'] or 0:.0%})"),
            ("  tokens per pass over the weights", f"{spec['tokens_per_pass'] or 0:.2f}"),
            ("  time drafting / in the model's passes", f"{spec['draft_s']:.2f} s / {spec['target_s']:.2f} s"),
        ]
    for row in rows:
        table.add_row(*row)
    out = Console()
    out.print(table)
    out.print(f"[bold]{report.verdict}[/bold]")
    for advice in report.advice:
        out.print(f"  - {advice}")
