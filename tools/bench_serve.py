"""zerolite serve under concurrent clients: how many tokens per second one pass over the weights
gives when several streaming clients share it, against one client alone. Run as root (the page
cache is dropped before each phase).

    python tools/bench_serve.py --model LAYOUT [--clients 16] [--prompt-tokens 32] [--new-tokens 48]
                                [--json out.json] [--plot clients.png]

One server process, `zerolite serve --offload nvme --cpu-memory 0 --gpu-memory 0` (every layer read
from disk at every step), as a user starts it. First one client alone, then --clients at once; each
streams one request of --prompt-tokens random token ids (seed 0, a prompt of its own per client)
for exactly --new-tokens tokens (ignore_eos), greedy.

Aggregate tokens/s: every client's tokens over the wall time from the first request sent to the
last token received. Time to first token: from a request sent to its first token. Inter-token
latency: the gaps between one client's successive tokens. Both as median and p95 over all clients.
The server's /metrics gives the steps taken and the bytes they read.

The benchmark model (1.9 GB of bf16 Llama, 16 layers): python tools/bench.py --make-model
--source /work/bench/llama19/source --layout /work/bench/llama19/layout
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table

from zerolite.planner.machine import drop_page_cache

START_TIMEOUT_S = 600
REQUEST_TIMEOUT = httpx.Timeout(1800.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a layout (or checkpoint) to serve")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--spread", type=float, default=0.0, help="seconds over which the clients' first requests are "
                        "spread evenly (0: all at once); later ones then join a batch already decoding")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", type=Path, default=None, help="write every figure here too")
    parser.add_argument("--plot", type=Path, default=None, help="draw each client's tokens over time (matplotlib)")
    args = parser.parse_args()

    with Server(args.model, args.device, args.clients) as server:
        phases = {}
        for name, clients in (("1 client", 1), (f"{args.clients} clients", args.clients)):
            if not drop_page_cache():
                print("bench_serve: cannot drop the page cache (not root): reads may come from memory", file=sys.stderr)
            before = server.metrics()
            phases[name] = run_phase(server, clients, args.prompt_tokens, args.new_tokens, args.spread)
            after = server.metrics()
            steps = after["zerolite_step_seconds_count"] - before["zerolite_step_seconds_count"]
            phases[name]["steps"] = int(steps)
            read = after["zerolite_bytes_read"] - before["zerolite_bytes_read"]
            phases[name]["gb_read_per_step"] = round(read / 1e9 / max(steps, 1), 3)
    alone, together = phases.values()
    report = {"model": args.model, "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
              "spread_s": args.spread,
              "phases": {name: {k: v for k, v in phase.items() if k != "timelines"} for name, phase in phases.items()},
              "speed_up": round(together["tokens_per_s"] / alone["tokens_per_s"], 2)}
    show(report)
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    if args.plot is not None:
        plot(phases, args.plot)


class Server:
    """zerolite serve in a process of its own, on a free port of 127.0.0.1."""

    def __init__(self, model: str, device: str, clients: int):
        self.command = [sys.executable, "-m", "zerolite", "serve", "--model", model, "--device", device, "--offload",
                        "nvme", "--cpu-memory", "0", "--gpu-memory", "0", "--port", "0", "--max-batch", str(clients)]

    def __enter__(self) -> Server:
        self.process = subprocess.Popen(self.command, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + START_TIMEOUT_S
        for line in self.process.stderr:
            if match := re.search(r"on (http://\S+)/v1", line):
                self.url = match[1]
                self.name = line.split("zerolite serve: ")[1].split(" on ")[0]
                break
            if time.monotonic() > deadline:
                break
        else:
            sys.exit(f"bench_serve: the server did not start: {' '.join(self.command)}")
        threading.Thread(target=self.process.stderr.read, daemon=True).start()  # its log must not fill the pipe
        return self

    def __exit__(self, *exc) -> None:
        self.process.terminate()
        self.process.wait(timeout=120)

    def metrics(self) -> dict[str, float]:
        text = httpx.get(self.url + "/metrics", timeout=30).text
        return {name: float(value) for name, value in re.findall(r"^(zerolite_\w+) ([0-9.e+-]+)$", text, re.M)}


def run_phase(server: Server, clients: int, prompt_tokens: int, new_tokens: int, spread_s: float) -> dict:
    start = time.perf_counter()
    sent = [spread_s * i / clients for i in range(clients)]
    with ThreadPoolExecutor(clients) as pool:
        timelines = list(pool.map(lambda i: stream_one(server, i, prompt_tokens, new_tokens, start, sent[i]),
                                  range(clients)))
    wall = max(times[-1] for times in timelines)
    ttft = [times[0] - at for times, at in zip(timelines, sent)]
    gaps = [b - a for times in timelines for a, b in zip(times, times[1:])]
    tokens = sum(len(times) for times in timelines)
    return {"clients": clients, "tokens": tokens, "wall_s": round(wall, 2), "tokens_per_s": round(tokens / wall, 3),
            "ttft_median_s": round(statistics.median(ttft), 3), "ttft_p95_s": round(percentile(ttft, 95), 3),
            "itl_median_s": round(statistics.median(gaps), 3), "itl_p95_s": round(percentile(gaps, 95), 3),
            "timelines": timelines}


def stream_one(server: Server, client: int, prompt_tokens: int, new_tokens: int,
               start: float, at: float) -> list[float]:
    """One streaming request, sent at seconds after the phase began; the time of each token since then."""
    import random

    time.sleep(max(0.0, start + at - time.perf_counter()))
    prompt = random.Random(client).choices(range(3, 128), k=prompt_tokens)  # ids every vocabulary has
    body = {"model": server.name, "prompt": prompt, "max_tokens": new_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "return_token_ids": True}
    times = []
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=REQUEST_TIMEOUT) as answer:
        answer.raise_for_status()
        for line in answer.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line.removeprefix("data: "))
                if "error" in chunk:
                    sys.exit(f"bench_serve: client {client}: {chunk['error']['message']}")
                times += [time.perf_counter() - start] * len(chunk["choices"][0].get("token_ids", []))
    if len(times) != new_tokens:
        sys.exit(f"bench_serve: client {client} got {len(times)} tokens, not {new_tokens}")
    return times


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(p / 100 * len(ordered) + 0.5) - 1))]


def show(report: dict) -> None:
    spread = f", first requests over {report['spread_s']} s" if report["spread_s"] else ""
    table = Table(title=f"zerolite serve: {report['model']}, {report['prompt_tokens']} prompt tokens, "
                        f"{report['new_tokens']} new tokens per client{spread}")
    columns = ("clients", "tokens_per_s", "wall_s", "ttft_median_s", "ttft_p95_s", "itl_median_s", "itl_p95_s",
               "steps", "gb_read_per_step")
    for column in ("phase", *columns):
        table.add_column(column.replace("_", " "), justify="right")
    for name, phase in report["phases"].items():
        table.add_row(name, *(str(phase[c]) for c in columns))
    console = Console(width=max(Console().width, 150))  # the table whole, in a log file too
    console.print(table)
    console.print(f"aggregate tokens/s, {list(report['phases'])[1]} over 1 client: [bold]{report['speed_up']}x[/bold]")


def plot(phases: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(phases), figsize=(6 * len(phases), 4), sharey=True)
    for ax, (name, phase) in zip(axes, phases.items()):
        for times in phase["timelines"]:
            ax.step(times, range(1, len(times) + 1), where="post", linewidth=1)
        ax.set_title(f"{name}: {phase['tokens_per_s']:.1f} tokens/s in all")
        ax.set_xlabel("seconds since the first request")
    axes[0].set_ylabel("tokens received by each client")
    figure.tight_layout()
    figure.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
