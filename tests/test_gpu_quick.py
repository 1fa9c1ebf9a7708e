"""tools/gpu_quick.py: its dry run (every step on the simulated device, tiny shapes) writes the
report a GPU run writes, section by section; the profile's summary of a CUDA trace, which only a
GPU produces, on a trace made by hand; and its refusal to start a GPU run without a GPU."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TOOL = ROOT / "tools" / "gpu_quick.py"


@pytest.fixture
def tools(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "tools"))
    return importlib.import_module


@pytest.fixture
def gpu_quick(tools):
    return tools("gpu_quick")


def test_a_dry_run_writes_every_section_of_the_report(tmp_path, gpu_quick):
    out = tmp_path / "out"
    # A budget above the dry run's own 150 s: on a machine busy with other tests no step may be skipped for time.
    done = subprocess.run([sys.executable, str(TOOL), "--dry-run", "--out", str(out), "--budget-s", "400"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=500)
    report = json.loads((out / "gpu_quick.json").read_text())
    not_ok = {name: step for name, step in report["steps"].items() if step["status"] != "ok"}
    assert done.returncode == 0 and not not_ok, (json.dumps(not_ok, indent=1), done.stderr[-3000:])
    assert report["dry_run"] and report["seconds"] < report["budget_s"]
    assert list(report["steps"]) == [step.name for step in gpu_quick.STEPS]

    machine = report["machine"]
    assert machine["cpus"] >= 1 and machine["torch"] and machine["transformers"] and "pcie" in machine
    assert [r["label"] for r in report["copy"]["rates"]] == ["256 MiB alone", "layer alone"]
    assert all(r["gbps"] > 0 and r["beside_gbps"] > 0 for r in report["copy"]["rates"])
    assert report["pinned_gbps"] == report["copy"]["rates"][1]["gbps"]
    rows = report["matmul"]["rows"]
    assert [r["rows"] for r in rows] == [1, 16, 64, 256] and not report["matmul"]["errors"]
    for variant in ("bf16", "int8_today", "int8_fused", "int4_today", "int4_fused"):
        assert all(r[f"{variant}_ms"] > 0 for r in rows), variant
    assert report["matmul"]["int4_fused_max_rel_err"] < 0.02  # the fused kernel fed as it wants
    assert report["folder"]["in_place"] and report["folder"]["layers"] == 8 and report["folder"]["disk_gbps"] > 0

    resident = {case: data["plan"]["resident_layers"] for case, data in report["streaming"].items()}
    assert resident == {"pinned": 0, "resident": 4, "disk": 0, "kv": 0}
    assert report["streaming"]["disk"]["plan"]["on_disk"] == 8
    for case, data in report["streaming"].items():
        assert set(data["batches"]) == {"1", "32"}, case
        for batch in data["batches"].values():
            assert batch["median_step_s"] > 0 and batch["moved_gbps"] > 0 and batch["share_of_pinned_rate"] > 0, case
    assert report["streaming"]["kv"]["batches"]["32"]["kv_bytes_per_step_estimate"] > 0
    assert report["streaming"]["disk"]["batches"]["1"]["read_gb_per_forward"] > 0
    assert report["streaming"]["disk"]["batches"]["1"]["share_of_disk_rate"] > 0

    for batch in report["profile"]["batches"].values():
        assert batch["copies"] > 0 and batch["kernels"] > 0 and 0 < batch["copy_busy_share"] <= 1
        assert batch["cache_tokens"] == 8 + 2  # the prompt, then two decode steps on its cache
    for name in ("tests-sanitized", "tests"):
        assert report["tests"][name]["counts"].get("passed", 0) >= 1, report["tests"][name]

    text = (out / "gpu_quick.md").read_text()
    for heading in ("## Steps", "## Machine", "## Pinned host-to-device copies", "## Matmuls", "## Model folder",
                    "## Streaming in place", "## Profile of two decode steps", "## CUDA tests"):
        assert heading in text
    # What a GPU machine gives back is at most 8 files: the report alone is left under --out.
    assert sorted(p.name for p in out.iterdir()) == ["gpu_quick.json", "gpu_quick.log", "gpu_quick.md",
                                                     "gpu_quick_tests.log", "gpu_quick_trace.json.gz"]


def test_a_hung_step_is_killed_at_its_limit_its_figures_kept_and_the_next_step_runs(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "GPU_QUICK_HANG": "machine", "GPU_QUICK_LIMIT_S": "3"}
    done = subprocess.run([sys.executable, str(TOOL), "--dry-run", "--out", str(out), "--steps", "machine,copy"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    report = json.loads((out / "gpu_quick.json").read_text())
    assert done.returncode == 1 and "not ok: machine" in done.stderr
    assert report["steps"]["machine"]["status"] == "timed out" and 3 <= report["steps"]["machine"]["seconds"] < 30
    assert report["machine"] == {"before_the_hang": True}  # saved before it hung, merged while it ran
    assert report["steps"]["copy"]["status"] == "ok" and report["copy"]["rates"]


def test_a_cuda_traces_copy_stream_busy_share_gap_and_overlap(tools):
    def event(cat, name, stream, ts, dur):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": {"device": 0, "stream": stream}}

    trace = {"traceEvents": [
        event("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 7, 0, 100),
        # torch's own exporter
        {**event("gpu_memcpy", "Memcpy", 7, 150, 150), "args": {"stream": 7, "copy kind": "HtoD"}},
        event("kernel", "ampere_bf16_gemm", 3, 50, 150),
        event("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 3, 300, 10),   # not a copy in
        event("gpu_memset", "Memset (Device)", 3, 0, 5),                     # not a kernel
        event("cuda_runtime", "cudaMemcpyAsync", 1, 0, 400),                 # the host's side
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": 1, "args": {"name": "python"}},
    ]}
    stream = tools("gpu_quick_stream")
    summary = stream.summarize(stream.intervals_from_trace(trace))
    assert summary["copy_stream"] == "7" and summary["copies"] == 2 and summary["kernels"] == 1
    assert summary["window_ms"] == pytest.approx(0.3)
    assert summary["copy_busy_share"] == pytest.approx(250 / 300, abs=1e-4)
    assert summary["longest_copy_gap_ms"] == pytest.approx(0.05)
    assert summary["overlap_share"] == pytest.approx(100 / 250)
    assert stream.summarize([])["copy_busy_share"] is None


def test_the_tests_counts_from_pytests_summary_or_from_its_lines_when_stopped_before_it(tools):
    summary = tools("gpu_quick_report").tests_summary
    lines = ("[gw0] [ 10%] PASSED tests/test_executor.py::test_a[cuda-1]\n"
             "[gw1] [ 20%] FAILED tests/test_executor.py::test_b[cuda-2]\n"
             "CSAN detected a possible data race on tensor with data pointer 1234\nAccess by stream 7\n")
    stopped = summary(lines, ["python", "-m", "pytest"], None)
    assert stopped["partial"] and stopped["counts"] == {"passed": 1, "failed": 1}
    assert stopped["failed"] == ["[gw1] [ 20%] FAILED tests/test_executor.py::test_b[cuda-2]"]
    assert len(stopped["sanitizer_findings"]) == 1 and "stream 7" in stopped["sanitizer_findings"][0]
    finished = summary(lines + "FAILED tests/test_executor.py::test_b[cuda-2] - boom\n"
                               "==== 1 passed, 1 failed, 9 deselected in 3.2s ====\n", ["python", "-m", "pytest"], 1)
    assert not finished["partial"] and finished["counts"] == {"passed": 1, "failed": 1, "deselected": 9}
    assert finished["failed"] == ["FAILED tests/test_executor.py::test_b[cuda-2] - boom"]


def test_a_copy_rate_from_each_numa_node_where_there_are_several(tools, tmp_path):
    from support.simulated_device import SimulatedDevice

    steps = tools("gpu_quick_steps")
    cpus = ",".join(map(str, sorted(os.sched_getaffinity(0))))
    for node in ("node0", "node1"):
        (tmp_path / node).mkdir()
        (tmp_path / node / "cpulist").write_text(cpus + "\n")
    device = SimulatedDevice(seed=0)
    device.adopt_thread()
    device.numa_node = 1  # zerolite's own placement (the GPU's node): set aside while each node is measured
    pinned_empty, placements = device.pinned_empty, []
    device.pinned_empty = lambda nbytes: placements.append(device.numa_node) or pinned_empty(nbytes)
    allowed = os.sched_getaffinity(0)
    rates = steps.numa_copy_rates(device, device.new_stream(), tmp_path, nbytes=1 << 20)
    assert set(rates) == {"node0", "node1"} and all(rate > 0 for rate in rates.values())
    assert placements == [None, None] and device.numa_node == 1  # given back
    assert os.sched_getaffinity(0) == allowed  # given back
    (tmp_path / "node1" / "cpulist").write_text("\n")  # a node with no CPU this process may use: one node left
    assert steps.numa_copy_rates(device, device.new_stream(), tmp_path, nbytes=1 << 20) == {}


def test_a_70b_layer_is_the_size_the_issue_names(tools):
    assert tools("gpu_quick_steps").LAYER_70B_BYTES == 1_711_308_800


def test_a_gpu_run_without_a_gpu_is_refused_in_one_line(tmp_path):
    done = subprocess.run([sys.executable, str(TOOL), "--out", str(tmp_path / "out")], cwd=tmp_path,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": ""}, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "no CUDA device" in done.stderr and "--dry-run" in done.stderr
    assert not (tmp_path / "out").exists()
