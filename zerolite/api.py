"""The Python API: load a model for streamed inference, then generate as with transformers.

    lm = zerolite.load("/nvme/bloom", offload="nvme")
    batch = lm.tokenizer(prompts, return_tensors="pt", padding=True)
    out = lm.generate(**batch, max_new_tokens=100)
"""

from __future__ import annotations

import copy
import os
import sys
import time
from pathlib import Path

import torch

from zerolite.budget import Budgets
from zerolite.checkpoint import quiet_transformers
from zerolite.convert import JOURNAL, choose_dtype, holds_layout
from zerolite.errors import ZeroliteError
from zerolite.executor import Executor
from zerolite.kv_cache import PartialOffloadCache
from zerolite.layout import Layout
from zerolite.manifest import DTYPES, MANIFEST
from zerolite.plan import Plan
from zerolite.policy import Policy, default_layout_path, parse_size
from zerolite.preflight import preflight
from zerolite.progress import byte_progress
from zerolite.timeline import NO_TIMELINE, Timeline


class OffloadedLM:
    """A transformers causal LM whose blocks stream from disk or host memory as it runs.

    .model is transformers' own model object, .tokenizer its tokenizer (None when the layout has
    none), .generate takes everything transformers' generate does.
    """

    def __init__(self, executor: Executor, tokenizer, load_s: float, convert_s: float):
        self.executor = executor
        self.model = executor.model
        self.tokenizer = tokenizer
        self.load_s = load_s
        self.convert_s = convert_s

    @property
    def device(self) -> torch.device:
        return self.executor.device

    @property
    def config(self):
        return self.model.config

    @property
    def generation_config(self):
        return self.model.generation_config

    @property
    def bytes_read(self) -> int:
        return self.executor.bytes_read

    @property
    def plan(self) -> Plan:
        return self.executor.plan

    def generate(self, *args, **kwargs):
        """transformers' generate, with tensor arguments moved to the model's device and, with
        kv_offload set, a cache that keeps that fraction of the layers' K/V in host memory."""
        args = tuple(a.to(self.device) if isinstance(a, torch.Tensor) else a for a in args)
        kwargs = {k: v.to(self.device) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
        fraction = self.executor.policy.kv_offload
        if fraction > 0 and kwargs.get("past_key_values") is None:
            kwargs["past_key_values"] = PartialOffloadCache(self.model.config, fraction, self.device)
            config = kwargs.get("generation_config") or self.model.generation_config
            if getattr(config, "cache_implementation", None) is not None:
                # generate refuses a cache passed in beside a configured one (Gemma's "hybrid", say)
                kwargs["generation_config"] = copy.copy(config)
                kwargs["generation_config"].cache_implementation = None
        try:
            return self.model.generate(*args, **kwargs)
        except BaseException:
            self.executor.recover()
            raise

    def close(self) -> None:
        self.executor.close()

    def __enter__(self) -> OffloadedLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def load(
    model: str | os.PathLike | None = None,
    offload: str = "nvme",
    path: str | os.PathLike | None = None,
    device: str = "auto",
    dtype: str | None = None,
    allow_pickle: bool = False,
    show_progress: bool = True,
    timeline: Timeline | None = None,
    **policy,
) -> OffloadedLM:
    """Loads model for streamed inference.

    model: a zerolite layout folder, or a checkpoint (model folder, .gguf file, hub id in the local
    cache), converted first into path (default: zerolite's cache) and reused on later loads.
    None means the built-in SmolLM2-135M-Instruct. timeline, if given, records what the executor
    does (zerolite profile). The remaining keywords are Policy fields (prefetch_depth, gpu_memory,
    cpu_memory (bytes, or sizes such as "24GB"), kv_offload, io_backend, ...).
    """
    quiet_transformers()
    for budget in ("gpu_memory", "cpu_memory"):
        if isinstance(policy.get(budget), str):
            policy[budget] = parse_size(policy[budget], "--" + budget.replace("_", "-"))
    policy = Policy(offload=offload, device=device, **policy)
    started = time.perf_counter()
    layout_folder = ensure_layout(model, path, dtype, allow_pickle, show_progress)
    convert_s = time.perf_counter() - started

    started = time.perf_counter()
    layout = Layout.open(layout_folder)
    if dtype is not None and DTYPES[layout.manifest.dtype] != choose_dtype(dtype, None):
        raise ZeroliteError(
            f"layout {layout_folder} holds {layout.manifest.dtype} weights, not {dtype}: "
            f"convert into another --path with --dtype {dtype}"
        )
    plan = Plan.make(layout.manifest, policy, Budgets.make(layout.manifest, policy))
    for warning in preflight(layout, plan, policy):
        print(f"zerolite: warning: {warning}", file=sys.stderr)
    loaded = [layout.manifest.block(name) for name in plan.loaded]
    with byte_progress("loading", sum(b.length for b in loaded), len(loaded), enabled=show_progress) as progress:
        executor = Executor(layout, policy, plan, progress, timeline or NO_TIMELINE)
    tokenizer = load_tokenizer(layout_folder)
    return OffloadedLM(executor, tokenizer, time.perf_counter() - started, convert_s)


def ensure_layout(model, path, dtype, allow_pickle: bool, show_progress: bool) -> Path:
    """The layout folder to run from: model itself if it is one, else model converted (once).

    path is a layout (or an unfinished conversion) to use, or else an offload root such as /nvme
    holding one layout per model, each in a folder of its own (default: zerolite's cache).
    """
    path = Path(path).expanduser() if path is not None else None
    if model is None and path is not None and holds_layout(path):
        model = path  # no --model: --path names the layout to run
    if model is not None and (Path(model).expanduser() / MANIFEST).is_file():
        return Path(model).expanduser()
    if model is not None and (Path(model).expanduser() / JOURNAL).is_file():
        raise ZeroliteError(
            f"the conversion into {model} did not finish: run zerolite convert MODEL --path {model} again to complete it"
        )
    from zerolite.convert import convert
    from zerolite.gguf_source import builtin_gguf

    source = str(model) if model is not None else str(builtin_gguf())
    folder = path if path is not None and holds_layout(path) else default_layout_path(source, dtype, root=path)
    convert(source, folder, dtype=dtype, allow_pickle=allow_pickle, show_progress=show_progress)
    return folder


def load_tokenizer(folder: Path):
    """The layout's tokenizer, padding on the left as decoder-only generation needs; None if it has none."""
    if not any((folder / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError) as e:
        raise ZeroliteError(f"cannot read the tokenizer in {folder} ({' '.join(str(e).split())[:160]})") from e
    tokenizer.padding_side = "left"
    return tokenizer
