"""Preflight: the plan checked against the machine before any weight is loaded."""

from __future__ import annotations

import errno
import os
from collections import namedtuple

import psutil
import torch

import zerolite
from support.cli_runner import assert_one_line_error, run


def test_a_file_system_without_o_direct_gets_one_warning_and_still_runs(capfd, monkeypatch, make_layout):
    """tmpfs took O_DIRECT only in recent kernels (this one does), so a file system refusing it is
    simulated: opening with O_DIRECT fails with EINVAL, as it does there."""
    layout = make_layout()
    real_open = os.open

    def open_without_direct(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", open_without_direct)
    with zerolite.load(layout, offload="nvme", cpu_memory=0, device="cpu", show_progress=False) as lm:
        out = lm.generate(input_ids=torch.tensor([[5, 6, 7]]), max_new_tokens=3, do_sample=False)
    warnings = [line for line in capfd.readouterr().err.splitlines() if line.startswith("zerolite: warning:")]
    assert len(warnings) == 1 and "without O_DIRECT" in warnings[0]
    assert out.shape[1] > 3


def test_a_plan_that_needs_more_memory_than_is_free_stops_before_loading(capsys, monkeypatch, make_layout):
    layout = make_layout()
    memory = namedtuple("memory", "available total")
    monkeypatch.setattr(psutil, "virtual_memory", lambda: memory(available=1000, total=2000))
    result = run(capsys, monkeypatch, "generate", "hi", "--model", layout, "--device", "cpu", "--offload", "cpu")
    assert_one_line_error(result, "in host memory", "is available", "--offload nvme")
