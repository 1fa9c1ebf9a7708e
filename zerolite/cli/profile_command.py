"""zerolite profile: where each step's time goes and what limits it, or the disk's own read speed."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from zerolite.cli import options
from zerolite.cli.app import app
from zerolite.cli.plan_summary import show_plan
from zerolite.cli.ranks import start_world
from zerolite.cli.reports import rank_totals, show_rank_reports, show_report
from zerolite.errors import ZeroliteError
from zerolite.planner import measurements


@app.command()
@options.with_load_options
def profile(
    batch_size: Annotated[int, typer.Option(min=1, help="Sequences per step.")] = 1,
    new_tokens: Annotated[int, typer.Option(min=2, help="Steps to run: one prefill, the rest decode.")] = 8,
    prompt_tokens: Annotated[int, typer.Option(min=1, help="Length of the random prompts.")] = 16,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
    trace: Annotated[Path | None, typer.Option(help="Write a Chrome trace (open it in Perfetto).")] = None,
    plot: Annotated[Path | None, typer.Option(
        help="Draw the timeline of the last steps into a PNG (needs matplotlib).")] = None,
    disk: Annotated[Path | None, typer.Option(
        help="Only measure the read bandwidth of this layout, file or folder.")] = None,
    **load,
) -> None:
    """Show where each step's time goes and what limits it: disk, copies, compute or prefetch (under
    torchrun: every rank at once, reported per rank and in total; rank 0 writes --trace and --plot)."""
    given = {**{k: v for k, v in locals().items() if k != "load"}, **load}
    import json

    for target in (trace, plot):
        if target is not None and not target.parent.is_dir():
            raise ZeroliteError(f"cannot write {target}: folder {target.parent} does not exist")
    if disk is not None:
        from zerolite.planner.faults import planner_part
        from zerolite.planner.machine import measure_disk

        with planner_part(f"measure the disk at {disk}"):
            figures = measure_disk(disk)
        measurements.record_disk(disk, figures["read_gbps"], figures["bytes"])
        if as_json:
            typer.echo(json.dumps(figures))
        else:
            typer.echo(f"{figures['file']}: {figures['read_gbps']:.2f} GB/s sequential O_DIRECT reads "
                       f"({figures['bytes'] / 1e9:.2f} GB in {figures['seconds']:.2f} s, {figures['backend']})")
        return

    from zerolite.profile.run import profile_run
    from zerolite.profile.trace import plot_timeline, write_trace
    from zerolite.runtime.timeline import Timeline

    spec = options.to_load_spec(load)
    if spec.draft is not None and batch_size != 1:
        raise ZeroliteError(f"--draft profiles speculative decoding, which runs at batch 1, and --batch-size is "
                            f"{batch_size}: leave out --batch-size, or leave out --draft")
    world = start_world(given)
    timeline = Timeline()
    with options.load_model(spec, timeline=timeline, show_progress=not as_json, world=world) as lm:
        if not as_json and world.leads:
            show_plan(lm, batch_size, prompt_tokens + new_tokens)
        report = profile_run(lm, timeline, batch_size, new_tokens, prompt_tokens)
        if world.leads:
            record_machine(lm, report)
        every = world.all_gather(lambda: report.to_dict(), "profiling")
    if not world.leads:
        return
    if trace is not None:
        write_trace(timeline, trace)
    if plot is not None:
        plot_timeline(timeline, plot, report.verdict,
                      f"{spec.offload} offload, depth {lm.policy.prefetch_depth}, batch {batch_size}, "
                      f"{report.decode_step_s * 1e3:.0f} ms per decode step")
    if world.distributed:
        totals = rank_totals(every)
        if as_json:
            typer.echo(json.dumps({"ranks": every, "total": totals}, indent=2))
        else:
            show_rank_reports(every, totals)
    elif as_json:
        typer.echo(json.dumps(report.to_dict(), indent=2))
    else:
        show_report(report)


def record_machine(lm, report) -> None:
    """What the run measured of the machine, for zerolite plan: the read-only pass's rate on the
    file system the layers streamed from, and host-to-device copies."""
    if report.read_gbps:
        passes = max(report.new_tokens - 1, 1)  # the read-only pass read the streamed blocks once per decode step
        measurements.record_disk(lm.layout.read_paths[0], report.read_gbps, report.streamed_bytes_per_step * passes)
    if report.h2d_gbps:
        measurements.record("h2d_gbps", report.h2d_gbps)
