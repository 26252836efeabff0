"""Python side of gpt_interop_test: a PyTorch GPT with nanoGPT's module
layout and parameter names (model.py of karpathy/nanoGPT: attention through
F.scaled_dot_product_attention on torch >= 2, as the C++ GPT built against
libtorch >= 2 does, else written out; no attn.bias buffer), used to check
that state dicts move between the C++ GPT and PyTorch both ways."""
import math
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

CONFIG = dict(vocab_size=256, block_size=16, n_layer=2, n_head=2, n_embd=32)


class CausalSelfAttention(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c_attn = nn.Linear(c["n_embd"], 3 * c["n_embd"])
        self.c_proj = nn.Linear(c["n_embd"], c["n_embd"])
        self.n_head = c["n_head"]

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        if hasattr(F, "scaled_dot_product_attention"):
            # torch >= 2, as the C++ GPT built against libtorch >= 2.
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            mask = torch.tril(torch.ones(T, T, dtype=torch.bool, device=x.device))
            att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
            y = att @ v
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c_fc = nn.Linear(c["n_embd"], 4 * c["n_embd"])
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * c["n_embd"], c["n_embd"])

    def forward(self, x):
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.ln_1 = nn.LayerNorm(c["n_embd"])
        self.attn = CausalSelfAttention(c)
        self.ln_2 = nn.LayerNorm(c["n_embd"])
        self.mlp = MLP(c)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(c["vocab_size"], c["n_embd"]),
            wpe=nn.Embedding(c["block_size"], c["n_embd"]),
            h=nn.ModuleList([Block(c) for _ in range(c["n_layer"])]),
            ln_f=nn.LayerNorm(c["n_embd"]),
        ))
        self.lm_head = nn.Linear(c["n_embd"], c["vocab_size"], bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # Tied, as nanoGPT.

    def forward(self, idx):
        pos = torch.arange(idx.size(1), dtype=torch.long, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


def fail(message):
    print("gpt interop failed: " + message)
    sys.exit(1)


def check_cpp(directory):
    """Loads the C++ model's state dict strictly and reproduces its logits."""
    model = GPT(CONFIG)
    state = torch.load(directory + "/cpp_gpt.pt", weights_only=True)
    model.load_state_dict(state, strict=True)
    io = torch.load(directory + "/cpp_io.pt", weights_only=True)
    with torch.no_grad():
        logits = model(io["tokens"])
    if not torch.allclose(logits, io["logits"], atol=1e-5, rtol=1e-5):
        fail("logits differ by %g" % (logits - io["logits"]).abs().max().item())


def write_python(directory):
    """A model of its own initialization, its state dict and its logits."""
    torch.manual_seed(7)
    model = GPT(CONFIG)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.1)
    tokens = torch.randint(0, CONFIG["vocab_size"], (3, CONFIG["block_size"]))
    with torch.no_grad():
        logits = model(tokens)
    torch.save(model.state_dict(), directory + "/py_gpt.pt")
    torch.save({"tokens": tokens, "logits": logits}, directory + "/py_io.pt")


if __name__ == "__main__":
    {"check_cpp": check_cpp, "write_python": write_python}[sys.argv[1]](sys.argv[2])
