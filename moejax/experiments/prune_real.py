"""`python -m moejax.run experiment=prune_real model=tiny` (or `model.path=CKPT`): SPEC section 5.

One pass over the checkpoint (each layer's weights read once) gives every score of every MoE layer
from the calibration text, then each (score, keep) variant's layer-local errors and end-to-end
held-out perplexity, plus the analyses of SPEC section 3 (moejax.evaluation.carried). With
`prune.sequential=true` the greedy variant (score layer l+1 on the model pruned up to layer l) is
reported beside the one-shot one (column `form`). With `merges=[hc_smoe,m_smoe]` the merging
baselines (SPEC section 8) are evaluated in the same pass at the same keeps, each under both router
forms (`form` tied / shrunk, `method` the merge method), and with `prune.sequential_merges=true`
also sequentially (`form` sequential_tied / sequential_shrunk: layer l+1 merged on the model merged
up to layer l, REAM's sequential mode); their clusters go to `clusters.json`. With
`prune.reroute=true` every variant is also rerouted (its routers distilled from the unpruned model
on the calibration tokens, `moejax.training.reroute`): rows with `rerouted` True, its held-out
perplexity and the KL of the first and last pass (`rerouted_variants`).
Columns: method, form, keep (a `moejax.variants.VariantSpec`), layer, text, metric, value.

Data defaults: calibration = the Python standard library's own sources (sorted, skipping held-out
files); held-out = the files a `train_tiny` model never saw (its moejax_tiny.json) when the model
has that list, else a few fixed standard-library modules; plus the standard library's LICENSE.txt
as prose when present. Any text files can be named instead.
"""

from __future__ import annotations

import dataclasses
import dataclasses as dc
import json
import sysconfig
import time
from pathlib import Path

import numpy as np

from moejax.data import Tokenizer, pack, read_text, text_files
from moejax.errors import ConfigError
from moejax.experiments.settings import typed_settings
from moejax.settings_check import refuse_repeats
from moejax.allocation import ALLOCATIONS, UNIFORM, Allocation
from moejax.models.registry import read_config
from moejax.results import write_json_atomic
from moejax.scoring.scores import check_score_names, scores_for
from moejax.scoring.select import resolve_keep
from moejax.training.reroute_settings import RerouteSettings
from moejax.training.skills import CODE, calibration_documents, calibration_mix
from moejax.variants import is_rerouted

DEFAULT_HELDOUT = ("difflib.py", "textwrap.py", "fractions.py")  # when the model lists none of its own
TINY_RECORD = "moejax_tiny.json"


@dataclasses.dataclass(frozen=True)
class PruneRealConfig:
    path: str = ""
    keep: tuple = (0.5, 0.25)
    scores: tuple | None = None    # None: every score the model supports (moejax.scoring.scores.scores_for)
    merges: tuple = ()             # merging baselines beside the scores (moejax.merging.method.MergeMethod objects,
                                   # from merges=[hc_smoe,ream] and their settings merge.ream.group_size=8)
    substitutes: tuple = ()        # scores whose selections are also evaluated substituted (MoNE: a removed
                                   # expert's slot returns its mean routed output), e.g. [mone]
    allocation: Allocation = UNIFORM   # per-layer counts (moejax.allocation): allocation=global,
                                   # shape or evo_esap, with its settings allocations.evo_esap.population=16
    calib: tuple = ()              # files/folders/globs; empty = standard-library sources
    calibration: str = "code"      # which text calibrates: code | skills | uniform | train | 'code=0.5,kv=0.5'
    heldout: tuple = ()            # empty = the model's held-out files, else DEFAULT_HELDOUT (+ LICENSE.txt)
    seq_len: int = 256
    calib_tokens: int = 32768
    heldout_tokens: int = 16384    # per held-out text
    batch_size: int = 8
    sequential: bool = False
    sequential_merges: bool = False  # also each merge sequentially (REAM's mode): layer l+1 merged on the
                                     # model merged up to layer l, per router form (form sequential_tied/_shrunk)
    reroute: bool = False          # also every variant with its routers distilled from the unpruned model on
                                   # the calibration tokens (moejax.training.reroute): rows with rerouted=True
    router_distillation: RerouteSettings = dataclasses.field(default_factory=RerouteSettings)   # its settings
    dtype: str = "float32"
    seed: int = 0
    workers: int = 1               # processes the pass's variants are shared among, each on its own core
                                   # (0: one per core): each carries its share's held-out streams and makes
                                   # their decisions (`evaluate_in_workers`)

    @classmethod
    def from_mapping(cls, d: dict) -> "PruneRealConfig":
        cfg = cls(**typed_settings(cls, d, "prune_real"))
        cfg.validate()
        return cfg

    def validate(self) -> None:
        if not self.path:
            raise ConfigError("prune_real: set model=tiny or model.path=CHECKPOINT_FOLDER")
        if not (Path(self.path) / "config.json").is_file():
            hint = " (train it first: python -m moejax.run experiment=train_tiny)" if "models/tiny" in self.path else ""
            raise ConfigError(f"prune_real: {self.path} has no config.json{hint}")
        config = read_config(Path(self.path) / "config.json")
        has_bias = config.HAS_BALANCE_BIAS
        if self.scores is not None:
            check_score_names(self.scores)
            scores_for(self.scores, has_bias, f"prune_real: {self.path}")
        if self.reroute:
            self.reroute_settings()
        if self.sequential_merges and not self.merges:
            raise ConfigError("prune_real: sequential_merges=true merges nothing: name the merges too, "
                              "e.g. merges=[ream]")
        if self.substitutes:
            scores_for(self.substitutes, has_bias, f"prune_real: substitutes ({self.path})")
            refuse_repeats("prune_real", "substitutes", self.substitutes)
        try:  # each merge method's settings against the model (REAM: its score, its group size), before any work
            for method in self.merges:
                if method.scores:
                    scores_for(list(method.scores), has_bias, f"{method.name}'s score ({self.path})")
                for k in self.keep:
                    method.check(resolve_keep(k, config.n_experts, config.num_experts_per_tok)
                                 if self.allocation.reads is None else None, config.n_experts)
        except ConfigError as e:
            raise ConfigError(f"prune_real: {e}") from None
        if self.scores is not None:
            refuse_repeats("prune_real", "scores", self.scores)
        if not isinstance(self.allocation, Allocation):
            raise ConfigError(f"prune_real: allocation={self.allocation!r}; expected an allocation object "
                              f"(moejax.allocation.parse(name, **settings)), one of {list(ALLOCATIONS.names())}")
        if self.allocation.searches:   # its fitness sequences must leave some to score by
            try:
                self.allocation.held_apart(self.calib_tokens // self.seq_len, "calibration (calib_tokens // seq_len)")
            except ConfigError as e:
                raise ConfigError(f"prune_real: {e}") from None
        if not self.keep:
            raise ConfigError("prune_real: keep is empty; give counts or ratios of E, e.g. keep=[0.5,0.25]")
        refuse_repeats("prune_real", "keep", [resolve_keep(k, config.n_experts, config.num_experts_per_tok)
                                              for k in self.keep], self.keep)
        for name in ("seq_len", "calib_tokens", "heldout_tokens", "batch_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"prune_real: {name}={getattr(self, name)} must be >= 1")
        if isinstance(self.workers, bool) or not isinstance(self.workers, int) or self.workers < 0:
            raise ConfigError(f"prune_real: workers={self.workers!r}; expected an integer >= 0 (0: one per core)")
        if self.dtype not in ("float32", "bfloat16"):
            raise ConfigError(f"prune_real: dtype={self.dtype!r}; expected float32 or bfloat16")
        self.calibration_mix()

    def reroute_settings(self) -> RerouteSettings:
        """Router distillation's settings (`router_distillation.*`), checked."""
        try:
            return self.router_distillation.check()
        except ConfigError as e:
            raise ConfigError(f"prune_real: {str(e).replace('reroute: ', 'router_distillation.')}") from None

    def calibration_mix(self) -> dict:
        """Shares of the calibration tokens by text (moejax.training.skills.calibration_mix), the
        model's training mix read from its moejax_tiny.json for calibration=train."""
        record = Path(self.path) / TINY_RECORD
        trained = None
        if record.is_file():
            trained = ((json.loads(record.read_text()).get("config") or {}).get("data") or {}).get("mix")
            trained = dict(trained) if isinstance(trained, (list, dict)) and trained else None
        try:
            return calibration_mix(self.calibration, trained)
        except ConfigError as e:
            raise ConfigError(f"prune_real: {e}") from None


Config = PruneRealConfig


def settings_from(cfg: dict) -> dict:
    model, data, prune = cfg.get("model") or {}, cfg.get("data") or {}, cfg.get("prune") or {}
    settings = {"path": model.get("path") or "", **data, **prune}
    for key in ("keep", "scores", "merges", "merge", "substitutes", "allocation", "allocations", "calibration", "dtype", "seed",
                "router_distillation", "workers"):
        if cfg.get(key) is not None:
            settings[key] = cfg[key]
    return settings


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def default_texts(cfg: PruneRealConfig) -> tuple[list[Path], list[Path]]:
    """(calibration files, held-out files) when the config names none."""
    root = stdlib_root()
    record = Path(cfg.path) / TINY_RECORD
    if cfg.heldout:
        heldout = text_files(list(cfg.heldout))
    elif record.is_file():
        listed = json.loads(record.read_text()).get("heldout") or []
        heldout = [root / name for name in listed if (root / name).is_file()][:4]
    else:
        heldout = [root / name for name in DEFAULT_HELDOUT if (root / name).is_file()]
    if not cfg.heldout and (root / "LICENSE.txt").is_file():
        heldout.append(root / "LICENSE.txt")  # prose
    if cfg.calib:
        calib = text_files(list(cfg.calib))
    else:
        exclude = {p.resolve() for p in heldout}
        if record.is_file():  # never calibrate on what the tiny model held out either
            exclude |= {(root / n).resolve() for n in json.loads(record.read_text()).get("heldout") or []}
        calib = [p for p in sorted(root.glob("*.py")) if p.resolve() not in exclude]
    return calib, heldout


def run(cfg: PruneRealConfig, progress=None, job_dir=None):
    df, info, timings = evaluate(cfg, progress)
    if job_dir is not None and info["clusters"] and any(info["clusters"].values()):
        write_json_atomic(Path(job_dir) / "clusters.json", {str(l): c for l, c in info["clusters"].items()})
    return df, timings


def evaluate(cfg: PruneRealConfig, progress=None, merged_weights: bool = False, share: tuple[int, int] = (0, 1)):
    """(tidy DataFrame, evaluate_pruning's info with every variant's plan and kept sets, timings);
    merged_weights: merges' plans keep their merged experts (evaluate_pruning). With cfg.workers
    other than 1, the variants are shared among processes (`evaluate_in_workers`); share: the one
    share this call carries (evaluate_pruning's)."""
    import pandas as pd

    from moejax.parallel.cores import available_cores

    n_workers = cfg.workers or len(available_cores())
    if n_workers > 1 and share == (0, 1):
        return evaluate_in_workers(cfg, n_workers, progress, merged_weights)

    import jax.numpy as jnp

    from moejax.evaluation.carried import evaluate_pruning
    from moejax.hf.model_io import open_checkpoint

    ckpt = open_checkpoint(cfg.path)
    calib_files, heldout_files = default_texts(cfg)
    if not heldout_files:
        raise ConfigError("prune_real: no held-out text found; name files with data.heldout=[...]")
    tok = Tokenizer(cfg.path, ckpt.config.vocab_size)
    tokens = file_tokens(tok, cfg.seq_len)
    calib = calibration_tokens(cfg, calib_files, tok, tokens)
    heldout = {f.name: tokens([f], cfg.heldout_tokens) for f in heldout_files}
    scores = scores_for(cfg.scores, ckpt.config.HAS_BALANCE_BIAS, f"prune_real: {cfg.path}")
    rows, info = evaluate_pruning(ckpt, calib, heldout, scores, list(cfg.keep), merges=cfg.merges,
                                  substitutes=cfg.substitutes, sequential=cfg.sequential,
                                  sequential_merges=cfg.sequential_merges, allocation=cfg.allocation,
                                  batch_size=cfg.batch_size, dtype=jnp.dtype(cfg.dtype), seed=cfg.seed,
                                  merged_weights=merged_weights or cfg.reroute, progress=progress is not None or None,
                                  share=share)
    if cfg.reroute:
        t0 = time.perf_counter()
        reroute_rows, info["rerouted"] = rerouted_variants(cfg, calib, heldout, info["plans"])
        rows += reroute_rows
        info["reroute_seconds"] = time.perf_counter() - t0
    df = pd.DataFrame(rows, columns=["method", "form", "keep", "layer", "text", "metric", "value"]
                      + (["rerouted"] if cfg.reroute else []))
    df["keep"] = df["keep"].astype("Int64")
    df["layer"] = df["layer"].astype("Int64")
    timings = {"pass_s": info["seconds"], "variants": info["variants"], "calib_tokens": info["calib_tokens"],
               "heldout_tokens": info["heldout_tokens"], "calib_files": len(calib_files),
               "heldout_files": [str(f) for f in heldout_files], "allocation": cfg.allocation.record(),
               "allocation_search": info["allocation_search"], "layer_counts": info["layer_counts"]}
    if cfg.reroute:
        timings["reroute_s"] = info["reroute_seconds"]
    return df, info, timings


def evaluate_in_workers(cfg: PruneRealConfig, n_workers: int, progress=None, merged_weights: bool = False):
    """`evaluate` in `n_workers` processes, each on its own core (`moejax.parallel.cores`), worker i
    carrying the i-th share of the variants (`moejax.evaluation.carried.share_of`), rerouting
    included: the rows of all (the shared ones once), info as one pass's (plans in its order,
    kept sets and clusters of every layer joined), timings with the wall time as `pass_s` and each
    worker's. Each variant's rows equal the one-process pass's within float32 reordering (its
    held-out streams run in calls of other sizes, on one core)."""
    import functools

    from moejax.parallel.cores import each_share

    t0 = time.perf_counter()
    parts = each_share(n_workers, functools.partial(evaluate, cfg, None, merged_weights),
                       f"calibration pass ({n_workers} workers)", progress)
    return join_shares(parts, time.perf_counter() - t0, cfg.reroute)


def join_shares(parts: list, wall: float, reroute: bool = False):
    """Every share's (rows DataFrame, info, timings), in share order, as one pass's: the rows of all,
    info with the plans in the unsplit order (info["at"]), every layer's kept sets and clusters
    joined, rerouted maps in plan order; timings with `wall` as pass_s and each worker's."""
    import pandas as pd

    df = pd.concat([d for d, _, _ in parts], ignore_index=True)
    order = sorted(((at, plan) for _, info, _ in parts for at, plan in zip(info["at"], info["plans"])),
                   key=lambda pair: pair[0])
    info = dict(parts[0][1], plans=[plan for _, plan in order], at=[at for at, _ in order],
                variants=sum(p[1]["variants"] for p in parts), seconds=wall)
    for key in ("kept", "clusters"):   # per layer: every share's (clusters None without merges)
        info[key] = {l: None if all(p[1][key][l] is None for p in parts) else
                     {k: v for p in parts for k, v in (p[1][key][l] or {}).items()} for l in parts[0][1][key]}
    if reroute:
        place = {dc.replace(plan.spec, rerouted=True): at for at, plan in order}
        rerouted = {spec: maps for p in parts for spec, maps in p[1]["rerouted"].items()}
        info["rerouted"] = dict(sorted(rerouted.items(), key=lambda kv: place[kv[0]]))
    timings = dict(parts[0][2], pass_s=wall, variants=info["variants"], pass_workers=len(parts),
                   **{f"worker_{i}.pass_s": p[2]["pass_s"] for i, p in enumerate(parts)})
    if reroute:
        timings["reroute_s"] = max(p[2]["reroute_s"] for p in parts)
    return df, info, timings


def rerouted_variants(cfg: PruneRealConfig, calib, heldout: dict, plans: list) -> tuple[list[dict], dict]:
    """Every variant rerouted (`moejax.training.reroute`): its routers trained, the unpruned model the
    teacher, on the calibration tokens; then its held-out perplexity per text and over all, by the
    whole model's forward under the rerouted expert maps. Returns (rows, {rerouted VariantSpec: its
    expert maps}). The model is held whole (router distillation trains end to end)."""
    import jax.numpy as jnp

    from moejax.hf.model_io import load_pretrained
    from moejax.training.reroute import rerouted_maps, teacher_log_probs, train_routers

    settings = cfg.reroute_settings()
    model = load_pretrained(cfg.path, jnp.dtype(cfg.dtype))
    batches = [(calib[i:i + settings.batch_size], None) for i in range(0, len(calib), settings.batch_size)]
    teacher = teacher_log_probs(model, batches)
    forward = model.jitted()
    rows, maps_of = [], {}
    for plan in plans:
        trained, result = train_routers(model, teacher, batches, settings, plan.expert_maps())
        spec = dc.replace(plan.spec, rerouted=True)
        maps_of[spec] = maps = rerouted_maps(plan.expert_maps(), trained)
        rows += forward_perplexity_rows(forward, heldout, maps, cfg.batch_size, spec.row())
        n = min(len(batches), len(result.losses))   # the mean KL over the first and the last pass over the batches
        rows += [dict(spec.row(), metric=f"reroute_kl_{at}", value=float(np.mean(losses)))
                 for at, losses in (("first", result.losses[:n]), ("last", result.losses[-n:]))]
    return rows, maps_of


def forward_perplexity_rows(forward, heldout: dict, maps: dict, batch_size: int, columns: dict) -> list[dict]:
    """Held-out perplexity per text and over all ("all") by the whole model's jitted forward under
    `maps` (`CausalLM.jitted()`), batch by batch, and the variant's agreement with the unpruned
    forward (maps None) on the same positions (`moejax.inference.agreement`: ESAP, KL, top-1): the
    path for variants the carried pass cannot stream (rerouted ones). A test holds it equal to the
    carried pass's rows for the same plan."""
    import jax.numpy as jnp

    from moejax.inference.agreement import logits_agreement
    from moejax.inference.nll import next_token_nll

    per_text = {}
    for text, ids in heldout.items():
        values = {"perplexity": [], "esap": [], "kl": [], "top1_agreement": []}
        for i in range(0, len(ids), batch_size):
            batch = jnp.asarray(ids[i:i + batch_size])
            logits = forward(batch, None, maps).logits_BSV
            values["perplexity"].append(np.asarray(next_token_nll(logits, batch), np.float64).ravel())
            agreement = logits_agreement(forward(batch, None, None).logits_BSV[:, :-1], logits[:, :-1])
            for metric, value in zip(("esap", "kl", "top1_agreement"), agreement):
                values[metric].append(np.asarray(value, np.float64).ravel())
        per_text[text] = {metric: np.concatenate(v) for metric, v in values.items()}
    rows = []
    for text in [*per_text, "all"]:
        values = per_text[text] if text != "all" else {
            metric: np.concatenate([v[metric] for v in per_text.values()]) for metric in next(iter(per_text.values()))}
        rows += [dict(columns, text=text, metric=metric,
                      value=float(np.exp(v.mean())) if metric == "perplexity" else float(v.mean()))
                 for metric, v in values.items()]
    return rows


def file_tokens(tok, seq_len: int):
    """tokens(files, max_tokens): the files' text, tokenised in order until max_tokens, packed into
    rows of seq_len (`moejax.data.pack`)."""
    def tokens(files, max_tokens):
        docs, total = [], 0
        for f in files:
            docs.append(tok.encode(read_text(f)))
            total += len(docs[-1])
            if total >= max_tokens:
                break
        return pack(docs, seq_len, max_tokens)

    return tokens


def calibration_tokens(cfg: PruneRealConfig, code_files, tok, tokens):
    """[n_seq, seq_len] calibration ids: `calibration`'s shares of calib_tokens, the code part
    from the calibration files, each skill's part from its training-split documents (one row may
    hold several skills' documents: they are shuffled together)."""
    mix = cfg.calibration_mix()
    parts = []
    if mix.get(CODE, 0) > 0:
        parts.append(tokens(code_files, max(cfg.seq_len, round(mix[CODE] * cfg.calib_tokens))))
    skill_docs = calibration_documents(mix, cfg.calib_tokens, cfg.seed)
    if skill_docs:
        n_skill = cfg.calib_tokens - (parts[0].size if parts else 0)
        parts.append(pack([tok.encode("".join(skill_docs))], cfg.seq_len, max(cfg.seq_len, n_skill)))
    return np.concatenate(parts, axis=0)


def summary_title(cfg: PruneRealConfig) -> str:
    modes = "one-shot and sequential" if cfg.sequential else "one-shot"
    merged = f"; merging by {', '.join(map(str, cfg.merges))}, router tied and shrunk" if cfg.merges else ""
    return (f"{cfg.path}: held-out perplexity (all texts) and mean layer-local relative error, by score "
            f"and keep ({modes} pruning{merged}):")


def rerouted_as_form(df):
    """A table's rerouted rows with "+rerouted" appended to their form (for tables pivoted by form
    and method, which would otherwise average a variant with its rerouted self)."""
    if "rerouted" not in df.columns:
        return df

    flag = df["rerouted"].map(is_rerouted)
    return df.assign(form=df["form"].where(~flag, df["form"] + "+rerouted"))


def summary_table(df):
    import pandas as pd

    df = rerouted_as_form(df)
    ppl = df[(df.metric == "perplexity") & (df.text == "all")]
    base = ppl[ppl["form"] == "none"]["value"]
    pruned = ppl[ppl["form"] != "none"].pivot_table(index=["form", "method"], columns="keep", values="value")
    pruned.columns = [f"ppl keep={k}" for k in pruned.columns]
    err = df[df.metric == "rel_error"].pivot_table(index=["form", "method"], columns="keep", values="value",
                                                   aggfunc="mean")
    err.columns = [f"rel_error keep={k}" for k in err.columns]
    table = pd.concat([pruned, err], axis=1)
    if len(base):
        table.loc[("none", "unpruned"), :] = float("nan")
        table.loc[("none", "unpruned"), [c for c in table.columns if c.startswith("ppl")]] = float(base.iloc[0])
    return table.round(4)
