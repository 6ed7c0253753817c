"""prune_real's one pass (every variant carried through the layers together) against running the
variants one after another (each re-reading every layer's weights), in the same run.

    python scripts/bench_real.py [--model tiny|moonlight|both] [--tokens 512]
    python scripts/bench_real.py --align     # M-SMoE's neuron alignment of one layer only (`bench_alignment`)
    python scripts/bench_real.py --merges [--model moonlight]   # the pass with both merge methods added
    python scripts/bench_real.py --methods [--model moonlight]  # REAM's merge and MoNE's substitution, each beside the pass
    python scripts/bench_real.py --model moonlight-full [--old-ref REF]   # the article's streamed run (`bench_full`)

8 scores x 2 keeps = 16 pruned variants plus the unpruned model. "tiny" is the model
`python -m moejax.run experiment=train_tiny` saved (skipped if absent); "moonlight" is a synthetic
Moonlight-16B-A3B-shaped checkpoint of 4 decoder layers (1 dense + 3 MoE, 64 experts of 1408,
bfloat16 on disk; the vocabulary cut to 32,768 to keep the embedding small), written to a
temporary folder (MOEJAX_BENCH_DIR chooses the disk). Each measurement runs in a child process,
which runs its mode twice (cold: compilation included; warm: compiled, as the persistent
compilation cache makes a repeated run) and reports both times and its peak resident memory
(VmHWM). Target: carried >= 4x faster.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _timing import old_source  # noqa: E402

SCORES = ["frequency", "reap", "ean", "w_mean", "bias", "signed", "l1", "random"]
KEEPS = [0.5, 0.25]

CHILD = r"""
import json, sys, time
import numpy as np
from moejax.evaluation.carried import evaluate_pruning
from moejax.hf.model_io import open_checkpoint
from moejax.merging.method import parse
path, calib, held, mode, scores, keeps = sys.argv[1], np.load(sys.argv[2]), np.load(sys.argv[3]), sys.argv[4], json.loads(sys.argv[5]), json.loads(sys.argv[6])
def once():
    t0 = time.perf_counter()
    if mode == "carried":
        evaluate_pruning(open_checkpoint(path), calib, {"heldout": held}, scores, keeps, progress=False)
    elif mode == "carried_merges":  # the same pass with HC-SMoE and M-SMoE (tied and shrunk) beside the scores
        evaluate_pruning(open_checkpoint(path), calib, {"heldout": held}, scores, keeps,
                         merges=(parse("hc_smoe"), parse("m_smoe")), progress=False)
    elif mode == "carried_ream":  # with REAM (tied and shrunk; centroids by reap, C = 16)
        evaluate_pruning(open_checkpoint(path), calib, {"heldout": held}, scores, keeps, merges=(parse("ream"),),
                         progress=False)
    elif mode == "carried_mone":  # with MoNE: the mone score's selections substituted
        evaluate_pruning(open_checkpoint(path), calib, {"heldout": held}, scores, keeps, substitutes=("mone",),
                         progress=False)
    else:  # one variant at a time: every pass re-reads the weights, redoes calibration and the unpruned stream
        for s in scores:
            for k in keeps:
                evaluate_pruning(open_checkpoint(path), calib, {"heldout": held}, [s], [k], progress=False)
    return time.perf_counter() - t0
cold = once()   # compilation included
warm = once() if int(sys.argv[7]) > 1 else float("nan")  # compiled (a repeated run with the persistent cache)
hwm = int(open('/proc/self/status').read().split('VmHWM:')[1].split()[0])
print(json.dumps({"cold": cold, "warm": warm, "peak_mb": hwm / 1024}))
"""


def moonlight_checkpoint(path: Path, layers: int = 4, vocab: int = 32768) -> None:
    """A synthetic Moonlight-16B-A3B-shaped checkpoint: `layers` decoder layers (the first dense),
    bfloat16 on disk (router and balance bias float32), random weights."""
    import ml_dtypes

    from moejax.hf.io.checkpoint_writer import write_checkpoint
    from moejax.hf.mapping import tensor_specs
    from moejax.models.deepseek_v3 import DeepseekV3Config
    from moejax.models.deepseek_v3.presets import PRESETS

    raw = {**PRESETS["moonlight-16b-a3b"], "num_hidden_layers": layers, "vocab_size": vocab}
    cfg = DeepseekV3Config.from_dict(raw)
    specs = tensor_specs(cfg)
    rng = np.random.default_rng(0)

    def tensors():
        for s in specs:
            f32 = s.hf_name.endswith(("gate.weight", "e_score_correction_bias"))
            norm = "norm" in s.hf_name
            value = rng.standard_normal(s.hf_shape, dtype=np.float32) * (0.3 if norm else 0.02) + (1.0 if norm else 0.0)
            if s.hf_name.endswith("e_score_correction_bias"):
                value = rng.standard_normal(s.hf_shape, dtype=np.float32) * 0.1
            yield s.hf_name, value.astype(np.float32 if f32 else ml_dtypes.bfloat16)

    write_checkpoint(path, tensors(), cfg.to_dict())


def run_modes(path: Path, tokens: int, seq_len: int, workdir: Path, rounds: int, modes) -> dict:
    """{mode: the child's {"cold", "warm", "peak_mb"}} for each mode, in this order, on the same tokens."""
    import json as _json

    vocab = _json.loads((path / "config.json").read_text())["vocab_size"]
    rng = np.random.default_rng(1)
    np.save(workdir / "calib.npy", rng.integers(0, min(vocab, 256), size=(tokens // seq_len, seq_len)).astype(np.int32))
    np.save(workdir / "held.npy", rng.integers(0, min(vocab, 256), size=(max(1, tokens // (2 * seq_len)), seq_len)).astype(np.int32))
    results = {}
    for mode in modes:
        out = subprocess.run([sys.executable, "-c", CHILD, str(path), str(workdir / "calib.npy"), str(workdir / "held.npy"),
                              mode, json.dumps(SCORES), json.dumps(KEEPS), str(rounds)], check=True, capture_output=True, text=True,
                             env={**os.environ, "PYTHONPATH": str(ROOT), "MOEJAX_JAX_CACHE": ""})
        results[mode] = json.loads(out.stdout.strip().splitlines()[-1])
    return results


def measure_methods(path: Path, tokens: int, seq_len: int, workdir: Path, rounds: int) -> None:
    """What each method after REAP costs in the carried pass: the pruning-only pass against the same
    pass with REAM added (2 keeps x 2 router forms = 4 more held-out streams, REAM's statistics:
    router-weighted outputs of every expert on every token, a token sample; its grouping,
    activation-and-weight alignment and average) and with MoNE's substitution added (2 more
    streams; the routed outputs' sums on the host for the mone score and the novices)."""
    r = run_modes(path, tokens, seq_len, workdir, rounds, ("carried", "carried_ream", "carried_mone"))
    c = r["carried"]
    for when in ("cold", "warm")[:rounds]:
        head = f"  {when} ({'compilation included' if when == 'cold' else 'compiled'}): "
        print(f"{head}pruning only {c[when]:7.1f} s, with ream {r['carried_ream'][when]:7.1f} s "
              f"({r['carried_ream'][when] / c[when]:.2f}x), with mone substituted {r['carried_mone'][when]:7.1f} s "
              f"({r['carried_mone'][when] / c[when]:.2f}x)")
    print("  peak resident memory: " + ", ".join(f"{m} {v['peak_mb']:.0f} MB" for m, v in r.items()))


def measure(path: Path, tokens: int, seq_len: int, workdir: Path, rounds: int, merges: bool = False) -> None:
    """The carried pass against running the variants one after another (target: >= 4x faster), or
    with `merges` against the same pass with both merge methods added (2 methods x 2 keeps x 2
    router forms = 8 more held-out streams, plus each layer's merge statistics, clustering,
    alignment and averaging; target: <= 1.5x the time)."""
    other = "carried_merges" if merges else "one_after_another"
    r = run_modes(path, tokens, seq_len, workdir, rounds, ("carried", other))
    c, o = r["carried"], r[other]
    for when in ("cold", "warm")[:rounds]:
        head = f"  {when} ({'compilation included' if when == 'cold' else 'compiled'}): "
        if merges:
            print(f"{head}pruning only {c[when]:7.1f} s, with hc_smoe and m_smoe {o[when]:7.1f} s, "
                  f"ratio {o[when] / c[when]:.2f}x (target <= 1.5x)")
        else:
            print(f"{head}carried together {c[when]:7.1f} s, one after another {o[when]:7.1f} s, "
                  f"speed-up {o[when] / c[when]:.1f}x (target >= 4x)")
    print(f"  peak resident memory: carried {c['peak_mb']:.0f} MB, {other.replace('_', ' ')} {o['peak_mb']:.0f} MB")


FULL_CHILD = r"""
import json, os, sys, time
code = os.environ["MOEJAX_BENCH_CODE"]  # this code, not the checkout an editable install points at
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in getattr(f, "__module__", "")]
sys.path.insert(0, code)
import numpy as np
import moejax.evaluation.carried as ev
assert ev.__file__.startswith(code), (ev.__file__, code)
from moejax.hf.model_io import open_checkpoint
path, calib, held_a, held_b, out = sys.argv[1], np.load(sys.argv[2]), np.load(sys.argv[3]), np.load(sys.argv[4]), sys.argv[5]
import jax
layer_s, head_s = [], []
def timed(fn, into, streams_arg=None):
    def wrapped(*a, **k):  # (_layer_pass's third argument is the streams: wait for the layer's work)
        t0 = time.perf_counter(); r = fn(*a, **k)
        jax.block_until_ready(r if streams_arg is None else (a[streams_arg].held, a[streams_arg].cal))
        into.append(time.perf_counter() - t0); return r
    return wrapped
ev._layer_pass = timed(ev._layer_pass, layer_s, streams_arg=2)
ev._perplexity_rows = timed(ev._perplexity_rows, head_s)
t0 = time.perf_counter()
try:  # merge methods as registered objects (this code); older code takes their names
    from moejax.merging.method import parse
except ImportError:
    parse = str
names = json.loads(sys.argv[8])
merges = {"merges": tuple(parse(n) for n in names)} if names else {}  # old code may lack merges
rows, info = ev.evaluate_pruning(open_checkpoint(path), calib, {"a": held_a, "b": held_b}, json.loads(sys.argv[6]),
                                 json.loads(sys.argv[7]), progress=False, **merges)
total = time.perf_counter() - t0
hwm = int(open("/proc/self/status").read().split("VmHWM:")[1].split()[0]) / 1024
kept = {str(l): v for l, v in info["kept"].items()}
json.dump({"total": total, "layers": layer_s, "head": head_s[0], "peak_mb": hwm, "rows": rows, "kept": kept},
          open(out, "w"), default=lambda o: o.item() if hasattr(o, "item") else str(o))
"""

DENSE_CHILD = r"""
import json, time, numpy as np, jax, jax.numpy as jnp
rng = np.random.default_rng(0)
a = jnp.asarray(rng.standard_normal((4096, 2048), dtype=np.float32))
b = jnp.asarray(rng.standard_normal((2048, 1408), dtype=np.float32))
f = jax.jit(lambda a, b: jnp.matmul(a, b, precision=jax.lax.Precision.HIGHEST))
f(a, b).block_until_ready()
best = float("inf")
for _ in range(10):
    t0 = time.perf_counter(); f(a, b).block_until_ready(); best = min(best, time.perf_counter() - t0)
print(json.dumps({"gflops": 2 * 4096 * 2048 * 1408 / best / 1e9}))
"""


def layer_flops(cfg, seq_len: int, moe: bool) -> float:
    """FLOPs of one decoder layer per token (multiply-adds x 2) of a DeepSeek-V3-family config:
    MLA projections and attention over the whole sequence (as computed, masked), then the router,
    the K routed experts and the shared experts (MoE) or the dense MLP."""
    H, nh = cfg.hidden_size, cfg.num_attention_heads
    qk, v = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim
    q = H * cfg.q_lora_rank + cfg.q_lora_rank * nh * qk if cfg.q_lora_rank else H * nh * qk
    attn = q + H * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) + cfg.kv_lora_rank * nh * (cfg.qk_nope_head_dim + v) \
        + nh * v * H + nh * seq_len * (qk + v)
    if not moe:
        return 2.0 * (attn + 3 * H * cfg.intermediate_size)
    F = cfg.moe_intermediate_size
    return 2.0 * (attn + H * cfg.n_routed_experts + 3 * H * F * (cfg.num_experts_per_tok + cfg.n_shared_experts))


def pass_flops(cfg, seq_len: int, n_tokens: dict, n_streams: int, merges: tuple) -> dict:
    """The FLOPs the whole streamed pass must do, by part: every stream through every decoder layer
    (the calibration stream once, each held-out text once per variant), the output head of every
    held-out stream ([tokens, H] x [H, V]), and with merges each MoE layer's all-expert statistics
    (every expert on every calibration token, for the merges' similarities and frequencies) and
    M-SMoE's alignments (one [F, 3H] x [3H, F] similarity per expert aligned onto a leader, at each
    keep; an upper bound: a pair repeated across keeps is aligned once)."""
    H, F, E = cfg.hidden_size, cfg.moe_intermediate_size, cfg.n_routed_experts
    streams = n_streams * n_tokens["held"] + n_tokens["calib"]
    layers = sum(streams * layer_flops(cfg, seq_len, moe=cfg.is_moe_layer(l)) for l in range(cfg.num_hidden_layers))
    parts = {"layers": layers, "head": 2.0 * n_streams * n_tokens["held"] * H * cfg.vocab_size}
    if merges:
        moe_layers = len(cfg.moe_layers)
        parts["all-expert statistics"] = moe_layers * n_tokens["calib"] * E * 2.0 * 3 * H * F
        if "m_smoe" in merges:
            parts["alignment"] = moe_layers * sum(E - round(k * E) for k in KEEPS) * 2.0 * F * F * 3 * H
    return parts


def full_run(src, ckpt: Path, ids: dict, out: Path, merges: tuple) -> dict:
    """One child process running the code at `src` over the checkpoint and token files: its result."""
    subprocess.run([sys.executable, "-c", FULL_CHILD, str(ckpt), str(ids["calib"]), str(ids["a"]), str(ids["b"]),
                    str(out), json.dumps(SCORES), json.dumps(KEEPS), json.dumps(list(merges))], check=True,
                   env={**os.environ, "MOEJAX_BENCH_CODE": str(src), "MOEJAX_JAX_CACHE": ""})
    return json.loads(out.read_text())


def dense_rate() -> float:
    """The dense float32 matmul rate (GFLOP/s), measured in a child process (`DENSE_CHILD`)."""
    out = subprocess.run([sys.executable, "-c", DENSE_CHILD], check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])["gflops"]


def write_ids(tmp: Path, vocab: int, calib_seqs: int, held_seqs: int, seq_len: int) -> dict:
    """Random token ids for the pass, saved as .npy in `tmp`: {"calib", "a", "b"} -> path (one
    calibration text, two held-out texts), drawn from one seeded generator."""
    rng = np.random.default_rng(1)
    ids = {name: tmp / f"{name}.npy" for name in ("calib", "a", "b")}
    for name, n in (("calib", calib_seqs), ("a", held_seqs), ("b", held_seqs)):
        np.save(ids[name], rng.integers(0, vocab, size=(n, seq_len)).astype(np.int32))
    return ids


def bench_full(layer_counts=(3, 5), old_ref: str = "46d0ba0", old_layers=(3,), calib_seqs: int = 16,
               held_seqs: int = 8, seq_len: int = 128, merges: tuple = ()) -> None:
    """The seed article's headline run on a synthetic Moonlight-shaped checkpoint with the full
    163,840-token vocabulary (bfloat16 on disk): 8 scores x 2 keeps, 2,048 calibration tokens,
    two held-out texts of 1,024 tokens. The code at `old_ref` (the pass before the issue-19
    rewrite, extracted with `git archive`) and this checkout's, each in a child process, on the
    same tokens; the new code at every layer count in `layer_counts` (peak memory must not grow
    with depth), the old at `old_layers`. Reported: total time, time per MoE layer (every MoE
    layer after the first, whose time includes compilation), the output head, peak resident
    memory (VmHWM), the FLOPs a MoE layer must do (every held-out stream and the calibration
    stream through the layer; the layer-local errors not counted) against the dense float32
    matmul rate measured in the same run, and how far the new results are from the old. merges:
    the merge methods added to both runs (`--merges`: HC-SMoE and M-SMoE, the issue's 3 GB target)."""
    from moejax.models.deepseek_v3 import DeepseekV3Config
    from moejax.models.deepseek_v3.presets import PRESETS

    vocab = PRESETS["moonlight-16b-a3b"]["vocab_size"]
    with tempfile.TemporaryDirectory(dir=os.environ.get("MOEJAX_BENCH_DIR")) as tmp:
        tmp = Path(tmp)
        old_src = old_source(old_ref, tmp)
        ids = write_ids(tmp, vocab, calib_seqs, held_seqs, seq_len)
        dense = dense_rate()
        n_tokens = {"calib": calib_seqs * seq_len, "held": 2 * held_seqs * seq_len}
        print(f"the article's streamed run on a synthetic Moonlight-shaped checkpoint (vocabulary {vocab:,}, bfloat16): "
              f"{len(SCORES)} scores x {len(KEEPS)} keeps, {n_tokens['calib']} calibration and 2 x "
              f"{held_seqs * seq_len} held-out tokens; {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; "
              f"dense float32 matmul {dense:.0f} GFLOP/s")
        results, whole = {}, {}   # whole: the FLOPs each run's whole pass needs
        for layers in sorted(set(layer_counts) | set(old_layers)):
            ckpt = tmp / f"moonlight{layers}"
            t0 = time.perf_counter()
            moonlight_checkpoint(ckpt, layers, vocab)
            size = sum(f.stat().st_size for f in ckpt.iterdir())
            print(f"  {layers} decoder layers ({layers - 1} MoE), {size / 1e9:.1f} GB, written in "
                  f"{time.perf_counter() - t0:.0f} s")
            for code, src in (("old", old_src), ("new", ROOT)):
                if layers not in (old_layers if code == "old" else layer_counts):
                    continue
                r = results[code, layers] = full_run(src, ckpt, ids, tmp / f"{code}{layers}.json", merges)
                cfg = DeepseekV3Config.from_dict(json.loads((ckpt / "config.json").read_text()))
                n_streams = len(SCORES) * len(KEEPS) + 1 + len(merges) * len(KEEPS) * 2  # 2 router forms a merge
                flops = (n_streams * n_tokens["held"] + n_tokens["calib"]) * layer_flops(cfg, seq_len, moe=True)
                parts = pass_flops(cfg, seq_len, n_tokens, n_streams, merges)
                steady = r["layers"][2:] or r["layers"][1:]  # MoE layers after the first (dense layer 0 first)
                per_layer = sum(steady) / len(steady)
                print(f"    {code} code ({'this checkout' if code == 'new' else old_ref}): total {r['total']:7.1f} s, "
                      f"per MoE layer {per_layer:6.1f} s (layers: {', '.join(f'{t:.1f}' for t in r['layers'])}), "
                      f"output head {r['head']:6.1f} s, peak {r['peak_mb']:,.0f} MB; a MoE layer's "
                      f"{flops / 1e12:.2f} TFLOP at {flops / per_layer / 1e9:.0f} GFLOP/s = "
                      f"{flops / per_layer / 1e9 / dense:.0%} of dense")
                total = whole[code, layers] = sum(parts.values())
                print(f"      the whole pass needs {total / 1e12:.1f} TFLOP ("
                      + ", ".join(f"{k} {v / 1e12:.1f}" for k, v in parts.items()) + f"): {total / r['total'] / 1e9:.0f} "
                      f"GFLOP/s = {total / r['total'] / 1e9 / dense:.0%} of dense (target >= 50%)")
            if merges and layers == min(layer_counts):  # the same pass without merges: what both merges cost
                r = full_run(ROOT, ckpt, ids, tmp / f"pruning{layers}.json", ())
                with_merges = results["new", layers]["total"]
                print(f"    new code without merges: total {r['total']:7.1f} s, peak {r['peak_mb']:,.0f} MB; both merges "
                      f"cost {with_merges / r['total']:.2f}x the pruning-only pass (target <= 1.5x)")
        # the machine's limit is its best dense rate: measured again now the runs are done (the first
        # reading can catch the machine still busy), the whole pass against the higher of the two
        again = dense_rate()
        best = max(dense, again)
        print(f"  dense float32 matmul again at the end: {again:.0f} GFLOP/s (at the start {dense:.0f}); the whole "
              f"pass against the higher ({best:.0f}):")
        for (code, layers), r in sorted(results.items()):
            print(f"    {code} code, {layers} layers: {whole[code, layers] / r['total'] / 1e9 / best:.0%} of dense")
        for layers in old_layers:
            if ("new", layers) in results:
                compare_runs(results["old", layers], results["new", layers], layers)


def compare_runs(old: dict, new: dict, layers: int) -> None:
    """How far the new run's rows are from the old run's (the same keys), and whether they keep the
    same experts."""
    def keyed(rows):
        # rows of code from before moejax.variants name the form `mode` and the method `score`
        return {(r.get("form", r.get("mode")), r.get("method", r.get("score")), r.get("keep"), r.get("layer"),
                 r.get("text"), r["metric"]): r["value"] for r in rows}

    o, n = keyed(old["rows"]), keyed(new["rows"])
    worst = {}
    for key in o.keys() & n.keys():
        a, b = o[key], n[key]
        rel = abs(a - b) / max(abs(a), 1e-30) if a == a and b == b else (0.0 if (a != a) == (b != b) else float("inf"))
        worst[key[-1]] = max(worst.get(key[-1], 0.0), rel)
    same = old["kept"] == new["kept"]
    print(f"  {layers} layers, new against old: {len(o.keys() & n.keys())} of {len(o)} rows compared "
          f"({len(o.keys() ^ n.keys())} unmatched); kept sets {'identical' if same else 'DIFFER'}; largest relative "
          f"difference per metric: " + ", ".join(f"{m} {v:.1e}" for m, v in sorted(worst.items())))


def bench_alignment(keeps=(32, 16), n_experts: int = 64, hidden: int = 2048, ffn: int = 1408) -> None:
    """M-SMoE's neuron alignment of one Moonlight-shaped layer (64 experts, gate/up [H, F] and down
    [F, H] with H=2048, F=1408, random bfloat16 weights) at every keep of `keeps`, as the carried
    pass runs it: M-SMoE's groups (`m_smoe_groups_from_gram`) and leaders from router logits of a
    few latent directions (so that experts have neighbours, as trained routers do) and their counts.
    `align_layer` with one memo shared by the keeps (a (leader, member) pair aligned at one keep is
    not aligned again) against the same without it (each keep on its own: the code before), in the
    same run; the permutations must agree. Wall and CPU seconds (all threads). Target: every keep
    together < 10 s."""
    import ml_dtypes

    from moejax.merging.average import align_layer
    from moejax.merging.clusters import cluster_leaders, m_smoe_groups_from_gram

    def timed(fn):
        t0, c0 = time.perf_counter(), time.process_time()
        out = fn()
        return out, time.perf_counter() - t0, time.process_time() - c0

    t0 = time.perf_counter()
    rng = np.random.default_rng(0)
    shapes = {"gate": (hidden, ffn), "up": (hidden, ffn), "down": (ffn, hidden)}
    weights = {k: np.empty((n_experts, *shape), ml_dtypes.bfloat16) for k, shape in shapes.items()}
    for w in weights.values():
        for e in range(n_experts):
            w[e] = rng.standard_normal(w.shape[1:], dtype=np.float32) * 0.02
    logits = rng.standard_normal((2048, 8)) @ rng.standard_normal((8, n_experts)) + 0.3 * rng.standard_normal(
        (2048, n_experts))
    counts = np.bincount(np.argsort(-logits, axis=1)[:, :6].ravel(), minlength=n_experts)
    plans = []
    for keep in keeps:
        labels = m_smoe_groups_from_gram(logits.T @ logits, counts, keep)
        plans.append((keep, labels, cluster_leaders(labels, counts)))
    pairs = [{(int(lead[labels[j]]), j) for j in range(n_experts) if j != lead[labels[j]]} for _, labels, lead in plans]
    calls, unique = sum(len(p) for p in pairs), len(set().union(*pairs))
    print(f"M-SMoE neuron alignment, one layer of {n_experts} experts, H={hidden}, F={ffn}, random bfloat16, "
          f"keeps {list(keeps)} (made in {time.perf_counter() - t0:.0f} s; {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.1f}): {calls} alignments asked for, {unique} distinct "
          f"({1 - unique / calls:.0%} repeat across keeps)")
    each = [timed(lambda: align_layer(weights, labels, lead)) for _, labels, lead in plans]
    memo = {}
    shared = [timed(lambda: align_layer(weights, labels, lead, memo)) for _, labels, lead in plans]
    same = all(set(a[0]) == set(b[0]) and all(np.array_equal(a[0][j], b[0][j]) for j in a[0])
               for a, b in zip(each, shared))
    for keep, a, b in zip(keeps, each, shared):
        print(f"  keep={keep}: {len(a[0])} members; each keep alone {a[1]:5.1f} s (CPU {a[2]:5.1f} s); "
              f"with the shared memo {b[1]:5.1f} s (CPU {b[2]:5.1f} s)")
    before, after = sum(a[1] for a in each), sum(b[1] for b in shared)
    print(f"  every keep together: {before:.1f} s each keep alone, {after:.1f} s with the memo ({before / after:.2f}x; "
          f"target < 10 s); permutations identical: {same}")
    # the code before the bfloat16 similarities (and the path of a float32 checkpoint): float32
    # copies of the weights, numpy float32 similarities; same memo, same assignment threads
    f32 = {k: w.astype(np.float32) for k, w in weights.items()}
    memo32 = {}
    old = [timed(lambda: align_layer(f32, labels, lead, memo32)) for _, labels, lead in plans]
    del f32
    agree = sum(np.array_equal(memo[pair], memo32[pair]) for pair in memo)
    print(f"  with numpy float32 similarities (the code before; float32 checkpoints): {sum(o[1] for o in old):.1f} s "
          f"(CPU {sum(o[2] for o in old):.1f} s) against {after:.1f} s with XLA's bfloat16 ones; "
          f"{agree} of {len(memo)} permutations identical (the same products summed in another order)")
    sim = _align_similarity(weights, plans[0][2][0], int(np.flatnonzero(plans[0][1] == 0)[-1]))
    from moejax.merging.average import _assign
    lsa = min(timed(lambda: _assign(sim))[1] for _ in range(3))
    print(f"  one assignment ({ffn} x {ffn}, scipy): {lsa:.2f} s, so {unique * lsa:.1f} s of one core for the "
          f"{unique} distinct pairs")
    # the machine's limit: each distinct alignment's similarity is one [F, 3H] x [3H, F] product, at
    # numpy's float32 rate or XLA's bfloat16 one (AMX where the CPU has it), whichever is higher
    import jax

    from moejax.moe.neurons import layout_of
    from moejax.merging.bf16_align import bf16_neuron_block, bf16_similarity
    a = rng.standard_normal((ffn, 3 * hidden), dtype=np.float32)
    b = rng.standard_normal((ffn, 3 * hidden), dtype=np.float32)
    pair_flops = 2 * ffn * ffn * 3 * hidden
    rate32 = pair_flops / min(timed(lambda: a @ b.T)[1] for _ in range(5))
    blocks = [bf16_neuron_block({k: w[j] for k, w in weights.items()}, layout_of(weights)) for j in (0, 1)]
    rate16 = pair_flops / min(timed(lambda: jax.block_until_ready(bf16_similarity(*blocks)))[1] for _ in range(5))
    rate, flops = max(rate32, rate16), unique * pair_flops
    floor = (unique * lsa + 2 * flops / rate) / 2   # both cores busy: assignments on one each, products on both
    print(f"  the similarities need {flops / 1e12:.2f} TFLOP ({unique} x {pair_flops / 1e9:.1f} GFLOP): "
          f"{flops / rate:.1f} s at this run's best matmul rate of the shape (numpy float32 {rate32 / 1e9:.0f}, "
          f"XLA bfloat16 {rate16 / 1e9:.0f} GFLOP/s); with the assignments' {unique * lsa:.1f} s of one core, "
          f"the floor on {os.cpu_count()} cores is about {floor:.1f} s; the memo's pass took {after:.1f} s "
          f"({floor / after:.0%} of the floor's speed)")


def _align_similarity(weights: dict, lead: int, member: int) -> np.ndarray:
    """One alignment's similarity [F, F], float32 (numpy), for timing the assignment alone."""
    from moejax.merging.average import _similarity
    from moejax.moe.neurons import neuron_blocks

    def blocks(j):
        return neuron_blocks({k: w[j] for k, w in weights.items()}, np.float32)
    return _similarity(blocks(lead), blocks(member))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=["tiny", "moonlight", "both", "moonlight-full"], default="both")
    ap.add_argument("--old-ref", default="46d0ba0", help="moonlight-full: the code to compare against (a git ref)")
    ap.add_argument("--layers", type=int, nargs="+", default=[3, 5], help="moonlight-full: decoder layer counts (new code)")
    ap.add_argument("--old-layers", type=int, nargs="*", default=[3],
                    help="moonlight-full: layer counts for the old code (none: the new code only)")
    ap.add_argument("--tokens", type=int, default=512, help="calibration tokens (held-out: half)")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--align", action="store_true", help="time M-SMoE's neuron alignment of one layer only")
    ap.add_argument("--merges", action="store_true", help="the carried pass with both merge methods against without "
                    "(with --model moonlight-full: both runs with both merges)")
    ap.add_argument("--methods", action="store_true", help="the carried pass with REAM, and with MoNE, against without")
    args = ap.parse_args()

    def run(path, rounds):
        if args.methods:
            measure_methods(path, args.tokens, args.seq_len, tmp, rounds)
        else:
            measure(path, args.tokens, args.seq_len, tmp, rounds, merges=args.merges)

    if args.align:
        bench_alignment()
        return
    if args.model == "moonlight-full":
        bench_full(tuple(args.layers), args.old_ref, tuple(args.old_layers),
                   merges=("hc_smoe", "m_smoe") if args.merges else ())
        return
    print(f"{len(SCORES)} scores x {len(KEEPS)} keeps = {len(SCORES) * len(KEEPS)} variants + unpruned; "
          f"{args.tokens} calibration and {args.tokens // 2} held-out tokens")
    with tempfile.TemporaryDirectory(dir=os.environ.get("MOEJAX_BENCH_DIR")) as tmp:
        tmp = Path(tmp)
        if args.model in ("tiny", "both"):
            tiny = Path(os.environ.get("MOEJAX_HOME", Path.home() / ".cache" / "moejax")) / "models" / "tiny"
            if (tiny / "config.json").is_file():
                print(f"tiny model ({tiny}):")
                run(tiny, rounds=2)
            else:
                print(f"tiny model: not found at {tiny} (python -m moejax.run experiment=train_tiny); skipped")
        if args.model in ("moonlight", "both"):
            t0 = time.perf_counter()
            moonlight_checkpoint(tmp / "moonlight")
            size = sum(f.stat().st_size for f in (tmp / "moonlight").iterdir())
            print(f"synthetic Moonlight-shaped checkpoint, 4 layers, {size / 1e9:.1f} GB, written in "
                  f"{time.perf_counter() - t0:.0f} s:")
            run(tmp / "moonlight", rounds=1)  # compute-bound: cold only


if __name__ == "__main__":
    main()
