// The main job's flags (//models:train_gpt), for the files that make
// it up: definitions and help in train_gpt_flags.cc. A flag's value is read
// with absl::GetFlag(FLAGS_name); whether the user gave it, with
// train_gpt::Given("name") (models/train_gpt_checks.h).
#ifndef FSDP_MODELS_TRAIN_GPT_FLAGS_H_
#define FSDP_MODELS_TRAIN_GPT_FLAGS_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/flags/declare.h"

ABSL_DECLARE_FLAG(int, world_size);
ABSL_DECLARE_FLAG(int, steps);
ABSL_DECLARE_FLAG(int, batch_size);
ABSL_DECLARE_FLAG(int, block_size);
ABSL_DECLARE_FLAG(int, n_layer);
ABSL_DECLARE_FLAG(int, n_head);
ABSL_DECLARE_FLAG(int, n_embd);
ABSL_DECLARE_FLAG(double, dropout);
ABSL_DECLARE_FLAG(bool, activation_checkpointing);
ABSL_DECLARE_FLAG(std::string, hf_model);
ABSL_DECLARE_FLAG(std::string, export_hf);
ABSL_DECLARE_FLAG(int, lora_r);
ABSL_DECLARE_FLAG(double, lora_alpha);
ABSL_DECLARE_FLAG(double, lora_dropout);
ABSL_DECLARE_FLAG(std::vector<std::string>, lora_targets);
ABSL_DECLARE_FLAG(std::string, init_peft);
ABSL_DECLARE_FLAG(std::string, export_peft);
ABSL_DECLARE_FLAG(std::string, data);
ABSL_DECLARE_FLAG(std::string, data_tokens);
ABSL_DECLARE_FLAG(std::string, data_tokens_dtype);
ABSL_DECLARE_FLAG(int, eval_every);
ABSL_DECLARE_FLAG(int, eval_batches);
ABSL_DECLARE_FLAG(int, sample_tokens);
ABSL_DECLARE_FLAG(std::string, optimizer);
ABSL_DECLARE_FLAG(std::string, optimizer_kernel);
ABSL_DECLARE_FLAG(std::optional<double>, lr);
ABSL_DECLARE_FLAG(std::optional<double>, weight_decay);
ABSL_DECLARE_FLAG(std::optional<double>, beta1);
ABSL_DECLARE_FLAG(std::optional<double>, beta2);
ABSL_DECLARE_FLAG(std::optional<double>, eps);
ABSL_DECLARE_FLAG(std::string, weight_decay_groups);
ABSL_DECLARE_FLAG(double, grad_clip);
ABSL_DECLARE_FLAG(std::string, metrics_jsonl);
ABSL_DECLARE_FLAG(std::string, sharding_strategy);
ABSL_DECLARE_FLAG(int, shard_group_size);
ABSL_DECLARE_FLAG(std::string, param_dtype);
ABSL_DECLARE_FLAG(std::string, reduce_dtype);
ABSL_DECLARE_FLAG(std::string, backward_prefetch);
ABSL_DECLARE_FLAG(bool, forward_prefetch);
ABSL_DECLARE_FLAG(bool, offload_params);
ABSL_DECLARE_FLAG(std::string, wrap_policy);
ABSL_DECLARE_FLAG(std::string, policy_plugin);
ABSL_DECLARE_FLAG(std::string, init_state_dict);
ABSL_DECLARE_FLAG(std::vector<std::string>, init_state_dict_ignore);
ABSL_DECLARE_FLAG(std::string, init_state_dict_key);
ABSL_DECLARE_FLAG(std::string, export_state_dict);
ABSL_DECLARE_FLAG(std::string, init_optim_state_dict);
ABSL_DECLARE_FLAG(std::string, init_optim_state_dict_key);
ABSL_DECLARE_FLAG(std::string, export_optim_state_dict);
ABSL_DECLARE_FLAG(std::string, export_optim_state_dict_keys);
ABSL_DECLARE_FLAG(std::string, export_dcp);
ABSL_DECLARE_FLAG(std::string, checkpoint_dir);
ABSL_DECLARE_FLAG(std::string, checkpoint_format);
ABSL_DECLARE_FLAG(bool, async_checkpoint);
ABSL_DECLARE_FLAG(int, checkpoint_every);
ABSL_DECLARE_FLAG(int, keep_checkpoints);
ABSL_DECLARE_FLAG(bool, resume);
ABSL_DECLARE_FLAG(bool, overwrite_checkpoints);
ABSL_DECLARE_FLAG(bool, overwrite_exports);
ABSL_DECLARE_FLAG(std::string, on_nonfinite);
ABSL_DECLARE_FLAG(int, TEST_nan_loss_at_step);
ABSL_DECLARE_FLAG(int, check_replicas_every);
ABSL_DECLARE_FLAG(int, TEST_flip_bit_at_step);
ABSL_DECLARE_FLAG(std::string, TEST_flip_bit_in);
ABSL_DECLARE_FLAG(int, max_consecutive_skips);
ABSL_DECLARE_FLAG(std::string, record_batches);
ABSL_DECLARE_FLAG(std::string, replay_batches);
ABSL_DECLARE_FLAG(std::string, trace_dir);
ABSL_DECLARE_FLAG(bool, fsdp_debug_log);
ABSL_DECLARE_FLAG(bool, list_policies);
ABSL_DECLARE_FLAG(bool, print_plan);
ABSL_DECLARE_FLAG(uint64_t, seed);
ABSL_DECLARE_FLAG(int, log_every);
ABSL_DECLARE_FLAG(int, timeout_s);
ABSL_DECLARE_FLAG(int, max_restarts);
ABSL_DECLARE_FLAG(double, restart_backoff_s);
ABSL_DECLARE_FLAG(int, TEST_kill_at_step);
ABSL_DECLARE_FLAG(int, collective_timeout_s);
ABSL_DECLARE_FLAG(bool, check_collective_headers);
ABSL_DECLARE_FLAG(std::string, device);
ABSL_DECLARE_FLAG(std::string, collectives);
ABSL_DECLARE_FLAG(int, verify_collectives_every);

#endif  // FSDP_MODELS_TRAIN_GPT_FLAGS_H_
