"""transformers' side of models/llama_test.cc: tiny Llama-family models.

  llama_interop.py write DIR   for each case: DIR/CASE (save_pretrained, in
                               several safetensors files) and DIR/CASE.ref.safetensors
                               (input_ids; logits and loss; logits after one SGD step)
  llama_interop.py check DIR   for each case: loads DIR/CASE.cpp (our
                               SaveCheckpoint, kHuggingFace) with from_pretrained and
                               writes its logits to DIR/CASE.reloaded.safetensors
  llama_interop.py serve DIR   write, prints "written", waits for DIR/saved, check,
                               prints "checked": what the test runs, so that
                               transformers is imported once

Everything is built from a config object: nothing is downloaded. Exits 77
when this Python has no transformers (the test skips).
"""

import os
import sys
import time

os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
try:
    import torch
    import transformers
    from safetensors.torch import save_file
except ImportError:
    sys.exit(77)

BATCH, TIME, LR = 2, 8, 0.5
SIZES = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_attention_heads=4,
             num_key_value_heads=2, rms_norm_eps=1e-5, max_position_embeddings=256)

CASES = {
    # llama3 rope: high, medium and low frequencies all present at head_dim 16.
    "llama3": lambda: transformers.LlamaConfig(
        **SIZES, num_hidden_layers=2, rope_theta=500000.0, tie_word_embeddings=False,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "llama_tied": lambda: transformers.LlamaConfig(
        **SIZES, num_hidden_layers=2, tie_word_embeddings=True, attention_bias=True,
        mlp_bias=True),
    "mistral": lambda: transformers.MistralConfig(
        **SIZES, num_hidden_layers=2, sliding_window=4, tie_word_embeddings=False),
    "qwen2": lambda: transformers.Qwen2Config(
        **SIZES, num_hidden_layers=2, tie_word_embeddings=True, rope_theta=1000000.0),
    "qwen3": lambda: transformers.Qwen3Config(
        **SIZES, num_hidden_layers=3, head_dim=32, tie_word_embeddings=False),
}


def build(name):
    torch.manual_seed(sorted(CASES).index(name) + 1)
    config = CASES[name]()
    model = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation="eager", dtype=torch.float32)
    # Norm weights and biases away from their 1 and 0, so that a missing or
    # misplaced one shows.
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.add_(0.2 * torch.randn_like(p))
            elif pname.endswith("bias"):
                p.normal_(0.0, 0.05)
    return model


def write(root):
    for name in CASES:
        model = build(name)
        model.save_pretrained(os.path.join(root, name), max_shard_size=100_000)
        gen = torch.Generator().manual_seed(7)
        ids = torch.randint(0, SIZES["vocab_size"], (BATCH, TIME), generator=gen)
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        optimizer.step()
        with torch.no_grad():
            after = model(input_ids=ids).logits
        save_file({"input_ids": ids, "logits": out.logits.detach().contiguous(),
                   "loss": out.loss.detach().reshape(1), "logits_after": after.contiguous()},
                  os.path.join(root, name + ".ref.safetensors"))


def check(root):
    for name in CASES:
        path = os.path.join(root, name + ".cpp")
        if not os.path.isdir(path):
            continue  # The test failed before saving it, and says so.
        model = transformers.AutoModelForCausalLM.from_pretrained(
            path, attn_implementation="eager", dtype=torch.float32)
        gen = torch.Generator().manual_seed(7)
        ids = torch.randint(0, SIZES["vocab_size"], (BATCH, TIME), generator=gen)
        with torch.no_grad():
            logits = model(input_ids=ids).logits
        save_file({"logits": logits.contiguous()},
                  os.path.join(root, name + ".reloaded.safetensors"))


def serve(root):
    write(root)
    print("written", flush=True)
    # The test creates DIR/saved when it is done saving (or has failed).
    deadline = time.time() + 240
    while not os.path.exists(os.path.join(root, "saved")):
        if time.time() > deadline:
            sys.exit("llama_interop.py: no %s/saved after 240 s" % root)
        time.sleep(0.05)
    check(root)
    print("checked", flush=True)


if __name__ == "__main__":
    torch.set_num_threads(1)
    transformers.utils.logging.disable_progress_bar()
    {"write": write, "check": check, "serve": serve}[sys.argv[1]](sys.argv[2])
