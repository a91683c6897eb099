"""Greedy generation through transformers with attn_implementation="asymattn" beside "sdpa"
(and "eager" at short prompts): prefill time, decode tokens/s, and how many greedy tokens
agree with sdpa's. A randomly initialised Llama-style model (no download), bf16, on the GPU.

    PYTHONPATH=. python3 scripts/hf-generate-bench.py [--batch 8] [--prompt 1024] [--new 128]

Decode time is the generate() call minus a prefill-only forward of the same prompt, over the
new tokens (batch x new). Each implementation builds the same weights (seeded) and runs one
warm-up generate first (kernel compiles, allocator).
"""

from __future__ import annotations

import argparse
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


def timed(fn) -> tuple[float, object]:
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start, out


def run(attn: str, ids: torch.Tensor, new: int, layers: int):
    model = model_for(attn, layers)
    kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        model.generate(ids[:, :64], **dict(kw, max_new_tokens=8, min_new_tokens=8))  # warm-up
        model(ids)
        prefill_s = min(timed(lambda: model(ids))[0] for _ in range(3))
        total_s, out = timed(lambda: model.generate(ids, **kw))
    return prefill_s, total_s, out[:, ids.shape[1]:]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--layers", type=int, default=8)
    args = ap.parse_args()
    register()
    torch.manual_seed(1)
    ids = torch.randint(1, 32000, (args.batch, args.prompt), device="cuda")
    impls = ["sdpa", NAME] + (["eager"] if args.prompt <= 2048 else [])
    print(f"transformers {transformers.__version__}, torch {torch.__version__}, "
          f"{torch.cuda.get_device_name()}; Llama-style {args.layers} layers, 16 q / 4 kv heads "
          f"x 128, bf16; batch {args.batch}, prompt {args.prompt}, {args.new} new tokens")
    print("| attention | prefill ms | decode ms/step | decode tokens/s | tokens equal to sdpa |")
    print("|---|---|---|---|---|")
    base = None
    for attn in impls:
        prefill_s, total_s, tokens = run(attn, ids, args.new, args.layers)
        torch.cuda.empty_cache()  # the model went with run()'s frame
        step_s = max(total_s - prefill_s, 1e-9) / args.new
        if base is None:
            base = tokens
        same = (tokens == base).float().mean().item()
        print(f"| {attn} | {prefill_s * 1e3:.1f} | {step_s * 1e3:.2f} | "
              f"{args.batch / step_s:.0f} | {same:.1%} |", flush=True)


if __name__ == "__main__":
    main()
