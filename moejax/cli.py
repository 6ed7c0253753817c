"""The `moejax` command for checkpoint tools (experiments go through `python -m moejax.run`).

    moejax score CKPT (--text PATH... | --tokens FILE.npy) [--seq-len N] [--max-tokens N]
                 [--scores frequency,reap,...] [--batch-size B] [--dtype bfloat16]
                 [--mesh-expert 8] [--mesh-data 1] --out scores.parquet
    moejax score CKPT --scores bias,signed,l1[,random] [--seed S] --out scores.parquet   (data-free)
    moejax prune SRC DST (--score NAME | --scores-file scores.parquet --score NAME) --keep K
                 [--layers-keep FILE.json] [--allocation NAME [--allocation-setting K=V ...]] [--group-aware | --collapse-groups]
                 [--mtp prune|keep|drop] [--overwrite]
    moejax prune SRC DST --keep-map MAP [--keep-map-format FORMAT] [--expert-prune-ratio R] [--mtp ...]
                 (exactly a keep-map's kept sets; MAP made from SRC, or a foreign format that fits it)
    moejax prune SRC DST --substitute --score mone --keep K (--text PATH... | --tokens FILE.npy)
                 [--seq-len N] [--max-tokens N] [--batch-size B] [--dtype bfloat16] [--overwrite]
                 (MoNE: the other experts return constants; vLLM's constant-v1 expert substitution)
    moejax merge SRC DST --method hc_smoe|m_smoe|ream --keep K (--text PATH... | --tokens FILE.npy)
                 [--allocation NAME [--allocation-setting K=V ...]] [--hc-method average|kmeans] [--collapse-groups] [--mtp prune|keep|drop]
                 [--score reap] [--group-size C] [--ream-tokens N] [--seed S] [--sequential] [--overwrite]
                 (ream: --score, --group-size, --ream-tokens)
    moejax reroute SRC COMPRESSED DST (--text PATH... | --tokens FILE.npy) [--steps N] [--lr LR]
                 [--warmup N] [--final-lr-fraction F] [--weight-decay W] [--batch-size B] [--seq-len N]
                 [--max-tokens N] [--holdout 0.1] [--eval-every 10] [--teacher-cache DIR] [--mesh-expert 8]
                 [--mesh-data 1] [--overwrite]
                 (router distillation: COMPRESSED's routers trained to match SRC's next-token distribution)
    moejax keep-map SRC_OR_MAP --to moejax|riy|evoesap|ascend-jsonl|hipfire [--from FORMAT] [--out PATH]
                 [--checkpoint CKPT] [--expert-prune-ratio R] [--overwrite]
    moejax inspect CKPT [--json]
    moejax plan CKPT [--gpu NAME=GB ...] [--json]
    moejax diff SRC PRUNED [--hash] [--json]       (exit 1 when a check fails)
    moejax clean FOLDER...                          (stale staging folders of killed runs)

inspect, plan, diff and data-free score also read remote checkpoints (headers and router tensors by
range requests, nothing stored): CKPT = https://host/path/to/folder or hf://org/name[@revision].
prune, merge and calibrated score read every weight and take local folders only.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path

from moejax.errors import MoejaxError


# XLA hoists the float32 conversion of a bfloat16 expert stack out of the per-block loop of the
# grouped matmul, making a float32 copy of every expert of the layer (2.2 GB for Moonlight) at
# once. For the streamed scoring pass, whose point is a small memory peak, that hoisting is turned
# off; it must be set before JAX initialises its backend.
LOW_MEMORY_XLA_FLAGS = "--xla_disable_hlo_passes=while-loop-invariant-code-motion"


def _score(args) -> None:
    from moejax.hf.io.storage import require_local

    if args.text is None and args.tokens is None:
        return _score_data_free(args)
    require_local(args.checkpoint, "moejax score with calibration data")

    from moejax.parallel.mesh import MeshConfig, request_cpu_devices

    mesh = MeshConfig(data=args.mesh_data, expert=args.mesh_expert)
    if "jax" not in sys.modules:
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {LOW_MEMORY_XLA_FLAGS}".strip()
        request_cpu_devices(mesh.n_devices)
    from moejax.scoring.score_checkpoint import score_checkpoint

    scores = args.scores.split(",") if args.scores else None
    df = score_checkpoint(args.checkpoint, text=args.text, tokens=args.tokens, seq_len=args.seq_len,
                          max_tokens=args.max_tokens, scores=scores, batch_size=args.batch_size, out=args.out,
                          dtype=args.dtype, mesh=mesh, mtp=args.mtp)
    print(f"{df.layer.nunique()} MoE layers x {_experts(df)} x {df.score.nunique()} scores "
          f"-> {args.out} (+ {args.out.rsplit('.', 1)[0]}.json)")


def _experts(df) -> str:
    """'8 experts', or each layer's count when they differ (a checkpoint pruned per layer)."""
    counts = df.groupby("layer").expert.nunique().tolist()
    return f"{counts} experts" if len(set(counts)) > 1 else f"{counts[0] if counts else 0} experts"


def _score_data_free(args) -> None:
    """`moejax score CKPT --scores l1,signed,bias --out FILE` without calibration data: the
    data-free scores from the router tensors alone (CKPT may be remote)."""
    from moejax.errors import ConfigError
    from moejax.scoring.score_checkpoint import score_data_free

    if not args.scores:
        raise ConfigError("give calibration data (--text or --tokens), or --scores naming only data-free scores "
                          "(e.g. --scores bias,signed,l1) to score from the router weights alone")
    df = score_data_free(args.checkpoint, scores=args.scores.split(","), out=args.out, seed=args.seed)
    print(f"{df.layer.nunique()} MoE layers x {_experts(df)} x {df.score.nunique()} data-free scores "
          f"-> {args.out} (+ {args.out.rsplit('.', 1)[0]}.json)")


def parse_keep(text: str):
    """'8' -> 8 (a count), '0.25' -> 0.25 (a ratio of E)."""
    from moejax.errors import ConfigError

    if text.lstrip("+-").isdigit():
        return int(text)
    try:
        return float(text)
    except ValueError:
        raise ConfigError(f"--keep {text!r}: expected a count (8) or a ratio of E (0.25)") from None


def _read_layers_keep(path: str | None) -> dict | None:
    from moejax.errors import ConfigError

    if path is None:
        return None
    try:
        value = json.loads(open(path, encoding="utf-8").read())
    except (OSError, ValueError) as error:
        raise ConfigError(f"--layers-keep {path}: not a readable JSON file: {error}") from error
    if not isinstance(value, dict) or not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                              for v in value.values()):
        raise ConfigError(f"--layers-keep {path}: expected a JSON object of layer -> keep count, "
                          f'e.g. {{"1": 32, "2": 16}}, got {value!r:.200}')
    return value


def _prune(args) -> None:
    from moejax.errors import ConfigError
    from moejax.hf.io.staging import check_apart
    from moejax.hf.io.storage import require_local
    from moejax.surgery.prune import prune_checkpoint

    require_local(args.src, "moejax prune")
    if args.substitute:
        return _substitute(args)
    allocation = _allocation(args)
    if (args.text is not None or args.tokens is not None) and not allocation.searches:
        raise ConfigError("--text/--tokens are read by `moejax prune --substitute` and --allocation evo_esap only; to "
                          "prune by a calibration score, run `moejax score SRC --text ... --out scores.parquet` and "
                          "pass --scores-file")

    check_apart(args.dst, args.layers_keep, "DST")   # read before prune_checkpoint, which sees only its contents
    if args.keep_map is None and (args.keep_map_format or args.expert_prune_ratio is not None):
        raise ConfigError("--keep-map-format and --expert-prune-ratio describe a --keep-map; give one")
    record = prune_checkpoint(
        args.src, args.dst, score=args.score, keep=parse_keep(args.keep) if args.keep else None,
        scores_file=args.scores_file, layers_keep=_read_layers_keep(args.layers_keep), group_aware=args.group_aware,
        collapse_groups=args.collapse_groups, mtp=args.mtp, seed=args.seed, allocation=allocation,
        overwrite=args.overwrite, text=args.text, tokens=args.tokens, seq_len=args.seq_len, max_tokens=args.max_tokens,
        batch_size=args.batch_size, dtype=args.dtype, keep_map=args.keep_map, keep_map_format=args.keep_map_format,
        keep_map_settings={"expert_prune_ratio": args.expert_prune_ratio})
    counts = sorted({len(layer["kept"]) for layer in record["layers"].values()})
    how = f"the keep-map {args.keep_map}" if args.keep_map else args.score
    print(f"{args.dst}: {len(record['layers'])} MoE layers pruned by {how} to {counts} experts "
          f"(groups: {record['groups']}); kept indices in {args.dst}/pruning.json and keep_map.json")
    for note in record["notes"]:
        print(f"note: {note}")


def _substitute(args) -> None:
    """`moejax prune --substitute`: MoNE (moejax.surgery.substitute)."""
    from moejax.errors import ConfigError
    from moejax.surgery.substitute import substitute_checkpoint

    unused = [flag for flag, given in (("--scores-file", args.scores_file), ("--layers-keep", args.layers_keep),
                                       ("--keep-map", args.keep_map),
                                       ("--group-aware", args.group_aware), ("--collapse-groups", args.collapse_groups),
                                       (f"--allocation {args.allocation}", args.allocation != "uniform")) if given]
    if unused:
        raise ConfigError(f"--substitute takes no {', '.join(unused)}: it keeps every router slot (routing and groups "
                          "unchanged), ranks by its own calibration pass and keeps --keep experts computing per layer")
    if args.score is None:
        raise ConfigError("--substitute needs --score (the calibration score ranking the experts, e.g. mone)")
    if args.text is None and args.tokens is None:
        raise ConfigError("--substitute needs calibration data (--text or --tokens): the novices' constants are the "
                          "substituted experts' mean outputs over it")
    record = substitute_checkpoint(
        args.src, args.dst, score=args.score, keep=parse_keep(args.keep) if args.keep else None, text=args.text,
        tokens=args.tokens, seq_len=args.seq_len, max_tokens=args.max_tokens, batch_size=args.batch_size,
        dtype=args.dtype, mtp=args.mtp, overwrite=args.overwrite)
    n_sub = sorted({len(layer["substituted"]) for layer in record["layers"].values()})
    print(f"{args.dst}: {len(record['layers'])} MoE layers, {n_sub} experts per layer substituted by constants "
          f"({record['format']}, ranked by {args.score}); kept and substituted experts in {args.dst}/pruning.json")
    for note in record["notes"]:
        print(f"note: {note}")


# `moejax merge`'s flags for a merge method's settings (`moejax.merging.method`): flag -> setting
MERGE_SETTING_FLAGS = {"--hc-method": "clustering", "--score": "score", "--group-size": "group_size",
                       "--ream-tokens": "tokens"}


def merge_method(args):
    """The merge method object `--method` names, with the settings its flags give (the others at the
    method's defaults); a flag of a setting the method does not have is refused, naming it."""
    from moejax.errors import ConfigError
    from moejax.merging.method import MERGE_METHODS, parse

    given = {flag: getattr(args, flag[2:].replace("-", "_")) for flag in MERGE_SETTING_FLAGS}
    given = {flag: value for flag, value in given.items() if value is not None}
    own = MERGE_METHODS.defaults()[args.method]
    foreign = [flag for flag in given if MERGE_SETTING_FLAGS[flag] not in own]
    if foreign:
        owners = {flag: [m for m, d in MERGE_METHODS.defaults().items() if MERGE_SETTING_FLAGS[flag] in d]
                  for flag in foreign}
        raise ConfigError(f"{', '.join(foreign)}: not a setting of --method {args.method} (its settings: "
                          f"{sorted(own) or 'none'}); " + "; ".join(f"{flag} is {', '.join(m)}'s" for flag, m in owners.items()))
    return parse(args.method, **{MERGE_SETTING_FLAGS[flag]: value for flag, value in given.items()})


def _merge(args) -> None:
    from moejax.hf.io.storage import require_local
    from moejax.surgery.merge import merge_checkpoint

    require_local(args.src, "moejax merge")
    record = merge_checkpoint(
        args.src, args.dst, method=merge_method(args), keep=parse_keep(args.keep), text=args.text,
        tokens=args.tokens, seq_len=args.seq_len, max_tokens=args.max_tokens, batch_size=args.batch_size,
        allocation=_allocation(args), collapse_groups=args.collapse_groups, mtp=args.mtp, dtype=args.dtype,
        seed=args.seed, overwrite=args.overwrite, sequential=args.sequential)
    counts = sorted({len(layer["kept"]) for layer in record["layers"].values()})
    print(f"{args.dst}: {len(record['layers'])} MoE layers merged by {args.method}"
          f"{' sequentially' if args.sequential else ''} into {counts} experts "
          f"({args.allocation} allocation, router shrunk, groups: {record['groups']}); clusters in "
          f"{args.dst}/pruning.json")
    for note in record["notes"]:
        print(f"note: {note}")


def _reroute(args) -> None:
    from moejax.hf.io.storage import require_local
    from moejax.parallel.mesh import MeshConfig, request_cpu_devices

    for path in (args.src, args.compressed):
        require_local(path, "moejax reroute")
    mesh = MeshConfig(data=args.mesh_data, expert=args.mesh_expert)
    if "jax" not in sys.modules:
        request_cpu_devices(mesh.n_devices)
    from moejax.surgery.reroute import reroute_checkpoint

    from moejax.training.reroute_settings import RerouteSettings

    given = {name: getattr(args, name) for name in ("steps", "lr", "warmup", "final_lr_fraction", "weight_decay",
                                                    "batch_size", "holdout", "eval_every")}
    settings = RerouteSettings(**{name: value for name, value in given.items() if value is not None})
    record = reroute_checkpoint(
        args.src, args.compressed, args.dst, settings=settings, text=args.text, tokens=args.tokens,
        seq_len=args.seq_len, max_tokens=args.max_tokens, teacher_cache=args.teacher_cache, overwrite=args.overwrite,
        mesh=mesh)
    losses, kept = record["losses"], dict(record["heldout"])
    for key in ("kl_before", "kl_after"):
        kept[key] = format(kept[key], ".3g") if isinstance(kept[key], float) else kept[key]
    print(f"{args.dst}: {len(record['trained'])} routers distilled from {args.src} in {len(losses)} steps "
          f"(training KL {losses[0]:.5f} -> {losses[-1]:.5f}, {record['train_seconds']:.1f} s; {kept['selection']} KL "
          f"{kept['kl_before']} -> {kept['kl_after']}, routers of step {kept['kept_step']} kept"
          f"{', stopped: ' + kept['stopped'] if kept['stopped'] else ''}); record in {args.dst}/reroute.json")


def _calibration_arguments(p, required: bool = True, dtype: bool = True, batch_size: int | None = 8) -> None:
    data = p.add_mutually_exclusive_group(required=required)
    data.add_argument("--text", nargs="+", help="text files, folders or globs")
    data.add_argument("--tokens", help="pre-tokenised ids, a .npy int array [n_seq, seq_len]")
    p.add_argument("--seq-len", type=int, default=None,
                   help="tokens per sequence (default 512, or max_position_embeddings if shorter)")
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument("--batch-size", "--batch", type=int, default=batch_size,
                   help="sequences per batch (reroute: per training step)")
    if dtype:
        p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                       help="compute dtype (bfloat16 halves a layer's memory)")


def _diff(args) -> None:
    from moejax.surgery.diff import diff_checkpoints, failed_checks, format_diff

    report = diff_checkpoints(args.src, args.pruned, hash_tensors=args.hash)
    print(json.dumps(report, indent=2) if args.json else format_diff(report))
    failed = failed_checks(report)
    if failed:
        print(f"moejax diff: checks failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moejax", description="moejax checkpoint tools")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (_score_parser, _prune_parser, _merge_parser, _reroute_parser, _keep_map_parser, _other_parser):
        add(sub)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return run_command(f"moejax {args.command}", lambda: args.func(args))


def _score_parser(sub) -> None:
    """`moejax score`."""
    p = sub.add_parser("score", help="every expert score of every MoE layer from one calibration pass "
                       "(or, without --text/--tokens, the data-free --scores of a local or remote checkpoint)")
    p.add_argument("checkpoint", help="a local folder; for data-free scores also an https:// base URL or "
                   "hf://org/name[@revision]")
    _calibration_arguments(p, required=False)
    _mtp_argument(p)
    p.add_argument("--scores", default=None, help="comma-separated; default: every score the model supports (all "
                   "fourteen; without `bias` for routers with no balance bias); without calibration data: data-free "
                   "scores only (bias, signed, l1, random from the routers; aimer from the experts' weights)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random score (data-free scoring)")
    p.add_argument("--mesh-expert", type=int, default=1, help="devices the routed experts are split over")
    p.add_argument("--mesh-data", type=int, default=1, help="data-parallel devices (tokens split)")
    p.add_argument("--out", required=True, help="scores.parquet")
    p.set_defaults(func=_score)


def _prune_parser(sub) -> None:
    """`moejax prune` (and `--substitute`)."""
    p = sub.add_parser("prune", help="write a pruned HF checkpoint, streamed shard by shard")
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--score", help="data-free (bias, signed, l1, random, aimer) or a score in --scores-file "
                   "(required unless --keep-map)")
    p.add_argument("--scores-file", help="scores.parquet from `moejax score`")
    p.add_argument("--keep", help="experts kept per MoE layer: a count (32) or a ratio of E (0.5)")
    p.add_argument("--layers-keep", help="JSON file of layer -> keep count, overriding --keep per layer")
    _keep_map_arguments(p)
    groups = p.add_mutually_exclusive_group()
    groups.add_argument("--group-aware", action="store_true", help="keep an equal number per routing group")
    groups.add_argument("--collapse-groups", action="store_true",
                        help="allow uneven groups by routing over all kept experts (n_group=1)")
    _allocation_arguments(p)
    _mtp_argument(p)
    p.add_argument("--seed", type=int, default=0, help="seed of the random score")
    p.add_argument("--overwrite", action="store_true", help="replace an existing DST")
    p.add_argument("--substitute", action="store_true",
                   help="MoNE: keep every router slot and replace each expert not kept by a constant, its mean "
                   "output on the calibration data (--text/--tokens; --score a calibration score, e.g. mone); "
                   "written as vLLM's constant-v1 expert substitution")
    _calibration_arguments(p, required=False)
    p.set_defaults(func=_prune)


def _allocation_arguments(p) -> None:
    """--allocation (the registry's names) and its settings, --allocation-setting KEY=VALUE."""
    from moejax.allocation import ALLOCATIONS

    p.add_argument("--allocation", default="uniform", choices=ALLOCATIONS.names(),
                   help="per-layer counts under one total: uniform (keep in every layer), global (one threshold over "
                        "the layers' normalised scores; a merge's: frequency), shape (SHAPE's coverage of the Shapley "
                        "values), evo_esap (EvoESAP's search with ESAP fitness)")
    p.add_argument("--allocation-setting", action="append", default=[], metavar="KEY=VALUE",
                   help="a setting of the allocation (repeatable), e.g. population=16; its settings and defaults: "
                        + "; ".join(f"{n}: {d or 'none'}" for n, d in ALLOCATIONS.defaults().items()))


def _allocation(args):
    """The allocation object --allocation names, with its --allocation-setting values (JSON values,
    else text); a setting it does not have is refused, naming it."""
    from moejax.allocation import ALLOCATIONS
    from moejax.errors import ConfigError

    settings = {}
    for item in args.allocation_setting:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--allocation-setting {item!r}: expected KEY=VALUE, e.g. population=16")
        try:
            settings[key] = json.loads(text)
        except ValueError:
            settings[key] = text
    return ALLOCATIONS.parse(args.allocation, **settings)


def _mtp_argument(p) -> None:
    """--mtp, the one MTP policy of score, prune, merge and --substitute (`moejax.hf.mtp_names`)."""
    from moejax.hf.mtp_names import MTP_DEFAULT, MTP_POLICIES

    p.add_argument("--mtp", default=MTP_DEFAULT, choices=MTP_POLICIES,
                   help="MTP layers: prune (default: with the trunk's keep, by their own scores; config.json's one "
                        "expert count then holds for them), keep (full width), drop (removed)")


def _default(setting: str) -> str:
    """"default X" of a merge method's setting, as the registry declares it (for the help text)."""
    from moejax.merging.method import MERGE_METHODS

    return "; ".join(f"{name}'s default {d[setting]}" for name, d in MERGE_METHODS.defaults().items() if setting in d)


def _merge_parser(sub) -> None:
    """`moejax merge`: the method's choices are the registry's names."""
    from moejax.merging.method import MERGE_METHODS

    p = sub.add_parser("merge", help="write a merged HF checkpoint (HC-SMoE, M-SMoE or REAM, one router row per cluster)")
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--method", required=True, choices=MERGE_METHODS.names())
    p.add_argument("--keep", required=True, help="clusters per MoE layer: a count (32) or a ratio of E (0.5)")
    _calibration_arguments(p)
    _allocation_arguments(p)
    p.add_argument("--hc-method", default=None,
                   help=f"hc_smoe: its clustering, average (average linkage: the paper's) or kmeans (its public "
                        f"scripts' fallback) ({_default('clustering')})")
    p.add_argument("--collapse-groups", action="store_true",
                   help="allow uneven routing groups by routing over all kept experts (n_group=1)")
    _mtp_argument(p)
    p.add_argument("--score", default=None,
                   help=f"ream: the score choosing centroids and weighting each group's average ({_default('score')})")
    p.add_argument("--group-size", type=int, default=None,
                   help=f"ream: C, the most experts a group holds, its centroid included ({_default('group_size')}; "
                        "0: M-SMoE's rule)")
    p.add_argument("--ream-tokens", type=int, default=None,
                   help=f"ream: calibration tokens sampled for the neuron alignment's activations "
                        f"({_default('tokens')})")
    p.add_argument("--sequential", action="store_true",
                   help="merge layer by layer, each on the calibration stream of the model merged up to the layer "
                        "before (REAM's sequential mode; uniform allocation)")
    p.add_argument("--seed", type=int, default=0, help="seed of k-means and of REAM's token sample and PCA (>= 0)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing DST")
    p.set_defaults(func=_merge)


def _reroute_parser(sub) -> None:
    """`moejax reroute`."""
    p = sub.add_parser("reroute", help="distil a compressed checkpoint's routers from its source (router distillation)")
    p.add_argument("src", help="the original checkpoint (the teacher)")
    p.add_argument("compressed", help="a checkpoint moejax pruned, merged or substituted from SRC (the student)")
    p.add_argument("dst")
    _calibration_arguments(p, dtype=False, batch_size=None)   # a float32 student; its batch: RerouteSettings
    # router distillation's settings: each None unless given, then `RerouteSettings`' default (its one declaration)
    p.add_argument("--steps", type=int, default=None, help="training steps")
    p.add_argument("--lr", type=float, default=None, help="peak learning rate (AdamW)")
    p.add_argument("--warmup", type=int, default=None, help="linear warmup steps")
    p.add_argument("--final-lr-fraction", type=float, default=None, help="the cosine ends at lr x this")
    p.add_argument("--weight-decay", type=float, default=None)
    p.add_argument("--holdout", type=float, default=None,
                   help="share of the calibration sequences held out: the routers returned are the best measured "
                        "on them, the input's included (never worse)")
    p.add_argument("--eval-every", type=int, default=None, help="steps between held-out measurements")
    p.add_argument("--teacher-cache", default=None,
                   help="folder keeping the teacher's log-probs between runs on the same data")
    p.add_argument("--mesh-expert", type=int, default=1, help="devices the routed experts are split over")
    p.add_argument("--mesh-data", type=int, default=1, help="data-parallel devices (tokens split)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing DST")
    p.set_defaults(func=_reroute)


def _keep_map_arguments(p, prefix: str = "--keep-map-format") -> None:
    """--keep-map (prune) and what reading a foreign keep-map needs; the formats are the table's names."""
    from moejax.hf.keep_map_formats import FORMATS

    if prefix == "--keep-map-format":
        p.add_argument("--keep-map", help="prune to exactly these kept sets: a keep_map.json, a checkpoint folder "
                       "holding one (both refused unless made from SRC), or a file/folder in a public format, "
                       "checked to fit SRC")
    p.add_argument(prefix, dest="keep_map_format" if prefix == "--keep-map-format" else "from_format",
                   choices=list(FORMATS), default=None, help="the keep-map's format (default: detected)")
    p.add_argument("--expert-prune-ratio", type=float, default=None,
                   help="ascend-jsonl: the expert_prune_ratio its lists are read with")


def _keep_map_command(args) -> None:
    """`moejax keep-map`: a keep-map in another format (stdout, or --out)."""
    from moejax.errors import ConfigError
    from moejax.hf.keep_map_formats import FORMATS, convert, read_for_checkpoint, write_converted

    keep_map, fmt = read_for_checkpoint(args.map, args.from_format, args.checkpoint,
                                        {"expert_prune_ratio": args.expert_prune_ratio})
    converted = convert(keep_map, args.to)
    for note in converted.notes:
        print(f"note: {note}", file=sys.stderr)
    if args.out is None:
        if FORMATS[args.to].folder:
            raise ConfigError(f"--to {args.to} writes a folder ({', '.join(converted.files)}); give --out DIR")
        sys.stdout.write(next(iter(converted.files.values())))
        return
    written = write_converted(converted, FORMATS[args.to], args.out, args.overwrite, inputs=(args.map, args.checkpoint))
    counts = sorted({len(e["kept"]) for e in keep_map["layers"].values()})
    print(f"{args.map} ({fmt}, {len(keep_map['layers'])} MoE layers keeping {counts} experts) -> "
          f"{', '.join(map(str, written))} ({args.to})", file=sys.stderr)


def _keep_map_parser(sub) -> None:
    """`moejax keep-map`: the formats are `moejax.hf.keep_map_formats.FORMATS`' names."""
    from moejax.hf.keep_map_formats import FORMATS

    p = sub.add_parser("keep-map", help="convert a keep-map (a compressed checkpoint's keep_map.json, or a public "
                       "format) to another format: " + ", ".join(FORMATS))
    p.add_argument("map", help="a keep_map.json, a checkpoint folder holding one, or a file/folder in a public format")
    p.add_argument("--to", required=True, choices=list(FORMATS), help="the format to write")
    _keep_map_arguments(p, "--from")
    p.add_argument("--out", default=None, help="the file (evoesap: the folder) to write; default: stdout")
    p.add_argument("--checkpoint", default=None,
                   help="the checkpoint the map was made for: each layer's expert count (riy, ascend-jsonl and "
                        "evoesap without its plan need them), and the map checked against it (its fingerprint, "
                        "counts and top_k)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    p.set_defaults(func=_keep_map_command)


def _other_parser(sub) -> None:
    """`moejax diff`, `inspect`, `plan` and `clean`."""
    p = sub.add_parser("diff", help="recover and audit a pruned checkpoint's selection against its source")
    p.add_argument("src", help="a local folder, an https:// base URL or hf://org/name[@revision]")
    p.add_argument("pruned", help="the same kinds of location")
    p.add_argument("--hash", action="store_true", help="also compare the bytes of every non-router tensor")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_diff)

    from moejax.surgery import inspect, plan

    inspect.register_cli(sub)
    plan.register_cli(sub)
    p = sub.add_parser("clean", help="remove staging folders left in FOLDER by a killed prune or save")
    p.add_argument("folder", nargs="+", help="folders that held the destination of the killed command")
    p.set_defaults(func=_clean)


def run_command(prog: str, command) -> int:
    """Run `command()` and turn every expected failure into one line on stderr and an exit status:
    2 for moejax's own errors (bad input, named), 1 for an OS error (disk full, read-only output:
    the path and the errno), 128 + signal number for SIGINT / SIGTERM. Staging folders are already
    gone by then (`staged_directory`). Anything else is a bug and keeps its traceback."""
    from moejax.signals import Killed

    try:
        status = command()
    except OSError as e:  # before MoejaxError: a WriteError (disk full, naming the output) is both
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 1
    except MoejaxError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C outside a write (inside one, KillSwitch raises Killed)
        print(f"{prog}: interrupted (SIGINT)", file=sys.stderr)
        return 128 + signal.SIGINT
    except Killed as e:
        print(f"{prog}: {e}; its staging folder was removed, nothing was written", file=sys.stderr)
        return 128 + e.signum
    return status if isinstance(status, int) else 0


def _clean(args) -> None:
    from moejax.hf.io.staging import remove_stale_staging

    for folder in args.folder:
        if not Path(folder).is_dir():
            raise MoejaxError(f"{folder}: not a folder")
        removed = remove_stale_staging(Path(folder))
        print(f"{folder}: removed {len(removed)} stale staging folder(s)" +
              "".join(f"\n  {path.name}" for path in removed))


if __name__ == "__main__":
    sys.exit(main())
