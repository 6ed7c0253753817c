"""Training a small MoE model from scratch (what `experiment=train_tiny` runs, in
moejax.experiments.train_tiny): its typed settings (`config`), the byte-level corpus and its
batches (`corpus`), the loss, optimizer, compiled step and `Trainer` (`trainer`), orbax
checkpoints to resume from (`checkpoints`) and the progress line (`progress`).

Importing these modules does not import JAX (the runner validates settings and asks for CPU
devices before JAX starts); each function imports what it needs."""
