"""peft's side of models/lora_test.cc: LoRA fine-tuning of a tiny Llama.

  peft_interop.py serve DIR   writes DIR/base (transformers' save_pretrained,
                              several files and an index), DIR/adapter0 (a
                              peft adapter with random A and B), and
                              DIR/ref.safetensors (the batches, each step's
                              loss of STEPS AdamW steps, the trained adapter's
                              tensors, the trained model's logits); prints
                              "written"; waits for DIR/saved; loads DIR/ours
                              (our SavePeftAdapter) with
                              PeftModel.from_pretrained and writes its adapter
                              tensors and logits to DIR/reloaded.safetensors;
                              prints "checked".

Nothing is downloaded. Exits 77 when this Python has no transformers or
peft (the test skips).
"""

import os
import sys
import time

os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
try:
    import torch
    import transformers
    import peft
    from safetensors.torch import save_file
except ImportError:
    sys.exit(77)

BATCH, TIME, STEPS = 2, 8, 6
LR, BETAS, EPS, WEIGHT_DECAY = 1e-2, (0.9, 0.999), 1e-8, 0.01
TARGETS = ["q_proj", "v_proj", "down_proj"]
RANK, ALPHA = 4, 8


def build_base():
    torch.manual_seed(3)
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_attention_heads=4,
        num_key_value_heads=2, rms_norm_eps=1e-5, max_position_embeddings=256,
        num_hidden_layers=2, tie_word_embeddings=False)
    model = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
    return model


def adapter_tensors(model):
    state = peft.get_peft_model_state_dict(model)
    return {k: v.detach().contiguous().clone() for k, v in state.items()}


def batches():
    gen = torch.Generator().manual_seed(11)
    return torch.randint(0, 128, (STEPS, BATCH, TIME), generator=gen)


def write(root):
    base = build_base()
    base.save_pretrained(os.path.join(root, "base"), max_shard_size=100_000)
    config = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0,
                             target_modules=TARGETS, init_lora_weights=False,
                             task_type="CAUSAL_LM")
    model = peft.get_peft_model(base, config)
    torch.manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(0.1 * torch.randn_like(p))
    model.save_pretrained(os.path.join(root, "adapter0"))
    ids = batches()
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=LR, betas=BETAS, eps=EPS,
                                  weight_decay=WEIGHT_DECAY)
    losses = []
    for step in range(STEPS):
        loss = model(input_ids=ids[step], labels=ids[step]).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    with torch.no_grad():
        logits = model(input_ids=ids[0]).logits
    ref = {"input_ids": ids, "losses": torch.stack(losses), "logits": logits.contiguous()}
    ref.update({"trained." + k: v for k, v in adapter_tensors(model).items()})
    save_file(ref, os.path.join(root, "ref.safetensors"))


def check(root):
    path = os.path.join(root, "ours")
    if not os.path.isdir(path):
        return  # The test failed before saving it, and says so.
    base = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.join(root, "base"), attn_implementation="eager", dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(base, path)
    with torch.no_grad():
        logits = model(input_ids=batches()[0]).logits
    out = {"logits": logits.contiguous()}
    out.update({"reloaded." + k: v for k, v in adapter_tensors(model).items()})
    save_file(out, os.path.join(root, "reloaded.safetensors"))


def serve(root):
    write(root)
    print("written", flush=True)
    # The test creates DIR/saved when it is done saving (or has failed).
    deadline = time.time() + 240
    while not os.path.exists(os.path.join(root, "saved")):
        if time.time() > deadline:
            sys.exit("peft_interop.py: no %s/saved after 240 s" % root)
        time.sleep(0.05)
    check(root)
    print("checked", flush=True)


if __name__ == "__main__":
    torch.set_num_threads(1)
    transformers.utils.logging.disable_progress_bar()
    {"serve": serve}[sys.argv[1]](sys.argv[2])
