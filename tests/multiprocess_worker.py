"""One process of tests/test_multiprocess.py: join the job (moejax.parallel.distributed), run every
check on the 8-way expert mesh spanning the job's devices, and write what this process got.

    python tests/multiprocess_worker.py CKPT TOKENS OUT [--coordinator 127.0.0.1:PORT --processes 2 --process-id I]

Without --coordinator it joins the job from the environment an `srun` task gets (SLURM_NTASKS,
SLURM_PROCID, ...), as a job of the slurm_multinode launcher preset does; without that either, it
is one process (the reference: one process with all 8 devices). Each process writes
OUT/process{I}.npz (the arrays) and OUT/process{I}.json (which experts it read, its devices,
timings). Every process gets the whole result: outputs spanning other processes' devices are
gathered (moejax.parallel.distributed.to_host).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import resource
import sys
import time
from pathlib import Path

# toy3, small: one condition (no balancing loop to compile), the routed experts on the "ep" backend
TOY3 = dict(seeds=1, n_calib=256, n_heldout=256, keep=(8, 16), offsets=("ones",), loads=("skewed",), merges=(),
            eq6_pairs=0, backend="ep", mesh_expert=8)


def checks(ckpt, tokens) -> tuple[dict, dict]:
    """(arrays, facts): the checkpoint loaded split over 8 expert shards (and which routed experts'
    tensors this process read), its logits on a padded batch, the streamed scoring pass and toy3."""
    import jax
    import numpy as np

    from hf_fixtures import batch
    from moejax import from_pretrained
    from moejax.experiments import toy3
    from moejax.hf import model_io
    from moejax.parallel import MeshConfig, make_mesh
    from moejax.scoring.score_checkpoint import score_checkpoint

    timings, t0, c0 = {}, time.perf_counter(), time.process_time()

    def lap(name):  # seconds of wall and of CPU (all threads) per stage
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        timings[name] = (round(wall - sum(w for w, _ in timings.values()), 2),
                         round(cpu - sum(c for _, c in timings.values()), 2))

    reads, real_read = [], model_io.OpenCheckpoint.read_param_tensor

    def read(self, spec, dtype):
        reads.append(spec)
        return real_read(self, spec, dtype)

    model_io.OpenCheckpoint.read_param_tensor = read
    try:
        mesh = make_mesh(MeshConfig(expert=8))
        model = from_pretrained(ckpt, mesh=mesh)
    finally:
        model_io.OpenCheckpoint.read_param_tensor = real_read
    gate = model.model.layers[0].mlp.experts_gate[...]
    lap("load_s")
    ids, mask = batch(model.config.vocab_size, seed=9)
    with jax.set_mesh(mesh):
        logits = np.asarray(model.jitted()(ids, mask).logits_BSV)  # replicated: every process has it
    lap("forward_s")
    scores = score_checkpoint(ckpt, tokens=tokens, batch_size=2, mesh=MeshConfig(expert=8))
    lap("score_s")
    df, _ = toy3.run(toy3.Toy3Config(**TOY3))
    lap("toy3_s")
    arrays = {"logits": logits, "score_value": scores.value.to_numpy(),
              "score_key": scores[["layer", "expert"]].to_numpy(), "score_name": scores.score.to_numpy().astype(str),
              "toy3_value": df.value.to_numpy(), "toy3_metric": df.metric.to_numpy().astype(str),
              "toy3_score": df.score.to_numpy().astype(str), "toy3_keep": df.keep.fillna(-1).to_numpy(np.int64)}
    facts = {"process_index": jax.process_index(), "process_count": jax.process_count(),
             "devices": jax.device_count(), "local_devices": jax.local_device_count(),
             "mesh_devices_local": [d.process_index == jax.process_index() for d in mesh.devices.flat],
             "read_experts": sorted({s.expert for s in reads if s.expert is not None}),
             "expert_tensor_reads": sum(s.expert is not None for s in reads),
             "local_gate_blocks": sorted(int(s.index[0].start or 0) for s in gate.addressable_shards),
             "timings": timings}
    return arrays, facts


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("ckpt")
    p.add_argument("tokens")
    p.add_argument("out")
    p.add_argument("--coordinator", help="host:port of process 0; none: one process")
    p.add_argument("--processes", type=int)
    p.add_argument("--process-id", type=int)
    a = p.parse_args(argv)
    t0 = time.perf_counter()
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # hf_fixtures
    from moejax.parallel.distributed import DistributedConfig, initialize

    # explicit, or (no --coordinator) from the environment srun gives a task, or one process
    cfg = DistributedConfig(a.coordinator, a.processes, a.process_id) if a.coordinator else DistributedConfig()
    index, _ = initialize(dataclasses.replace(cfg, initialization_timeout=60))
    import numpy as np

    arrays, facts = checks(a.ckpt, a.tokens)
    facts["total_s"] = round(time.perf_counter() - t0, 3)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    facts["cpu_s"] = round(usage.ru_utime + usage.ru_stime, 3)
    out = Path(a.out)
    np.savez(out / f"process{index}.npz", **arrays)
    (out / f"process{index}.json").write_text(json.dumps(facts))


if __name__ == "__main__":
    main()
