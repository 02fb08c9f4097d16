"""Hugging Face checkpoints: the key table, state dicts and safetensors folders."""
