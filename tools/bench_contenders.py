"""One contender of tools/bench.py, run alone in a fresh process so that start-to-ready counts
everything it costs (interpreter, imports, loading) and no contender warms another's caches.

    python tools/bench_contenders.py NAME --source HF_FOLDER --layout LAYOUT --batch-size 16 \
        --new-tokens 16 --prompt-tokens 8 --started UNIX_TIME --out result.json [--scratch DIR]

Every contender generates greedily from the same random prompts, exactly --new-tokens each, and
reports when it was ready, its prefill and decode step times, and the tokens (compared by bench.py).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time
from pathlib import Path

import torch


def zerolite_model(args, offload: str, layout: str | None = None, **policy):
    import zerolite

    lm = zerolite.load(layout or args.layout, offload=offload, device=args.device, show_progress=False, **policy)
    return lm, {"bytes_read": lambda: lm.bytes_read}


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
        "aio": {"block_size": 1 << 20, "queue_depth": 32, "thread_count": 1, "single_submit": False, "overlap_events": True},
        "train_micro_batch_size_per_gpu": args.batch_size,
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }
    keep = HfDeepSpeedConfig(ds_config)  # must exist while from_pretrained runs, so zero.Init partitions at load
    model = AutoModelForCausalLM.from_pretrained(args.source, dtype=torch.bfloat16)
    engine = deepspeed.initialize(model=model, config_params=ds_config)[0]
    engine.module.eval()
    return engine.module, {"keep": keep}


CONTENDERS = {
    "zerolite-nvme": lambda a: zerolite_model(a, "nvme", cpu_memory=0),
    "zerolite-nvme-half": lambda a: zerolite_model(a, "nvme", cpu_memory=a.half_bytes),
    "zerolite-nvme-kv0.5": lambda a: zerolite_model(a, "nvme", cpu_memory=0, kv_offload=0.5),
    "zerolite-nvme-kv1.0": lambda a: zerolite_model(a, "nvme", cpu_memory=0, kv_offload=1.0),
    "zerolite-cpu": lambda a: zerolite_model(a, "cpu"),
    "zerolite-nvme-int8": lambda a: zerolite_model(a, "nvme", layout=a.int8_layout, cpu_memory=0),
    "zerolite-cpu-int8": lambda a: zerolite_model(a, "cpu", layout=a.int8_layout),
    "zerolite-nvme-int4": lambda a: zerolite_model(a, "nvme", layout=a.int4_layout, cpu_memory=0),
    "zerolite-cpu-int4": lambda a: zerolite_model(a, "cpu", layout=a.int4_layout),
    "transformers-ram": transformers_in_ram,
    "deepspeed-nvme": lambda a: deepspeed_zero3(a, "nvme"),
    "deepspeed-cpu": lambda a: deepspeed_zero3(a, "cpu"),
    "accelerate-disk": accelerate_disk,
}


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
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch-size", type=int, required=True)
    parser.add_argument("--new-tokens", type=int, required=True)
    parser.add_argument("--prompt-tokens", type=int, required=True)
    parser.add_argument("--half-bytes", type=int, default=0)
    parser.add_argument("--scratch", default="/tmp")
    parser.add_argument("--started", type=float, required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    model, extras = CONTENDERS[args.name](args)
    ready_s = time.time() - args.started

    from zerolite.generate import StepClock  # after the clock stopped: it is the bench's, not the contender's

    vocab = model.config.get_text_config().vocab_size
    input_ids = prompts(vocab, args.batch_size, args.prompt_tokens).to(args.device)
    clock = StepClock(lambda rows: None)
    started = time.perf_counter()
    with torch.no_grad():
        out = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                             max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False,
                             pad_token_id=0, streamer=clock)
    generate_s = time.perf_counter() - started
    steps = [b - a for a, b in zip(clock.times[1:], clock.times[2:])]
    result = {
        "name": args.name, "ready_s": ready_s, "generate_s": generate_s, "prefill_s": clock.prefill_s,
        "step_s": steps, "tokens": out[:, input_ids.shape[1]:].tolist(),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }
    if "bytes_read" in extras:
        result["bytes_read"] = extras["bytes_read"]()
    Path(args.out).write_text(json.dumps(result))
    os._exit(0)  # some contenders (DeepSpeed's process group, its aio threads) hang at interpreter exit


if __name__ == "__main__":
    main()
