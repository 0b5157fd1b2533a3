"""Conversion between Hugging Face checkpoints (config.json + safetensors) and maxtext parameters."""
