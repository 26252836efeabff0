"""Writes a small random Llama in Hugging Face's layout, and a token file.

  tiny_hf_llama.py DIR

DIR/model gets config.json and model.safetensors (float32, HF's parameter
names); DIR/tokens.bin gets 20000 uint16 token ids that repeat a 13-token
phrase with one random token in every 4, so that a few steps of LoRA lower
the loss. Needs only torch: the GPU machine that tools/gpu_verify.sh runs
on has no transformers. The safetensors layout is written as its
specification gives it (an 8-byte little-endian header size, the JSON
header, the tensors' bytes).
"""
import json
import os
import struct
import sys

import torch

VOCAB, HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS = 256, 128, 256, 2, 4, 2
CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": VOCAB,
    "hidden_size": HIDDEN, "intermediate_size": INTERMEDIATE, "num_hidden_layers": LAYERS,
    "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0, "max_position_embeddings": 512, "tie_word_embeddings": False,
    "torch_dtype": "float32",
}


def parameters():
    head_dim = HIDDEN // HEADS
    shapes = {"model.embed_tokens.weight": (VOCAB, HIDDEN), "model.norm.weight": (HIDDEN,),
              "lm_head.weight": (VOCAB, HIDDEN)}
    for i in range(LAYERS):
        layer = "model.layers.%d." % i
        shapes.update({
            layer + "self_attn.q_proj.weight": (HEADS * head_dim, HIDDEN),
            layer + "self_attn.k_proj.weight": (KV_HEADS * head_dim, HIDDEN),
            layer + "self_attn.v_proj.weight": (KV_HEADS * head_dim, HIDDEN),
            layer + "self_attn.o_proj.weight": (HIDDEN, HEADS * head_dim),
            layer + "mlp.gate_proj.weight": (INTERMEDIATE, HIDDEN),
            layer + "mlp.up_proj.weight": (INTERMEDIATE, HIDDEN),
            layer + "mlp.down_proj.weight": (HIDDEN, INTERMEDIATE),
            layer + "input_layernorm.weight": (HIDDEN,),
            layer + "post_attention_layernorm.weight": (HIDDEN,),
        })
    generator = torch.Generator().manual_seed(7)
    return {name: (torch.ones(shape) if len(shape) == 1
                   else 0.02 * torch.randn(shape, generator=generator))
            for name, shape in sorted(shapes.items())}


def write_safetensors(path, tensors):
    header, offset, blobs = {}, 0, []
    for name, tensor in tensors.items():
        blob = tensor.contiguous().numpy().tobytes()
        header[name] = {"dtype": "F32", "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + len(blob)]}
        offset += len(blob)
        blobs.append(blob)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for blob in blobs:
            f.write(blob)


def main(root):
    model = os.path.join(root, "model")
    os.makedirs(model, exist_ok=True)
    with open(os.path.join(model, "config.json"), "w") as f:
        json.dump(CONFIG, f, indent=1)
    write_safetensors(os.path.join(model, "model.safetensors"), parameters())
    generator = torch.Generator().manual_seed(11)
    phrase = torch.randint(0, VOCAB, (13,), generator=generator)
    ids = phrase.repeat(20000 // 13 + 1)[:20000].clone()
    noisy = torch.arange(ids.numel()) % 4 == 3
    ids[noisy] = torch.randint(0, VOCAB, (int(noisy.sum()),), generator=generator)
    ids.to(torch.int32).numpy().astype("<u2").tofile(os.path.join(root, "tokens.bin"))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
