// The main job's flags (declared in models/train_gpt_flags.h).
#include "models/train_gpt_flags.h"

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/flags/flag.h"

ABSL_FLAG(int, world_size, 2, "Ranks to launch on this host (launcher mode).");
ABSL_FLAG(int, steps, 400, "Optimizer steps.");
ABSL_FLAG(int, batch_size, 16, "Sequences per rank per step.");
ABSL_FLAG(int, block_size, 32, "Context length.");
ABSL_FLAG(int, n_layer, 2, "Transformer blocks (one FSDP unit each).");
ABSL_FLAG(int, n_head, 4, "Attention heads.");
ABSL_FLAG(int, n_embd, 64, "Model width.");
ABSL_FLAG(double, dropout, 0.0,
          "nanoGPT's dropout probability, in [0, 1): after the embeddings, on the attention "
          "weights and after each block's projections; off for the eval loss and the sample. "
          "Masks come from a seed of --seed, the rank and the step.");
ABSL_FLAG(bool, activation_checkpointing, false,
          "Recompute each block's activations in backward instead of keeping them "
          "(fsdp/activation_checkpointing.h): about one more forward per step for most of the "
          "activation memory.");
ABSL_FLAG(std::string, hf_model, "",
          "Train this open-weight model instead of the byte-level GPT: a Hugging Face "
          "directory (config.json of model_type llama, mistral, qwen2 or qwen3, and the "
          "weights as model.safetensors or sharded with model.safetensors.index.json, as "
          "transformers' save_pretrained writes them). Each decoder layer is an FSDP unit "
          "and every rank reads only its shards' rows; training computes in float32. "
          "--n_layer, --n_head, --n_embd and --dropout are the config's; --block_size is "
          "the sequence length. Train on --data_tokens (ids of the model's tokenizer).");
ABSL_FLAG(std::string, export_hf, "",
          "With --hf_model: write the trained model here as transformers' save_pretrained "
          "does (config.json, safetensors and their index), for from_pretrained; with LoRA "
          "adapters, merged into the base weights first (after --export_peft is written).");
ABSL_FLAG(int, lora_r, 0,
          "With --hf_model: LoRA adapters of this rank (PEFT's r) on --lora_targets, the base "
          "frozen; 0: none, the whole model trains.");
ABSL_FLAG(double, lora_alpha, 8, "PEFT's lora_alpha: the adapters' scale is lora_alpha / r.");
ABSL_FLAG(double, lora_dropout, 0, "PEFT's lora_dropout, in [0, 1).");
ABSL_FLAG(std::vector<std::string>, lora_targets, (std::vector<std::string>{"q_proj", "v_proj"}),
          "PEFT's target_modules: the projections that get adapters (q_proj, k_proj, v_proj, "
          "o_proj, gate_proj, up_proj, down_proj).");
ABSL_FLAG(std::string, init_peft, "",
          "With --hf_model: start the adapters from this PEFT adapter directory "
          "(adapter_config.json and adapter_model.safetensors, e.g. written by peft's "
          "save_pretrained); its config sets r, alpha, dropout and the targets, so --lora_* "
          "are not given.");
ABSL_FLAG(std::string, export_peft, "",
          "With LoRA adapters: write them here as PEFT does, for PeftModel.from_pretrained.");
ABSL_FLAG(std::string, data, "",
          "Train on this file's bytes (tokens 0..255) instead of the generated corpus: the "
          "first 90% trains, the last 10% is held out for the eval loss and the prompt of "
          "the sample printed at the end.");
ABSL_FLAG(std::string, data_tokens, "",
          "Train on this file's token ids instead: nanoGPT's train.bin layout, little-endian "
          "ids of --data_tokens_dtype and nothing else, split as --data. The file is mapped, "
          "not read, and must not change during the run. The byte-level GPT embeds ids "
          "0..255 only: an id at or above that stops the job at the batch that draws it, "
          "naming its position.");
ABSL_FLAG(std::string, data_tokens_dtype, "uint16", "--data_tokens' ids: uint16 or uint32.");
ABSL_FLAG(int, eval_every, 50,
          "With --data or --data_tokens: the held-out loss every this many steps and after "
          "the last (0: only after the last).");
ABSL_FLAG(int, eval_batches, 4,
          "With --data or --data_tokens: global batches in the held-out loss, the same ones "
          "every time.");
ABSL_FLAG(int, sample_tokens, 64,
          "With --data: after training, generate this many bytes from a held-out prompt and "
          "print them (rank 0); 0: none.");
ABSL_FLAG(std::string, optimizer, "adamw", "adamw or sgd (with momentum --beta1).");
ABSL_FLAG(std::string, optimizer_kernel, "flat_exact",
          "How the optimizer steps the shards: flat_exact (each unit's shard as one tensor with "
          "libtorch's arithmetic, equal to per_parameter bit for bit; "
          "optim/flat_shard_optimizers.h), flat_fused (PyTorch's fused kernels over each "
          "unit's shard; libtorch >= 2.4; equal up to rounding) or per_parameter (libtorch's "
          "optimizers).");
// The optimizer's hyper-parameters are optional flags: on --resume, one
// given on the command line replaces the checkpoint's value (and says so),
// one not given keeps the checkpoint's.
ABSL_FLAG(std::optional<double>, lr, std::nullopt, "Learning rate (default 3e-3).");
ABSL_FLAG(std::optional<double>, weight_decay, std::nullopt,
          "Weight decay, decoupled for AdamW (default 0.01).");
ABSL_FLAG(std::optional<double>, beta1, std::nullopt, "AdamW beta1; SGD momentum (default 0.9).");
ABSL_FLAG(std::optional<double>, beta2, std::nullopt, "AdamW beta2 (default 0.99).");
ABSL_FLAG(std::optional<double>, eps, std::nullopt, "AdamW epsilon (default 1e-8).");
ABSL_FLAG(std::string, weight_decay_groups, "one",
          "one: every parameter in one group, decayed by --weight_decay; nanogpt: nanoGPT's two "
          "groups, the parameters of two or more dimensions (matmul weights, embeddings) "
          "decayed by --weight_decay, then the others (biases, LayerNorm) with no decay.");
ABSL_FLAG(double, grad_clip, 1.0,
          "Clip the global gradient norm to this (across all ranks and units); 0: off.");
ABSL_FLAG(std::string, metrics_jsonl, "",
          "Append one JSON line per step here (rank 0): step, loss, tokens_per_s, grad_norm. "
          "A resumed run (--resume, a restart) first drops the lines of steps after its "
          "checkpoint's, so that each step is there once.");
ABSL_FLAG(std::string, sharding_strategy, "full_shard",
          "full_shard, shard_grad_op, no_shard, hybrid_shard or _hybrid_shard_zero2.");
ABSL_FLAG(int, shard_group_size, 0,
          "With hybrid_shard or _hybrid_shard_zero2: ranks per shard group (it must divide "
          "the world size); 0: LOCAL_WORLD_SIZE, one node each.");
ABSL_FLAG(std::string, param_dtype, "",
          "Mixed precision: compute and all-gather parameters in this dtype (bfloat16, "
          "float16, float32); the optimizer still steps float32 shards. Empty: float32.");
ABSL_FLAG(std::string, reduce_dtype, "",
          "Mixed precision: reduce gradients in this dtype (default: --param_dtype).");
ABSL_FLAG(std::string, all_gather_quantization, "none",
          "How parameters travel in all-gathers: none (the compute dtype), bf16 or int8 "
          "(blockwise, about 0.26x float32's bytes); the shards and the optimizer step stay "
          "exact, only the gathered parameters forward and backward use are approximate. "
          "Not with no_shard.");
ABSL_FLAG(std::string, reduce_quantization, "none",
          "How gradients travel in the reductions: none (the reduction dtype, by "
          "reduce-scatter), bf16 or int8 (blockwise, about 0.26x float32's bytes) through an "
          "all-to-all, each rank summing its chunk in float32. Not with no_shard.");
ABSL_FLAG(std::string, backward_prefetch, "backward_pre",
          "none, backward_pre or backward_post.");
ABSL_FLAG(bool, forward_prefetch, false, "All-gather the next unit during forward.");
ABSL_FLAG(bool, offload_params, false,
          "CPU offload: shards, gradients and optimizer state in host memory; the optimizer "
          "steps on the host (a CPU run makes the copies and saves nothing).");
ABSL_FLAG(std::string, wrap_policy, "module:Block",
          "Which modules become FSDP units: a policy spec (policies/policy_spec.h), e.g. "
          "'module:Block', 'module:Block,strategy=shard_grad_op', 'none', or a plugin's "
          "policy such as 'fqn_glob:transformer.h.*'.");
ABSL_FLAG(std::string, policy_plugin, "",
          "Path of a wrap-policy plugin (a shared object, policies/policy_plugin.h) to load "
          "before building --wrap_policy.");
ABSL_FLAG(std::string, init_state_dict, "",
          "Start from this state dict: a torch.save file (e.g. torch.save(model.state_dict()) "
          "of a PyTorch GPT with nanoGPT's layout) or one written by --export_state_dict, or a "
          "PyTorch Distributed Checkpoint directory (torch.distributed.checkpoint.save, e.g. of "
          "an FSDP2 model's get_model_state_dict, at any world size), of which every rank reads "
          "only the chunks that hold its shards.");
ABSL_FLAG(std::vector<std::string>, init_state_dict_ignore, {},
          "Comma-separated globs (fnmatch) of --init_state_dict entries to drop when this model "
          "has no such entry, e.g. '*.attn.bias' for the causal-mask buffers that nanoGPT "
          "checkpoints from torch < 2 carry. An entry the model has is never dropped. (A "
          "Distributed Checkpoint's entries the model lacks are never read.)");
ABSL_FLAG(std::string, init_state_dict_key, "",
          "Take the state dict from this key of the file's top-level dict (nanoGPT's ckpt.pt: "
          "'model'); for a Distributed Checkpoint, the entries under 'KEY.' (a checkpoint of "
          "{'model': ..., 'optim': ...}: 'model').");
ABSL_FLAG(std::string, export_state_dict, "",
          "Write the final FULL state dict here (rank 0), readable by Python's torch.load.");
ABSL_FLAG(std::string, init_optim_state_dict, "",
          "Start the optimizer from this state: a torch.save file of a PyTorch optimizer's "
          "state_dict() (keyed by parameter index: its groups must be this job's, one over the "
          "GPT's parameters in the model's order, or nanoGPT's two with "
          "--weight_decay_groups=nanogpt) or of FSDP's FULL optim_state_dict or "
          "get_optimizer_state_dict(full_state_dict=True) (keyed by FQN), e.g. from "
          "--export_optim_state_dict; or a PyTorch Distributed Checkpoint directory holding "
          "an optimizer's state (e.g. an FSDP2 job's dcp.save of {'model': ..., 'optim': ...} "
          "from get_state_dict, at any world size). Hyper-parameters given on the command line "
          "replace the file's.");
ABSL_FLAG(std::string, init_optim_state_dict_key, "",
          "Take the optimizer state from this key of the file's top-level dict (e.g. "
          "'optimizer' of {'model': ..., 'optimizer': ...}; 'optim' of an FSDP2 job's "
          "Distributed Checkpoint).");
ABSL_FLAG(std::string, export_optim_state_dict, "",
          "Write the final FULL optimizer state here (rank 0), readable by Python's torch.load, "
          "keyed as --export_optim_state_dict_keys says.");
ABSL_FLAG(std::string, export_optim_state_dict_keys, "fqn",
          "fqn: FSDP's FULL optim_state_dict layout (for set_optimizer_state_dict or "
          "optim_state_dict_to_load); index: torch.optim.Optimizer.state_dict()'s (for "
          "load_state_dict of an unwrapped model's optimizer).");
ABSL_FLAG(std::string, export_dcp, "",
          "Write the final model and optimizer state here as a PyTorch Distributed Checkpoint "
          "(every rank writes its own shards), laid out as an FSDP2 job's dcp.save of "
          "{'model': ..., 'optim': ...}: dcp.load into get_state_dict's dicts reads it at any "
          "world size.");
ABSL_FLAG(std::string, checkpoint_dir, "",
          "Save SHARDED training checkpoints (model and optimizer state) here, one subdirectory "
          "step-NNNNNNNN per checkpoint, labelled with the run's id and settings "
          "(optim/run_checkpoints.h). A new run refuses a directory holding other checkpoints "
          "(see --resume and --overwrite_checkpoints), and a job refuses a directory another "
          "job is using (its lock, DIR/.lock, names the holder).");
ABSL_FLAG(std::string, checkpoint_format, "sharded",
          "How --checkpoint_dir's checkpoints are written: 'sharded' (this project's SHARDED "
          "format, with CRCs) or 'dcp' (PyTorch Distributed Checkpoints of {'model', 'optim', "
          "'train_state'}, which an FSDP2 job loads with dcp.load). --resume reads either, and "
          "a step-N directory an FSDP2 job wrote with dcp.save of {'model', 'optim'} too.");
ABSL_FLAG(bool, async_checkpoint, false,
          "Write --checkpoint_dir's checkpoints in the background: at the step boundary each rank "
          "copies its shards (model, optimizer, progress) to host memory, which costs one copy "
          "of them, and training goes on while a thread writes and commits them by the same "
          "all-or-nothing rules. A checkpoint due while the one before is still being written "
          "waits for it (the time lost is printed); a background write that fails stops the run "
          "at the first step boundary after every rank's write ended, the checkpoints already "
          "saved intact.");
ABSL_FLAG(int, checkpoint_every, 100, "Steps between checkpoints (with --checkpoint_dir).");
ABSL_FLAG(int, keep_checkpoints, 2,
          "How many of this run's newest checkpoints clean-up keeps; it never removes another "
          "run's.");
ABSL_FLAG(bool, resume, false,
          "Continue the run whose newest complete checkpoint is in --checkpoint_dir (any world "
          "size), with the settings its checkpoint records for every flag left out; a flag "
          "given with another value is used and reported, or refused when the checkpoint "
          "cannot continue under it (the optimizer, its groups, the model's shape).");
ABSL_FLAG(bool, overwrite_checkpoints, false,
          "A new run may use a --checkpoint_dir that holds another run's checkpoints: they are "
          "removed once this run's first checkpoint is saved.");
ABSL_FLAG(bool, overwrite_exports, false,
          "--export_state_dict, --export_optim_state_dict and --export_dcp may replace what is "
          "already at their paths (without it, a run whose export target holds a file or a "
          "non-empty directory is refused before it starts).");
ABSL_FLAG(std::string, on_nonfinite, "stop",
          "When the loss or the gradient norm of a step is not finite: 'stop' the job naming "
          "the step, or 'skip' the step's update (see --max_consecutive_skips).");
ABSL_FLAG(int, TEST_nan_loss_at_step, 0,
          "Testing aid for --on_nonfinite: the last rank's loss of this step is made NaN "
          "before backward (its gradients, hence every rank's, become NaN too); 0: never.");
ABSL_FLAG(int, check_replicas_every, 0,
          "Every this many steps, before every checkpoint and at the last step, the ranks "
          "that must hold identical bytes (replicas of a shard under hybrid_shard, every rank "
          "under no_shard, every rank's buffers) compare a hash of their parameters and "
          "optimizer state, and with --grad_clip every step the global gradient norm; a "
          "mismatch stops the job before that step's checkpoint, naming the step, the tensor "
          "and the ranks (checkpoint/replicas.h). 0: never.");
ABSL_FLAG(int, TEST_flip_bit_at_step, 0,
          "Testing aid for --check_replicas_every: after this step's update the last rank "
          "flips one bit of its first parameter's shard (with --TEST_flip_bit_in=optimizer, "
          "of one parameter's exp_avg or momentum buffer); 0: never.");
ABSL_FLAG(std::string, TEST_flip_bit_in, "parameter",
          "Where --TEST_flip_bit_at_step flips its bit: parameter or optimizer.");
ABSL_FLAG(int, max_consecutive_skips, 10,
          "With --on_nonfinite=skip: stop once more than this many steps in a row were "
          "skipped.");
ABSL_FLAG(std::string, record_batches, "",
          "Write every step's global batch of token ids here (rank 0, at the end), readable "
          "by torch.load: {'tokens': int64 [steps, world_size * batch_size, block_size + 1], "
          "'first_step': int64}; inputs are tokens[..., :-1], targets tokens[..., 1:].");
ABSL_FLAG(std::string, replay_batches, "",
          "Train on the batches a --record_batches file holds instead of sampling (any "
          "world size whose world_size * batch_size matches the recorded global batch).");
ABSL_FLAG(std::string, trace_dir, "",
          "Write each rank's FSDP trace (Chrome trace-event JSON, for Perfetto) to "
          "<trace_dir>/trace_rank<r>.json at the end: forward, backward, unshard, reshard, "
          "all-gather and reduce-scatter of every unit (fsdp/trace.h).");
ABSL_FLAG(bool, fsdp_debug_log, false,
          "Print every FSDP training-state transition to stderr, prefixed by the rank.");
ABSL_FLAG(bool, list_policies, false,
          "Print the registered wrap policies (after loading --policy_plugin) and exit.");
ABSL_FLAG(bool, print_plan, true, "Print the wrap plan (rank 0) before training.");
ABSL_FLAG(uint64_t, seed, 1234, "Model initialization and batch sampling.");
ABSL_FLAG(int, log_every, 25, "Print progress every this many steps.");
ABSL_FLAG(int, timeout_s, 600, "Whole-job timeout (launcher mode), restarts included.");
ABSL_FLAG(int, max_restarts, 0,
          "Launcher mode: when a rank fails, dies, or hangs past --collective_timeout_s, stop "
          "every rank and start the job again, resuming from the newest complete checkpoint "
          "in --checkpoint_dir (from step 1 without one); at most this many times. A failure "
          "at the same step with the same message in 3 attempts in a row is not retried. Under "
          "fsdp_launch or torchrun, give their --max_restarts instead: a restarted rank "
          "resumes the same way.");
ABSL_FLAG(double, restart_backoff_s, 1.0,
          "With --max_restarts: seconds before the first restart, doubled before each next "
          "(at most 60).");
ABSL_FLAG(int, TEST_kill_at_step, 0,
          "Testing aid for --max_restarts: in the job's first attempt only, the last rank "
          "kills itself (SIGKILL) as this step begins; 0: never.");
ABSL_FLAG(int, collective_timeout_s, 120,
          "Bound on every collective and on forming the groups: a rank that does not take part "
          "in time makes the others fail naming the collective, its unit and the ranks' "
          "fingerprints.");
ABSL_FLAG(bool, check_collective_headers, true,
          "Before every collective, check that every rank issues the same one (GlooOptions::"
          "check_collective_headers): a mismatch is an error naming both sides instead of a "
          "crash inside Gloo or silently mixed data; costs one small all-to-all each.");
ABSL_FLAG(std::string, device, "cpu",
          "Where each rank computes: cpu; cuda (rank r on GPU LOCAL_RANK % GPUs); or cuda:N "
          "(every rank on GPU N). The model is built on the host and its units moved there "
          "as they are sharded (FsdpOptions::device_id).");
ABSL_FLAG(std::string, collectives, "auto",
          "How ranks communicate: gloo (host tensors; --device=cpu), nccl (one GPU per rank; "
          "CUDA builds), staged (device tensors through host buffers over Gloo: ranks may "
          "share a GPU, comm/staged_collectives.h), or auto: gloo on the CPU, nccl when every "
          "rank of this host has a GPU of its own and this build has NCCL, else staged.");
ABSL_FLAG(std::string, shard_collectives, "flat",
          "How the sharded strategies' all-gathers and reduce-scatters cross hosts: flat (one "
          "group of every rank) or two_level (across hosts, then within each host of "
          "LOCAL_WORLD_SIZE ranks: the link between hosts carries each byte once, half a "
          "flat group's bytes at two hosts; comm/hierarchical_collectives.h). two_level: "
          "--collectives=gloo, full_shard or shard_grad_op.");
ABSL_FLAG(int, verify_collectives_every, 0,
          "Every this many steps, compare every rank's collective fingerprints through the "
          "store (FsdpOptions::verify_collectives_every); 0: never.");
