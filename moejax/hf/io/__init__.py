"""Checkpoint files and storage, with no model in sight: `safetensors_format` (one file's header,
tensor by tensor), `checkpoint_reader` (a sharded folder read lazily), `checkpoint_writer`
(streaming, atomic), `storage` (the interface and a local folder), `remote` (https:// and hf:// by
range requests), `location` (a path or URL to its storage), `staging` (atomic output folders,
stale-staging cleanup). Imports neither JAX nor torch."""
