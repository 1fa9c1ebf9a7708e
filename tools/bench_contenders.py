"""One contender of tools/bench.py, run alone in a fresh process so that start-to-ready counts
everything it costs (interpreter, imports, loading) and no contender warms another's caches.

    python tools/bench_contenders.py NAME --source HF_FOLDER --layout LAYOUT --batch-size 16 \
        --new-tokens 16 --prompt-tokens 8 --started UNIX_TIME --out result.json [--scratch DIR] \
        [--gguf-folder DIR]

Every contender generates greedily from the same random prompts, exactly --new-tokens each, and
reports when it was ready, its prefill and decode step times, and the tokens (compared by bench.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from functools import partial
from pathlib import Path

import numpy as np
import torch


def zerolite_model(args, offload: str, layout: str | None = None, **policy):
    import zerolite

    lm = zerolite.load(layout or args.layout, offload=offload, device=args.device, show_progress=False, **policy)
    return lm, zerolite_measures(lm)


def zerolite_measures(lm) -> dict:
    """What a zerolite run reports besides its times: bytes read, the layers it held in host memory, its ring."""
    return {"bytes_read": lambda: lm.bytes_read, "held_layers": lambda: len(lm.plan.in_memory),
            "prefetch_depth": lambda: lm.policy.prefetch_depth}


def zerolite_in_place(args):
    """The checkpoint's own shards streamed in place: only a manifest written, under --scratch
    (prepare_s: planning it, or finding it planned)."""
    from zerolite.convert.resolve import ensure_layout

    started = time.perf_counter()
    folder = ensure_layout(args.source, os.path.join(args.scratch, "in-place"), None, False, False)
    prepare_s = time.perf_counter() - started
    lm, extras = zerolite_model(args, "nvme", layout=str(folder), cpu_memory=0)
    return lm, {**extras, "prepare_s": lambda: prepare_s}


def zerolite_in_place_default(args):
    """In place with zerolite's default budgets: as many layers held in host memory as they allow."""
    import zerolite

    lm = zerolite.load(args.source, path=os.path.join(args.scratch, "in-place"), offload="nvme", device=args.device,
                       show_progress=False)
    return lm, zerolite_measures(lm)


def zerolite_in_place_planned(args):
    """In place with the host budget and prefetch depth zerolite generate takes for this job (zerolite plan's search:
    args.batch_size prompts of args.prompt_tokens, args.new_tokens each); prepare_s: the planning."""
    import zerolite.lm
    from zerolite.planner.for_job import choose_for_job
    from zerolite.runtime.load_spec import LoadSpec

    spec = LoadSpec(model=args.source, path=os.path.join(args.scratch, "in-place"), offload="nvme", device=args.device)
    started = time.perf_counter()
    best = choose_for_job(spec, args.batch_size, args.prompt_tokens, args.new_tokens, args.batch_size, args.device).best
    prepare_s = time.perf_counter() - started
    spec = dataclasses.replace(spec, cpu_memory=best.cpu_memory, prefetch_depth=best.candidate.prefetch_depth)
    lm = zerolite.lm.load_spec(spec, show_progress=False)
    return lm, {**zerolite_measures(lm), "prepare_s": lambda: prepare_s}


def zerolite_converted_first(args):
    """What a run costs without streaming in place: convert into a fresh layout (prepare_s), then load it."""
    from zerolite.convert.writer import convert

    folder = os.path.join(args.scratch, "converted")
    started = time.perf_counter()
    convert(args.source, folder, show_progress=False)
    prepare_s = time.perf_counter() - started
    lm, extras = zerolite_model(args, "nvme", layout=folder, cpu_memory=0)
    return lm, {**extras, "prepare_s": lambda: prepare_s}


def accelerate_auto(args):
    """transformers + accelerate as a user sets it up for a model larger than RAM: device_map="auto"
    with an 18 GiB host budget, the rest offloaded to disk."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(args.source, dtype=torch.bfloat16, device_map="auto",
                                                 max_memory={"cpu": "18GiB"},
                                                 offload_folder=os.path.join(args.scratch, "accelerate-offload"))
    return model, {}


def compute_in_ram(args):
    """No reads at all: the model's own modules with every weight in memory (random, from its config,
    --layers of its decoder layers) and zerolite's thread settings: the compute a zerolite step takes
    apart from its reads, for a model too large to hold whole (tools/bench_scale.py scales it by layers)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(args.source)
    if args.layers is None:
        sys.exit("zerolite-compute-in-ram needs --layers: the decoder layers to build in memory")
    config.num_hidden_layers = args.layers
    return AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).to(args.device).eval(), {}


def transformers_in_ram(args):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(args.source, dtype=torch.bfloat16).to(args.device), {}


def accelerate_disk(args):
    """Every decoder layer offloaded to disk (accelerate's hooks load each from a safetensors
    memmap of offload_folder when it runs); the rest in memory."""
    from transformers import AutoConfig, AutoModelForCausalLM

    layers = AutoConfig.from_pretrained(args.source).num_hidden_layers
    device_map = {"model.embed_tokens": args.device, "model.norm": args.device, "model.rotary_emb": args.device,
                  "lm_head": args.device, **{f"model.layers.{i}": "disk" for i in range(layers)}}
    model = AutoModelForCausalLM.from_pretrained(args.source, dtype=torch.bfloat16, device_map=device_map,
                                                 offload_folder=os.path.join(args.scratch, "accelerate-offload"))
    return model, {}


def deepspeed_zero3(args, offload: str):
    """ZeRO-Inference: ZeRO-3 partitions the parameters at load (HfDeepSpeedConfig before
    from_pretrained) and offloads them to host memory or NVMe, gathering each module's just before it runs."""
    for name, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29517"), ("RANK", "0"), ("LOCAL_RANK", "0"),
                        ("WORLD_SIZE", "1"), ("LOCAL_SIZE", "1")):
        os.environ.setdefault(name, value)  # one process, no launcher
    if args.device == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    from deepspeed.accelerator import get_accelerator
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())

    config = AutoConfig.from_pretrained(args.source)
    hidden = config.hidden_size
    largest = max(config.vocab_size * hidden, config.intermediate_size * hidden)
    offload_param = {"device": offload, "pin_memory": True, "buffer_count": 5, "buffer_size": int(1.1 * largest)}
    if offload == "nvme":
        offload_param["nvme_path"] = os.path.join(args.scratch, "deepspeed-nvme")
    ds_config = {
        "bf16": {"enabled": True},
        "zero_optimization": {
            "stage": 3,
            "offload_param": offload_param,
            "stage3_param_persistence_threshold": hidden,
            "stage3_max_live_parameters": 2 * largest,
            "stage3_prefetch_bucket_size": 2 * hidden * hidden,
        },
        "aio": {"block_size": 1 << 20, "queue_depth": 32, "thread_count": 1, "single_submit": False,
                "overlap_events": True},
        "train_micro_batch_size_per_gpu": args.batch_size,
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }
    keep = HfDeepSpeedConfig(ds_config)  # must exist while from_pretrained runs, so zero.Init partitions at load
    model = AutoModelForCausalLM.from_pretrained(args.source, dtype=torch.bfloat16)
    engine = deepspeed.initialize(model=model, config_params=ds_config)[0]
    engine.module.eval()
    return engine.module, {"keep": keep}


def llamacpp(args, weights: str):
    """llama.cpp on the GGUF file bench.py made (tools/bench_gguf.py), memory-mapped (or read whole
    with --llamacpp-in-ram), with its own defaults otherwise. Through its C API rather than
    llama_cpp.Llama, whose context holds one sequence: a batch of prompts decodes together only in
    a context of batch-size sequences."""
    import llama_cpp

    llama_cpp.llama_backend_init()
    model_params = llama_cpp.llama_model_default_params()
    model_params.use_mmap = not args.llamacpp_in_ram
    # --llamacpp-plain: its plain kernels only; its AMX repacking crashed a 2-core Sapphire Rapids VM
    # (SIGSEGV at the first decode, llama-cpp-python 0.3.36).
    model_params.use_extra_bufts = not args.llamacpp_plain
    path = Path(args.gguf_folder) / f"{weights}.gguf"
    model = llama_cpp.llama_model_load_from_file(str(path).encode(), model_params)
    if not model:
        raise RuntimeError(f"llama.cpp could not load {path}")
    context_params = llama_cpp.llama_context_default_params()
    context_params.n_seq_max = args.batch_size
    context_params.n_ctx = args.batch_size * (args.prompt_tokens + args.new_tokens)  # split among the sequences
    context_params.n_batch = context_params.n_ubatch = args.batch_size * args.prompt_tokens  # the prefill in one pass
    context_params.n_threads = context_params.n_threads_batch = torch.get_num_threads()  # as the torch contenders
    context = llama_cpp.llama_init_from_model(model, context_params)
    if not context:
        raise RuntimeError(f"llama.cpp could not make a context for {path}")
    vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
    return context, {"keep": model, "vocab": vocab, "generate": partial(llamacpp_generate, vocab=vocab)}


def llamacpp_generate(context, input_ids: torch.Tensor, new_tokens: int, clock, vocab: int) -> torch.Tensor:
    """Greedy: row r is llama.cpp's sequence r, and every llama_decode takes one token of every row
    (the prefill: every prompt token, logits for each row's last), so the rows run as one batch."""
    import llama_cpp

    rows, length = input_ids.shape
    batch = llama_cpp.llama_batch_init(rows * length, 0, 1)
    # (token, position, row, whether its logits are wanted)
    entries = [(token, position, row, position == length - 1)
               for row, prompt in enumerate(input_ids.tolist()) for position, token in enumerate(prompt)]
    generated = []
    clock.put(input_ids)
    for step in range(new_tokens):
        batch.n_tokens = len(entries)
        for i, (token, position, row, wanted) in enumerate(entries):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, position, 1, wanted
            batch.seq_id[i][0] = row
        if llama_cpp.llama_decode(context, batch) != 0:
            raise RuntimeError(f"llama_decode failed at step {step}")
        outputs = [i for i, entry in enumerate(entries) if entry[3]]
        chosen = [int(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(context, i), shape=(vocab,)).argmax())
                  for i in outputs]
        generated.append(chosen)
        clock.put(torch.tensor(chosen))
        entries = [(token, length + step, row, True) for row, token in enumerate(chosen)]
    llama_cpp.llama_batch_free(batch)
    return torch.tensor(generated).T


def transformers_generate(model, input_ids: torch.Tensor, new_tokens: int, clock) -> torch.Tensor:
    with torch.no_grad():
        out = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                             pad_token_id=0, streamer=clock)
    return out[:, input_ids.shape[1]:]


CONTENDERS = {
    "zerolite-nvme": lambda a: zerolite_model(a, "nvme", cpu_memory=0),
    "zerolite-nvme-half": lambda a: zerolite_model(a, "nvme", cpu_memory=a.half_bytes),
    "zerolite-nvme-kv0.5": lambda a: zerolite_model(a, "nvme", cpu_memory=0, kv_offload=0.5),
    "zerolite-nvme-kv1.0": lambda a: zerolite_model(a, "nvme", cpu_memory=0, kv_offload=1.0),
    "zerolite-cpu": lambda a: zerolite_model(a, "cpu"),
    "zerolite-nvme-in-place": zerolite_in_place,
    "zerolite-in-place-default": zerolite_in_place_default,
    "zerolite-in-place-planned": zerolite_in_place_planned,
    "accelerate-auto": accelerate_auto,
    "zerolite-nvme-convert-first": zerolite_converted_first,
    "zerolite-nvme-int8": lambda a: zerolite_model(a, "nvme", layout=a.int8_layout, cpu_memory=0),
    "zerolite-cpu-int8": lambda a: zerolite_model(a, "cpu", layout=a.int8_layout),
    "zerolite-nvme-int4": lambda a: zerolite_model(a, "nvme", layout=a.int4_layout, cpu_memory=0),
    "zerolite-cpu-int4": lambda a: zerolite_model(a, "cpu", layout=a.int4_layout),
    "transformers-ram": transformers_in_ram,
    "zerolite-compute-in-ram": compute_in_ram,
    "deepspeed-nvme": lambda a: deepspeed_zero3(a, "nvme"),
    "deepspeed-cpu": lambda a: deepspeed_zero3(a, "cpu"),
    "accelerate-disk": accelerate_disk,
    "llamacpp-bf16": lambda a: llamacpp(a, "bf16"),
    "llamacpp-q4_0": lambda a: llamacpp(a, "q4_0"),
    "llamacpp-q8_0": lambda a: llamacpp(a, "q8_0"),
}


def own_peak_rss() -> int:
    """This process's peak resident memory since it started: VmHWM. Not ru_maxrss, which carries
    the parent's resident memory at fork (a bench that had just written a model passed it on)."""
    line = next(line for line in open("/proc/self/status") if line.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def prompts(vocab: int, batch: int, length: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1234)
    return torch.randint(3, vocab, (batch, length), generator=generator)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("name", choices=CONTENDERS)
    parser.add_argument("--source", required=True)
    parser.add_argument("--layout", required=True)
    parser.add_argument("--int8-layout", default=None)
    parser.add_argument("--int4-layout", default=None)
    parser.add_argument("--gguf-folder", default=None, help="the llama.cpp contenders' GGUFs (tools/bench_gguf.py)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch-size", type=int, required=True)
    parser.add_argument("--new-tokens", type=int, required=True)
    parser.add_argument("--prompt-tokens", type=int, required=True)
    parser.add_argument("--half-bytes", type=int, default=0)
    parser.add_argument("--layers", type=int, default=None, help="zerolite-compute-in-ram: decoder layers to build")
    parser.add_argument("--scratch", default="/tmp")
    parser.add_argument("--llamacpp-plain", action="store_true", help="llama.cpp without its repacked weights")
    parser.add_argument("--llamacpp-in-ram", action="store_true", help="llama.cpp's file read into RAM, not mapped")
    parser.add_argument("--started", type=float, required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    model, extras = CONTENDERS[args.name](args)
    ready_s = time.time() - args.started

    from zerolite.generate.stats import StepClock  # after the clock stopped: it is the bench's, not the contender's

    vocab = extras.get("vocab") or model.config.get_text_config().vocab_size
    input_ids = prompts(vocab, args.batch_size, args.prompt_tokens).to(args.device)
    generate = extras.get("generate", transformers_generate)
    clock = StepClock(lambda rows: None)
    started = time.perf_counter()
    tokens = generate(model, input_ids, args.new_tokens, clock)
    generate_s = time.perf_counter() - started
    steps = [b - a for a, b in zip(clock.times[1:], clock.times[2:])]
    result = {
        "name": args.name, "ready_s": ready_s, "generate_s": generate_s, "prefill_s": clock.prefill_s,
        "step_s": steps, "tokens": tokens.tolist(),
        "peak_rss_bytes": own_peak_rss(),
    }
    for measure in ("bytes_read", "prepare_s", "held_layers", "prefetch_depth"):
        if measure in extras:
            result[measure] = extras[measure]()
    Path(args.out).write_text(json.dumps(result))
    os._exit(0)  # some contenders (DeepSpeed's process group, its aio threads) hang at interpreter exit


if __name__ == "__main__":
    main()
