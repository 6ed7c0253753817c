"""Hugging Face checkpoints: safetensors reading/writing, quantisation formats, the name mapping."""
