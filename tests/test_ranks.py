"""Data parallel under torchrun: two ranks (gloo on loopback) write what one process writes, share
one host copy per node, survive a rank's SIGKILL by a rerun, and end bad input in one line.

Most cases start real torchrun jobs (a few seconds each): through the command line, and through
the Python API (tests/rank_worker.py) on the CPU, on simulated asynchronous devices and on GPUs.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import zerolite
import zerolite.cli.ranks
import zerolite.runtime.loader
import zerolite.runtime.policy
from support.cli_runner import assert_one_line_error, run
from support.helpers import generate_args, lines_by_id
from support.simulated_device import SimulatedDevice
from zerolite.cli import main as cli
from zerolite.distributed.world import World, failed_line
from zerolite.errors import ZeroliteError
from zerolite.io.device import CudaDevice, resolve
from zerolite.runtime.loader import rank_device, shared_gpu
from zerolite.runtime.policy import Policy

LAYERS = 4
PROMPTS = 10
BATCH = 2
NEW_TOKENS = 6
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
WORKER = str(Path(__file__).with_name("rank_worker.py"))


@pytest.fixture(scope="module")
def layout(make_layout):
    return make_layout("llama", layers=LAYERS)


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("ranks") / "prompts.jsonl"
    path.write_text("".join(json.dumps({"id": f"p{i}", "input_ids": list(range(3 + i, 8 + 2 * i))}) + "\n"
                            for i in range(PROMPTS)))
    return path


@pytest.fixture(scope="module")
def reference(tmp_path_factory, layout, prompts) -> Path:
    """One process's output, run in this one (once: every job of this module compares with it)."""
    output = tmp_path_factory.mktemp("one-process") / "one-process.jsonl"
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setattr(sys, "argv", ["zerolite", *map(str, generate_args(layout, prompts, output, batch=BATCH,
                                                                              new_tokens=NEW_TOKENS))])
        with pytest.raises(SystemExit) as exit_info:
            cli.main()
    assert exit_info.value.code == 0
    return output


def torchrun(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    """A two-rank torchrun job on this machine."""
    return subprocess.run([*TORCHRUN, "--standalone", "--nproc-per-node=2", *args], capture_output=True, text=True,
                          timeout=timeout)


def two_nodes(node_args: list[list[str]], cwds: list[Path], timeout: float = 240) -> list[subprocess.CompletedProcess]:
    """Two torchrun agents on this machine, one rank each: two nodes as torchrun sees them."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    agents = [subprocess.Popen([*TORCHRUN, "--nnodes=2", f"--node-rank={node}", "--nproc-per-node=1",
                                "--master-addr=127.0.0.1", f"--master-port={port}", *args],
                               cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
              for node, (args, cwd) in enumerate(zip(node_args, cwds))]
    return [subprocess.CompletedProcess(agent.args, agent.wait(timeout), *agent.communicate()) for agent in agents]


def zerolite_lines(stderr: str) -> list[str]:
    """What zerolite said (torchrun's own report of a failed job follows it)."""
    return [line for line in stderr.splitlines() if line.startswith("zerolite:")]


def assert_one_error(result: subprocess.CompletedProcess, *fragments: str) -> None:
    assert result.returncode != 0
    lines = zerolite_lines(result.stderr)
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("zerolite: error: ")
    assert f"{os.sep}zerolite{os.sep}" not in result.stderr.replace(WORKER, ""), "a zerolite traceback"
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def test_the_world_comes_from_torchruns_environment(monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK"):
        monkeypatch.delenv(key, raising=False)
    assert World.from_env() == World() and not World().distributed
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "3")
    with pytest.raises(ZeroliteError, match="LOCAL_RANK is None: start zerolite with torchrun"):
        World.from_env()
    for key, value in (("LOCAL_RANK", "1"), ("LOCAL_WORLD_SIZE", "2"), ("GROUP_RANK", "1")):
        monkeypatch.setenv(key, value)
    assert World.from_env() == World(rank=3, size=4, local_rank=1, local_size=2, node=1)


def test_a_failure_is_said_once_naming_the_rank():
    assert failed_line([(0, "bad", "node 0 (a)"), (1, "bad", "node 1 (b)")], 2, "loading") == "bad"
    assert failed_line([(1, "gone", "node 1 (b)")], 2, "loading") == "rank 1 on node 1 (b), loading: gone"
    assert failed_line([(1, "x", "node 0 (a)"), (2, "y", "node 1 (b)")], 3, "loading") == \
        "rank 1 on node 0 (a) (and on rank 2), loading: x"


@pytest.mark.parametrize(("visible", "local_rank", "expected"), [(1, 1, "cuda:0"), (1, 3, "cuda:0"), (2, 1, "cuda:1"),
                                                                   (4, 3, "cuda:3")])
def test_each_rank_takes_the_gpu_of_its_local_rank_or_the_only_one_it_sees(monkeypatch, visible, local_rank, expected):
    """torchrun shows every rank all of the node's GPUs; SLURM and Kubernetes may show each rank its own one alone."""
    for module in (zerolite.runtime.loader, zerolite.runtime.policy):
        monkeypatch.setattr(module, "cuda_available", lambda: True)
    monkeypatch.setattr(zerolite.runtime.loader, "cuda_device_count", lambda: visible)
    world = World(rank=local_rank, size=4, local_rank=local_rank, local_size=4)
    assert rank_device(Policy(device="cuda"), world).name == expected


def test_more_ranks_than_the_gpus_they_all_see_is_one_clear_error(monkeypatch):
    for module in (zerolite.runtime.loader, zerolite.runtime.policy):
        monkeypatch.setattr(module, "cuda_available", lambda: True)
    monkeypatch.setattr(zerolite.runtime.loader, "cuda_device_count", lambda: 2)
    with pytest.raises(ZeroliteError, match="4 ranks on this node but 2 GPUs"):
        rank_device(Policy(device="cuda"), World(rank=2, size=4, local_rank=2, local_size=4))


class OneProcessWorld(World):
    """A job's ranks played by this process: every rank's result in a gather is this one's, but for
    the GPUs' identities, which are given (the others' ranks, in order)."""

    def __init__(self, size: int, gpus: list):
        super().__init__(rank=0, size=size)
        object.__setattr__(self, "gpus", gpus)

    def start(self) -> None:
        pass

    def all_gather(self, step, what):
        mine = step()
        return [mine, *self.gpus] if what == "finding the GPUs" else [mine] * self.size


def test_a_rank_knows_its_gpu_by_uuid_and_the_ranks_sharing_it(monkeypatch):
    """CUDA_VISIBLE_DEVICES renumbers the GPUs: cuda:0 of two ranks may be one GPU or two."""
    uuids = {0: uuid.UUID(int=7), 1: uuid.UUID(int=9)}
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(uuid=uuids[device.index]))
    gpu = CudaDevice(torch.device("cuda", 0))
    assert gpu.identity() == str(uuid.UUID(int=7))
    assert shared_gpu(gpu, OneProcessWorld(4, [str(uuids[0]), str(uuids[1]), str(uuids[0])])) == 3
    assert shared_gpu(gpu, OneProcessWorld(2, [str(uuids[1])])) == 1
    assert shared_gpu(gpu, World()) == 1
    assert shared_gpu(resolve("cpu"), OneProcessWorld(2, [None])) == 1  # a CPU's ranks share the node's memory already


def test_ranks_sharing_one_gpu_each_plan_their_share_of_it(layout):
    """Three ranks on one GPU (issue 37, defect 4): alone, a rank's budget holds every layer; as one
    of three, a third of the GPU less its own reserve holds none."""

    class SharedGpu(SimulatedDevice):
        def identity(self) -> str:
            return "GPU-shared"

    def resident_layers(others: list) -> set:
        sim = SharedGpu(memory_bytes=6 << 30)
        with sim.watching(), zerolite.load(layout, offload="cpu", device=sim, world=OneProcessWorld(3, others),
                                            show_progress=False) as lm:
            return set(lm.plan.resident) & set(lm.layout.manifest.layer_names)

    assert len(resident_layers(["GPU-a", "GPU-b"])) == LAYERS
    assert resident_layers(["GPU-shared", "GPU-shared"]) == set()


@pytest.mark.parametrize("offload", ["cpu", "nvme"])
def test_two_ranks_write_what_one_process_writes(tmp_path, layout, prompts, reference, offload):
    output = tmp_path / "two-ranks.jsonl"
    result = torchrun("-m", "zerolite", *generate_args(layout, prompts, output, "--offload", offload, "--cpu-memory",
                                                        "1GB" if offload == "cpu" else "0", batch=BATCH,
                                                        new_tokens=NEW_TOKENS))
    assert result.returncode == 0, result.stderr
    assert output.read_bytes() == reference.read_bytes()  # every id once, in input order, token for token
    said = zerolite_lines(result.stderr) + [line for line in result.stderr.splitlines()
                                            if line.startswith(("plan:", "ranks:"))]
    assert sum(line.startswith("plan:") for line in said) == 1, "rank 0 alone prints the plan"
    assert any(line.startswith("ranks: 2, 2 on this node; the node's ranks share one copy") for line in said)
    assert "on 2 ranks" in result.stderr


def kill_and_rerun(tmp_path, layout, prompts, reference, device: str) -> None:
    """Through the API: a run whose rank 1 is SIGKILLed as its second batch starts, then a rerun,
    leave what one process writes: the killed run's whole rounds, the rerun's batches after them,
    every id once, in input order, token for token."""
    reports = tmp_path / "reports"
    reports.mkdir()
    output = tmp_path / "api.jsonl"
    worker = [WORKER, str(layout), str(prompts), str(output), str(reports), "--device", device]
    killed = torchrun(*worker, "--die-at-batch", "2")
    assert killed.returncode != 0
    assert 0 < len(lines_by_id(output)) < PROMPTS, "the rerun must resume a run cut short"
    rerun = torchrun(*worker)
    assert rerun.returncode == 0, rerun.stderr
    assert output.read_bytes() == reference.read_bytes()
    ranks = [json.loads((reports / f"rank{rank}.json").read_text()) for rank in range(2)]
    if device == "cuda":
        assert [r["device"] for r in ranks] == ["cuda:0", "cuda:1"]
    assert ranks[0]["host_copy"] and ranks[0]["host_copy"] == ranks[1]["host_copy"], "one host copy, mapped by both"
    if device == "sim":
        assert ranks[0]["adopted"] > 0 and ranks[0]["adopted"] == ranks[1]["adopted"], "each rank registers the copy"


def test_a_rank_killed_mid_run_then_a_rerun_on_the_cpu(tmp_path, layout, prompts, reference):
    kill_and_rerun(tmp_path, layout, prompts, reference, "cpu")


@pytest.mark.cuda
def test_a_rank_killed_mid_run_then_a_rerun_each_on_its_own_device(tmp_path, layout, prompts, reference, gpu):
    """Each rank on a simulated device of its own (or on the GPU of its LOCAL_RANK), copying its
    layers out of the node's one shared host copy."""
    if gpu == "cuda":
        import torch

        if torch.cuda.device_count() < 2:
            pytest.skip("needs two CUDA devices")
    kill_and_rerun(tmp_path, layout, prompts, reference, "cuda" if gpu == "cuda" else "sim")


def as_rank_0_of_two(monkeypatch) -> None:
    """The command line in this process plays rank 0 of two ranks that were given the same command:
    what both would refuse is refused here, in the line rank 0 prints (that the other rank then
    prints nothing, and that each gather carries a rank's refusal, is the real ranks' part:
    test_mismatched_arguments_across_nodes and test_a_layout_missing_on_one_node)."""
    monkeypatch.setattr(zerolite.cli.ranks, "World", SimpleNamespace(from_env=lambda: OneProcessWorld(2, [])))


def test_a_world_with_no_work_for_some_ranks(tmp_path, layout, prompts, capsys, monkeypatch):
    as_rank_0_of_two(monkeypatch)
    result = run(capsys, monkeypatch, *generate_args(layout, prompts, tmp_path / "out.jsonl", batch=PROMPTS,
                                                      new_tokens=NEW_TOKENS))
    assert_one_line_error(result, "10 prompts in batches of 10 make 1 batch, too few for 2 ranks", "--batch-size")
    assert "plan:" not in result.stderr, "refused before loading"
    assert not (tmp_path / "out.jsonl").read_text()


def test_profile_reports_each_rank_and_the_job(layout):
    result = torchrun("-m", "zerolite", "profile", "--model", str(layout), "--device", "cpu", "--cpu-memory", "0",
                      "--batch-size", "2", "--new-tokens", "4", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)  # rank 0 alone prints
    assert len(report["ranks"]) == 2 and report["total"]["ranks"] == 2
    assert report["total"]["decode_tokens_per_s"] == pytest.approx(sum(2 / r["decode_step_s"] for r in report["ranks"]))
    assert all(r["streamed_bytes_per_step"] > 0 for r in report["ranks"])


def test_serve_refuses_ranks(layout, capsys, monkeypatch):
    as_rank_0_of_two(monkeypatch)
    result = run(capsys, monkeypatch, "serve", "--model", str(layout), "--port", "0")
    assert_one_line_error(result, "zerolite serve runs as one process, and torchrun started 2")


def test_mismatched_arguments_across_nodes(tmp_path, layout, prompts):
    args = ["-m", "zerolite",
            *generate_args(layout, prompts, tmp_path / "out.jsonl", batch=BATCH, new_tokens=NEW_TOKENS)]
    node0, node1 = two_nodes([args, [*args, "--max-new-tokens", "3"]], [tmp_path, tmp_path])
    assert_one_error(node0, "rank 1 was started with --max-new-tokens 3, rank 0 with 6", "same zerolite command")
    assert node1.returncode != 0 and not zerolite_lines(node1.stderr)


def test_a_layout_missing_on_one_node(tmp_path, layout, prompts):
    """The same command on two nodes, whose --model names a folder that only node 0 has."""
    here, there = tmp_path / "node0", tmp_path / "node1"
    here.mkdir()
    there.mkdir()
    (here / "layout").symlink_to(layout)
    args = ["-m", "zerolite",
            *generate_args("layout", prompts, tmp_path / "out.jsonl", batch=BATCH, new_tokens=NEW_TOKENS)]
    node0, node1 = two_nodes([args, args], [here, there])
    assert_one_error(node0, "rank 1 on node 1", "layout does not exist")
    assert node1.returncode != 0 and not zerolite_lines(node1.stderr)
