"""transformers' and peft's side of the main job's --hf_model test
(models/train_gpt_hf_test.cc): the same fine-tuning replayed in PyTorch.

  hf_job_interop.py write DIR
      DIR/llama and DIR/qwen3 (random-initialized, written by save_pretrained
      in several safetensors files with an index), DIR/adapter0 (a peft LoRA
      adapter of DIR/llama with random A and B) and DIR/tokens.bin (uint16
      ids below the vocabulary, nanoGPT's train.bin layout).
  hf_job_interop.py replay MODEL BATCHES METRICS [--peft=ADAPTER]
                           [--export_hf=DIR] [--export_peft=DIR]
      Trains MODEL (with ADAPTER's adapters continued, the base frozen) on
      the batches train_gpt recorded, with AdamW and global-norm clipping as
      train_gpt applies them, and compares every step's loss with its
      --metrics_jsonl (--tolerance). Then reads train_gpt's exports:
      --export_hf with from_pretrained (its weights against the trained
      model's, merged for LoRA, --weight_tolerance) and --export_peft with
      PeftModel.from_pretrained (its adapter's tensors and logits against
      the trained adapter's). Exits 1 on any difference beyond tolerance.

Nothing is downloaded. Exits 77 when this Python lacks transformers or peft
(the test skips).
"""
import argparse
import json
import os
import sys

os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
try:
    import numpy as np
    import peft
    import torch
    import torch.nn.functional as F
    import transformers
except ImportError:
    sys.exit(77)

VOCAB = 128
SIZES = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4,
             num_key_value_heads=2, rms_norm_eps=1e-5, max_position_embeddings=256)
MODELS = {
    "llama": lambda: transformers.LlamaConfig(
        **SIZES, num_hidden_layers=2, tie_word_embeddings=False, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "qwen3": lambda: transformers.Qwen3Config(
        **SIZES, num_hidden_layers=3, head_dim=32, tie_word_embeddings=True),
}
ADAPTER = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
               lora_dropout=0.0)


def load(path):
    return transformers.AutoModelForCausalLM.from_pretrained(
        path, attn_implementation="eager", dtype=torch.float32)


def write(args):
    root = args.paths[0]
    for index, (name, config) in enumerate(sorted(MODELS.items())):
        torch.manual_seed(index + 1)
        model = transformers.AutoModelForCausalLM.from_config(
            config(), attn_implementation="eager", dtype=torch.float32)
        with torch.no_grad():  # Norms away from 1: a missing one shows.
            for pname, p in model.named_parameters():
                if "norm" in pname:
                    p.add_(0.2 * torch.randn_like(p))
        model.save_pretrained(os.path.join(root, name), max_shard_size=100_000)
    base = load(os.path.join(root, "llama"))
    lora = peft.get_peft_model(base, peft.LoraConfig(task_type="CAUSAL_LM", **ADAPTER))
    torch.manual_seed(5)
    with torch.no_grad():  # B random too, so that the adapters change the output.
        for pname, p in lora.named_parameters():
            if "lora_B" in pname:
                p.normal_(0.0, 0.05)
    lora.save_pretrained(os.path.join(root, "adapter0"))
    ids = np.random.default_rng(3).integers(0, VOCAB, size=20000, dtype=np.uint16)
    ids.astype("<u2").tofile(os.path.join(root, "tokens.bin"))
    return 0


def largest_difference(a, b):
    return (a.detach().float() - b.detach().float()).abs().max().item()


def replay(args):
    model_dir, batches_path, metrics_path = args.paths
    model = load(model_dir)
    if args.peft:
        model = peft.PeftModel.from_pretrained(model, args.peft, is_trainable=True)
    tokens = torch.load(batches_path, weights_only=True)["tokens"]
    expected = [json.loads(line)["loss"] for line in open(metrics_path)]
    if len(expected) != tokens.size(0):
        print("replay: %d recorded batches but %d metric lines" % (tokens.size(0), len(expected)))
        return 1
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=args.lr, betas=(args.beta1, args.beta2),
                                  eps=args.eps, weight_decay=args.weight_decay)
    worst = 0.0
    for step in range(tokens.size(0)):
        batch = tokens[step]
        logits = model(input_ids=batch[:, :-1]).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, args.grad_clip)
        optimizer.step()
        worst = max(worst, abs(loss.item() - expected[step]))
        print("step %d: PyTorch loss %.6f, train_gpt loss %.6f" % (step + 1, loss.item(),
                                                                   expected[step]))
    print("largest loss difference %.3g" % worst)
    ok = worst <= args.tolerance
    probe = tokens[-1][:, :-1]
    if args.export_peft:
        theirs = peft.get_peft_model_state_dict(model)
        reloaded = peft.PeftModel.from_pretrained(load(model_dir), args.export_peft)
        ours = peft.get_peft_model_state_dict(reloaded)
        if sorted(ours) != sorted(theirs):
            print("--export_peft holds %s, peft trained %s" % (sorted(ours), sorted(theirs)))
            return 1
        diff = max(largest_difference(ours[k], theirs[k]) for k in theirs)
        with torch.no_grad():
            logits_diff = largest_difference(reloaded(input_ids=probe).logits,
                                             model(input_ids=probe).logits)
        print("--export_peft: %d adapter tensors, largest difference %.3g; logits %.3g"
              % (len(theirs), diff, logits_diff))
        ok = ok and diff <= args.weight_tolerance and logits_diff <= args.weight_tolerance
    if args.export_hf:
        trained = model.merge_and_unload() if args.peft else model
        reloaded = load(args.export_hf)
        theirs = dict(trained.named_parameters())
        ours = dict(reloaded.named_parameters())
        if sorted(ours) != sorted(theirs):
            print("--export_hf holds %s, transformers trained %s" % (sorted(ours), sorted(theirs)))
            return 1
        diff = max(largest_difference(ours[k], theirs[k]) for k in theirs)
        with torch.no_grad():
            logits_diff = largest_difference(reloaded(input_ids=probe).logits,
                                             trained(input_ids=probe).logits)
        print("--export_hf: %d tensors, largest difference %.3g; logits %.3g"
              % (len(theirs), diff, logits_diff))
        ok = ok and diff <= args.weight_tolerance and logits_diff <= args.weight_tolerance
    return 0 if ok else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["write", "replay"])
    parser.add_argument("paths", nargs="+")
    for name, default in [("lr", 3e-3), ("beta1", 0.9), ("beta2", 0.99), ("eps", 1e-8),
                          ("weight_decay", 0.01), ("grad_clip", 1.0), ("tolerance", 1e-4),
                          ("weight_tolerance", 1e-3)]:
        parser.add_argument("--" + name, type=float, default=default)
    for name in ("peft", "export_hf", "export_peft"):
        parser.add_argument("--" + name, default="")
    args = parser.parse_args()
    sys.exit({"write": write, "replay": replay}[args.mode](args) or 0)
