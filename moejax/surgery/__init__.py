"""The checkpoint commands, one module each: the surgeries that write a checkpoint shard by shard
(`prune`, with its plan in `prune_plan`; `merge`, `substitute`, `reroute`) and the reports that read
one (`inspect`: what it holds; `plan`: the accelerators it needs; `diff`: a pruned checkpoint taken
apart against its source)."""
