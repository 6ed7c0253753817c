"""What was asked for: a variant's *spec* (method, keep, form), the one name a variant has from
Hydra to the results table.

    method  a score (pruning, substitution; `moejax.scoring.scores`) or a merge method
            (its name: `moejax.merging.method.MERGE_METHODS`); None for the unpruned model
    keep    router slots kept per MoE layer (a count: ratios are resolved against E first)
    rerouted  the variant with its routers distilled from the unpruned model afterwards
            (`moejax.training.reroute`); a results row carries `rerouted` only when True
    form    how the method is applied:
              none         the unpruned model
              one_shot     pruning: every layer's experts chosen on the unpruned model's statistics
              sequential   pruning: layer l+1 scored on the model already pruned up to layer l
              tied         merging: every router slot remains, computing its cluster's merged expert
              shrunk       merging: one router slot per cluster (what a merged checkpoint holds)
              sequential_tied, sequential_shrunk
                           merging, sequentially: layer l+1 clustered and merged on the model
                           already merged up to layer l (REAM's sequential mode), under that router form
              substituted  substitution (MoNE): a removed expert's slot stays in the router and
                           returns a constant vector

A checkpoint's record (`pruning.json` of `moejax prune`, `merge`, `prune --substitute`; `reroute.json`'s
`variant`) holds the spec's fields at its top level, `record()`, with `keep` as it was asked (a
count or a ratio of E; None for per-layer counts) and the method's settings (`settings`: a merge
method's, `moejax.merging.method`); `from_record` reads it back, and also the three schemas
written before it (`prune`: `score`; `merge`: `method`, `router`, `sequential`; `--substitute`:
`form` "substitute", `score`).

Results tables carry `method`, `form` and `keep` columns, one per field (`row`, read back by
`from_row`); tables written before these columns existed (`score` for the method, `mode` for the
form) are renamed by `moejax.results.load`, the one place old tables are read.
"""

from __future__ import annotations

import dataclasses

from moejax.errors import ConfigError

PRUNING_FORMS = ("one_shot", "sequential")
ROUTER_FORMS = ("tied", "shrunk")     # a merged layer's router: every slot, or one slot per cluster
MERGE_FORMS = (*ROUTER_FORMS, *(f"sequential_{r}" for r in ROUTER_FORMS))
FORMS = ("none", *PRUNING_FORMS, *MERGE_FORMS, "substituted")


@dataclasses.dataclass(frozen=True)
class VariantSpec:
    method: str | None
    keep: int | None
    form: str = "one_shot"
    rerouted: bool = False

    def __post_init__(self):
        if self.form not in FORMS:
            raise ConfigError(f"variant form {self.form!r}: expected one of {list(FORMS)}")
        if (self.form == "none") != (self.method is None):
            raise ConfigError(f"variant {self.method}@{self.keep}: form 'none' (the unpruned model) and only it "
                              f"has no method, got form {self.form!r}")
        if self.rerouted and self.form == "none":
            raise ConfigError("the unpruned model is the teacher router distillation trains against; it is not rerouted")

    @classmethod
    def unpruned(cls) -> "VariantSpec":
        return cls(None, None, "none")

    @property
    def merged(self) -> bool:
        return self.form in MERGE_FORMS

    @property
    def sequential(self) -> bool:
        """Decided layer by layer on the model already changed up to the layer before (its own
        calibration stream), not on the unpruned model."""
        return self.form.startswith("sequential")

    @property
    def router(self) -> str | None:
        """A merged variant's router form (tied | shrunk); None otherwise."""
        return self.form.removeprefix("sequential_") if self.merged else None

    @property
    def name(self) -> str:
        """'unpruned', 'method@keep' (one-shot pruning) or 'form:method@keep'."""
        if self.form == "none":
            return "unpruned"
        name = f"{self.method}@{self.keep}" if self.form == "one_shot" else f"{self.form}:{self.method}@{self.keep}"
        return name + "+rerouted" if self.rerouted else name

    def row(self) -> dict:
        """The spec's columns of a results row (`rerouted` only when True: tables without rerouted
        variants keep their columns)."""
        row = dict(method=self.method, form=self.form, keep=self.keep)
        return dict(row, rerouted=True) if self.rerouted else row

    @classmethod
    def from_row(cls, row) -> "VariantSpec":
        """The spec of a results row (a dict or pandas row)."""
        fields = row._asdict() if hasattr(row, "_asdict") else row   # a dict, a pandas Series or an itertuples row
        form, method, keep = fields.get("form"), fields.get("method"), fields.get("keep")
        if form == "none":
            return cls.unpruned()
        rerouted = is_rerouted(fields.get("rerouted"))
        return cls(str(method), None if keep is None or keep != keep else int(keep), str(form), rerouted)

    def record(self, settings: dict | None = None) -> dict:
        """The spec's fields of a checkpoint's record (`RECORD_FIELDS`): method, form, keep (as
        asked), rerouted, and the method's settings ({} for a score)."""
        return {"method": self.method, "form": self.form, "keep": self.keep, "rerouted": self.rerouted,
                "settings": dict(settings or {})}

    @classmethod
    def from_record(cls, record: dict) -> "VariantSpec":
        """The spec a checkpoint's record names: `record()`'s fields, or one of the schemas written
        before them (refused, naming what it has, when it is none of them)."""
        if not isinstance(record, dict):
            raise ConfigError(f"a checkpoint record must be a JSON object, got {type(record).__name__}")
        keep = record.get("keep")
        if record.get("form") in FORMS and "method" in record:
            return cls(record["method"], keep, record["form"], bool(record.get("rerouted", False)))
        if record.get("form") == "substitute":   # `prune --substitute` before the spec: method "mone", its score
            return cls(record.get("score") or record.get("method"), keep, "substituted")
        if "router" in record and "method" in record:   # `moejax merge` before the spec
            return cls(record["method"], keep, ("sequential_" if record.get("sequential") else "") + record["router"])
        if "score" in record:   # `moejax prune` before the spec
            return cls(record["score"], keep, "one_shot")
        raise ConfigError(f"not a moejax checkpoint record (no method and form, nor score): keys {sorted(record)}")


def is_rerouted(value) -> bool:
    """A results table's `rerouted` cell as a bool: True, 1 or their text (a table read back from
    CSV or parquet); missing, None, NaN, pandas NA or False: False. `.map(is_rerouted)` on a column."""
    return str(value) in ("True", "1", "1.0")
