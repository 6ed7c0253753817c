"""Checkpoint surgery: pruned Hugging Face checkpoints written shard by shard (`prune`), and
published pruned checkpoints taken apart against their source (`diff`)."""
