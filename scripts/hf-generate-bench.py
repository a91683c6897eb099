"""Greedy decoding through transformers with attn_implementation="asymattn" beside "sdpa" and
"eager": prefill time, decode time per step and tokens/s, and where the greedy tokens first
differ from sdpa's. A randomly initialised Llama-style model (no download), bf16, on the GPU.

    PYTHONPATH=. python3 scripts/hf-generate-bench.py [--batch 8] [--prompt 1024] [--new 64]
        [--profile]   # torch.profiler over a few asymattn decode steps: where the time goes
        [--cprofile]  # cProfile of each implementation's timed loop (host time by function)
        [--compile]   # each model's forward under torch.compile(dynamic=True): asymattn's
                      # decode steps are then the asymflash::kvcache_attend custom op

The loop is written out (prefill, then one token per forward pass over a DynamicCache) rather
than `generate`, so the time is the model's and not generate's bookkeeping. Each
implementation runs the loop twice on the same weights (seeded); the second run is timed.
Time inside sdpa's call is its own: torch 2.11 on the H200 spent ~4 ms of host time in each
decode-step call here (cProfile).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import transformers

from asymflash.integrations.hf import NAME, register


def model_for(attn: str, layers: int) -> transformers.LlamaForCausalLM:
    config = transformers.LlamaConfig(
        vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=layers,
        num_attention_heads=16, num_key_value_heads=4, head_dim=128,
        max_position_embeddings=8192, attn_implementation=attn)
    torch.manual_seed(0)  # the same weights for every implementation
    return transformers.LlamaForCausalLM(config).to("cuda", torch.bfloat16).eval()


@torch.no_grad()
def greedy(model, ids: torch.Tensor, new: int):
    """(prefill seconds, decode seconds, new tokens) of a greedy loop over a DynamicCache."""
    cache = transformers.DynamicCache()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    logits = model(ids, past_key_values=cache, use_cache=True).logits
    token = logits[:, -1].argmax(-1, keepdim=True)
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    tokens = [token]
    for _ in range(new - 1):
        logits = model(token, past_key_values=cache, use_cache=True).logits
        token = logits[:, -1].argmax(-1, keepdim=True)
        tokens.append(token)
    torch.cuda.synchronize()
    return t1 - t0, time.perf_counter() - t1, torch.cat(tokens, 1)


def first_difference(tokens: torch.Tensor, base: torch.Tensor) -> float:
    """Median over rows of the first step whose token differs (the length if none)."""
    same = (tokens == base).int().cumprod(1)
    return statistics.median(same.sum(1).tolist())


def profile_decode(model, ids: torch.Tensor, steps: int = 4):
    from torch.profiler import ProfilerActivity, profile

    cache = transformers.DynamicCache()
    with torch.no_grad():
        token = model(ids, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                token = model(token, past_key_values=cache, use_cache=True).logits[:, -1:]
                token = token.argmax(-1)
            torch.cuda.synchronize()
    table = prof.key_averages()
    print(f"\nprofile of {steps} asymattn decode steps, by self CPU time")
    print(table.table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=60))
    print("\nby device time")
    print(table.table(sort_by="self_device_time_total", row_limit=12, max_name_column_width=60))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--cprofile", action="store_true")
    ap.add_argument("--compile", action="store_true")
    args = ap.parse_args()
    register()
    torch.manual_seed(1)
    ids = torch.randint(1, 32000, (args.batch, args.prompt), device="cuda")
    print(f"transformers {transformers.__version__}, torch {torch.__version__}, "
          f"{torch.cuda.get_device_name()}; Llama-style {args.layers} layers, 16 q / 4 kv heads "
          f"x 128, bf16; batch {args.batch}, prompt {args.prompt}, {args.new} new tokens"
          + ("; torch.compile(dynamic=True)" if args.compile else ""))
    print("| attention | prefill ms | decode ms/step | decode tokens/s | first token unlike "
          "sdpa's (median step) |")
    print("|---|---|---|---|---|")
    base = None
    for attn in ("sdpa", NAME, "eager"):
        model = model_for(attn, args.layers)
        if args.compile:
            model.forward = torch.compile(model.forward, dynamic=True)
        # Warm-up over the same lengths: kernels compile per specialisation (an int argument
        # divisible by 16 or not), so a shorter warm-up leaves a compile inside the timing.
        greedy(model, ids, args.new)
        if args.cprofile:
            import cProfile
            import pstats

            prof = cProfile.Profile()
            prof.enable()
        prefill_s, decode_s, tokens = greedy(model, ids, args.new)
        if args.cprofile:
            prof.disable()
            print(f"\ncProfile, {attn}: prefill + {args.new} decode steps, by own time")
            pstats.Stats(prof).sort_stats("tottime").print_stats(14)
        base = tokens if base is None else base
        step_s = decode_s / (args.new - 1)
        print(f"| {attn} | {prefill_s * 1e3:.1f} | {step_s * 1e3:.2f} | "
              f"{args.batch / step_s:.0f} | {first_difference(tokens, base):g} of {args.new} |",
              flush=True)
        if attn == NAME and args.profile:
            profile_decode(model, ids)
        del model
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
