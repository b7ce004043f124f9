# PyTorch reference for gpu_step (docs/cuda.md): GPT-2 124M in nanoGPT's layout (tied head), B=8,
# T=1024, bf16 autocast over fp32 weights, SDPA attention, fused AdamW with clipping 1.0, one GPU,
# eager (no torch.compile). Prints one JSON line. Run: python3 torch_gpt2_step.py [steps]
import json, math, sys, time
import torch
import torch.nn as nn
import torch.nn.functional as F

B, T, V, L, H, C = 8, 1024, 50257, 12, 12, 768
steps, warmup = int(sys.argv[1]) if len(sys.argv) > 1 else 10, 3


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(C), nn.LayerNorm(C)
        self.qkv, self.proj = nn.Linear(C, 3 * C), nn.Linear(C, C)
        self.fc, self.fc_proj = nn.Linear(C, 4 * C), nn.Linear(4 * C, C)

    def forward(self, x):
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, H, C // H).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.fc_proj(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(V, C), nn.Embedding(T, C)
        self.blocks = nn.ModuleList(Block() for _ in range(L))
        self.ln_f = nn.LayerNorm(C)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
        for b in self.blocks:
            x = b(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)
        return F.cross_entropy(logits.view(-1, V).float(), targets.view(-1))


torch.manual_seed(0)
model = GPT().cuda()
params = sum(p.numel() for p in model.parameters())
opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1,
                        fused=True)
idx = torch.randint(0, V, (B, T), device="cuda")
tgt = torch.randint(0, V, (B, T), device="cuda")


def step():
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(idx, tgt)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


for _ in range(warmup):
    step()
torch.cuda.synchronize()
t0 = time.perf_counter()
for _ in range(steps):
    loss = step()
torch.cuda.synchronize()
secs = time.perf_counter() - t0
tok = B * T * steps / secs
flops = 6 * params + 6 * L * C * T
print(json.dumps({"bench": "torch_gpt2_step", "config": {
    "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "params": params,
    "B": B, "T": T, "autocast": "bf16", "optimizer": "AdamW fused", "compile": False},
    "value": round(tok), "unit": "tokens/s", "step_ms": round(secs * 1e3 / steps, 2),
    "model_tflops": round(flops * tok / 1e12, 1),
    "max_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
    "loss": round(loss.item(), 4)}))
