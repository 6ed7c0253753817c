"""Hugging Face checkpoints bound to moejax's models. Three jobs, one place each:

- `moejax.hf.io`       files and storage: the safetensors format, the sharded reader and writer, where
                       a checkpoint is read from (a folder, https://, hf://), atomic output folders
- `moejax.hf.quant`    quantised weight formats: `decode` (what the loader and the checks read),
                       `encode` (what the tests build quantised checkpoints with)
- here, the model binding: `mapping` (a config's HF-name table), `layout` (MoE layers from names
                       alone), `fused_experts` (transformers 5's fused expert tensors, per expert),
                       `check` (the one check every command runs first), `model_io` (the loader:
                       `load_pretrained`, `save_pretrained`; the model never imports it), `auto`
                       (`AutoModelForCausalLM`), `provenance` (which checkpoint a record was made
                       from), `substitution` (vLLM's constant-v1 expert substitution format),
                       `keep_map` (keep_map.json: the source experts a compressed checkpoint
                       holds) and `keep_map_formats` (its public formats, one table)

The commands that report on a checkpoint (`moejax inspect`, `plan`, `diff`) are in `moejax.surgery`.
"""
