#!/usr/bin/env python3
"""PyTorch peer of benchmarks/nn/gpt_step: the same GPT-2 step on the CPU, timed the same way.

gpt_step runs this script (when the Python it is given can import torch) right after its own rows
for a dtype, so that zero's step time can be stated relative to PyTorch's measured in the same run
on the same machine. The model is plain nn.Module code with the shape and initialisation of
zero::nn::GPT: learned positions, pre-LN blocks, causal attention through
F.scaled_dot_product_attention, a GELU(tanh) MLP of 4C hidden units, biases everywhere, LayerNorm
eps 1e-5, no dropout, and an LM head tied to the token embedding. For bf16 the parameters and
activations are bf16 (model.to(torch.bfloat16)), as zero's bf16 storage.

Timing follows gpt_step: per thread count one warm-up step, then the best of --steps steps, with
the gradients zeroed outside the timed region. Gradients are zeroed in place
(zero_grad(set_to_none=False)) so that, as in zero's step, backward accumulates into existing
zeroed buffers instead of allocating fresh ones each step. Two figures: (a) forward+backward, the
one compared with gpt_step, and (b) forward+backward+torch.optim.AdamW.step() (foreach left at its
default), timed in a second loop after (a) because it changes the weights. In bf16 this AdamW
updates the bf16 parameters directly (its states are bf16 too), while zero's updates an fp32
master copy and writes the rounded bf16 parameters back: not the same work per parameter.

One JSON object per line per (dtype, threads):
  {"bench": "gpt_step_peer", "config": {...}, "value": tokens/s of (a), "unit": "tokens/s",
   "ms_per_step": (a), "ms_per_step_with_adamw": (b), "loss": initial loss}

  python torch_peer.py [--layers L --heads H --channels C --vocab V] [--positions P]
                       [--batch B] [--seq T] [--dtype f32,bf16] [--threads 1,2] [--steps 3]
                       [--model NAME]
No network access and no downloads: the weights are random, the tokens a fixed pattern.
"""
import argparse
import json
import math
import time

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    """One pre-LN transformer block: x + attn(ln_1(x)), then x + mlp(ln_2(x))."""

    def __init__(self, channels, heads):
        super().__init__()
        self.heads = heads
        self.ln_1 = nn.LayerNorm(channels, eps=1e-5)
        self.c_attn = nn.Linear(channels, 3 * channels)
        self.attn_proj = nn.Linear(channels, channels)
        self.ln_2 = nn.LayerNorm(channels, eps=1e-5)
        self.c_fc = nn.Linear(channels, 4 * channels)
        self.gelu = nn.GELU(approximate="tanh")
        self.mlp_proj = nn.Linear(4 * channels, channels)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attn_proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.mlp_proj(self.gelu(self.c_fc(self.ln_2(x))))


class GPT(nn.Module):
    """GPT-2 with zero::nn::GPT's parameter count: wte, wpe, L blocks of 12C^2 + 13C, ln_f."""

    def __init__(self, layers, heads, channels, vocab, positions):
        super().__init__()
        self.wte = nn.Embedding(vocab, channels)
        self.wpe = nn.Embedding(positions, channels)
        self.blocks = nn.ModuleList(Block(channels, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(channels, eps=1e-5)
        # zero's initialisers: N(0, 0.02), residual projections N(0, 0.02 / sqrt(2L)), zero biases.
        residual_std = 0.02 / math.sqrt(2 * layers)
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif ".ln_" in name or name.startswith("ln_f"):
                nn.init.ones_(p)
            else:
                residual = name.endswith(("attn_proj.weight", "mlp_proj.weight"))
                nn.init.normal_(p, mean=0.0, std=residual_std if residual else 0.02)

    def forward(self, tokens, targets):
        T = tokens.shape[1]
        x = self.wte(tokens) + self.wpe(torch.arange(T, device=tokens.device))
        for block in self.blocks:
            x = block(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)  # the tied LM head, no bias
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


def batch(B, T, vocab):
    """gpt_step's token and target pattern, so both sides see the same data."""
    i = torch.arange(B * T, dtype=torch.int64)
    tokens = (i * 2654435761) % vocab
    targets = (i * 40503 + 7) % vocab
    return tokens.view(B, T), targets.view(B, T)


def best_step_seconds(step, model, steps):
    """Best of `steps` timed calls of step() after one warm-up, grads zeroed in place untimed."""
    best = math.inf
    for s in range(steps + 1):
        model.zero_grad(set_to_none=False)
        t0 = time.perf_counter()
        step()
        t = time.perf_counter() - t0
        if s > 0:
            best = min(best, t)
    return best


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="label for the config (default: custom-...)")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--channels", type=int, default=768)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--positions", type=int, default=None, help="rows of wpe (default: --seq)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--dtype", default="f32,bf16")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    positions = args.positions or args.seq
    name = args.model or (
        f"custom-{args.layers}L-{args.channels}C-{args.heads}H-{args.vocab}V")
    dtypes = {"f32": torch.float32, "bf16": torch.bfloat16}

    tokens, targets = batch(args.batch, args.seq, args.vocab)
    for dtype_name in args.dtype.split(","):
        if dtype_name not in dtypes:
            ap.error(f"unknown dtype {dtype_name} (expected f32 or bf16)")
        torch.manual_seed(1234)
        model = GPT(args.layers, args.heads, args.channels, args.vocab, positions)
        model = model.to(dtypes[dtype_name]).train()
        n_params = sum(p.numel() for p in model.parameters())  # the tied weight counts once
        with torch.no_grad():
            initial_loss = model(tokens, targets).float().item()
        for threads in (int(t) for t in args.threads.split(",")):
            torch.set_num_threads(threads)

            def fwd_bwd():
                model(tokens, targets).backward()

            seconds = best_step_seconds(fwd_bwd, model, args.steps)
            optimizer = torch.optim.AdamW(model.parameters(), lr=6e-4, weight_decay=0.1)

            def fwd_bwd_adamw():
                fwd_bwd()
                optimizer.step()

            seconds_adamw = best_step_seconds(fwd_bwd_adamw, model, args.steps)
            print(json.dumps({
                "bench": "gpt_step_peer",
                "config": {
                    "model": name, "params": n_params, "B": args.batch, "T": args.seq,
                    "dtype": dtype_name, "threads": threads, "torch": torch.__version__,
                    "mkldnn": torch.backends.mkldnn.is_available(),
                },
                "value": round(args.batch * args.seq / seconds, 1),
                "unit": "tokens/s",
                "ms_per_step": round(seconds * 1e3, 1),
                "ms_per_step_with_adamw": round(seconds_adamw * 1e3, 1),
                "loss": round(initial_loss, 4),
            }), flush=True)


if __name__ == "__main__":
    main()
