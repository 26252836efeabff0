# Where PyPI's torch lives: sourced by tools/install_deps.sh (which creates
# the venv), tools/torch_python and tools/test_torch2.sh;
# testing/torch_python.cc repeats the default path.
FSDP_TORCH_VERSION=2.15.0
FSDP_NUMPY_VERSION=2.4.6
FSDP_SAFETENSORS_VERSION=0.8.0
FSDP_TRANSFORMERS_VERSION=5.23.0
FSDP_PEFT_VERSION=0.21.2
FSDP_TORCH_VENV=${FSDP_TORCH_VENV:-$HOME/.cache/fsdp_cpp/torch-$FSDP_TORCH_VERSION-venv}
