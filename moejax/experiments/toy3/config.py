"""toy3's settings: `Toy3Config` (every setting, its SPEC section 4 default and its checks) and
`settings_from`, which reads them out of the resolved Hydra config. Validating imports no JAX."""

from __future__ import annotations

import dataclasses

from moejax.errors import ConfigError
from moejax.experiments.settings import typed_settings
from moejax.merging.method import MERGE_METHODS
from moejax.parallel.mesh import MeshConfig
from moejax.scoring.scores import INTERVENTION_SCORES, OUTPUT_SCORES, scores_for
from moejax.scoring.select import resolve_keep
from moejax.settings_check import refuse_repeats

OFFSETS = ("ones", "random")
LOADS = ("skewed", "balanced")
ROUTERS = ("sigmoid", "softmax")  # toy_layer.ROUTERS, not imported: validating needs no JAX
DEFAULT_SCORES = ("frequency", "signed", "l1", "random", "reap", "ean")
DEFAULT_MERGES = MERGE_METHODS.parse_all(("hc_smoe", "m_smoe"))   # moejax.merging.method: JAX-free


@dataclasses.dataclass(frozen=True)
class Toy3Config:
    """Every setting of toy3; defaults are SPEC section 4."""

    seed: int = 0                 # first seed
    seeds: int = 8                # seeds seed .. seed + seeds - 1, vectorised in one job
    keep: tuple = (8, 16, 32, 48)  # counts, or ratios of E (floats in (0, 1])
    scores: tuple = DEFAULT_SCORES  # any registered score but reap_code (aimer reads the experts' w1, w2)
    merges: tuple = DEFAULT_MERGES  # merging baselines (SPEC section 8; `MergeMethod` objects, settings from the
                                  # `merge` block: merge.ream.group_size=8), each under both router forms; () = none
    substitutes: tuple = ()       # scores whose kept sets are also evaluated substituted (MoNE), e.g. [mone]
    eq6_pairs: int = 16           # Eq. 6 check: pairs merged one at a time per seed and condition; 0 = none
    offsets: tuple = OFFSETS
    loads: tuple = LOADS
    d_model: int = 32
    d_hidden: int = 64
    n_experts: int = 64
    top_k: int = 4
    n_calib: int = 6000
    n_heldout: int = 6000
    balance_steps: int = 300
    balance_rate: float = 0.002
    offset_scale: float = 0.5     # ||mu|| = offset_scale * sqrt(d)
    router: str = "sigmoid"       # sigmoid (balance bias, DeepSeek-V3) or softmax (no bias, Qwen3-MoE)
    backend: str = "sorted"       # dispatch backend of the calibration pass ("ep" on a mesh); the Hydra
    #                               config's toy.backend=auto picks it from the mesh (settings_from)
    mesh_data: int = 1            # devices: data x expert (from the Hydra `mesh` group)
    mesh_expert: int = 1
    seed_batch: int = 8           # seeds vectorised together (bounds memory)

    @classmethod
    def from_mapping(cls, cfg: dict) -> "Toy3Config":
        """Build from a plain dict (a resolved Hydra config), rejecting unknown keys and bad values."""
        out = cls(**typed_settings(cls, cfg, "toy3"))
        out.validate()
        return out

    def validate(self) -> None:
        for name in ("seed", "seeds", "d_model", "d_hidden", "n_experts", "top_k", "n_calib",
                     "n_heldout", "balance_steps", "seed_batch", "mesh_data", "mesh_expert", "eq6_pairs"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(f"toy3: {name} must be an integer, got {value!r}")
        if self.seeds < 1:
            raise ConfigError(f"toy3: seeds={self.seeds}; need at least one seed (seeds >= 1)")
        if self.seed < 0:
            raise ConfigError(f"toy3: seed={self.seed}; seeds are non-negative integers")
        for name, value, valid in (("offsets", self.offsets, OFFSETS), ("loads", self.loads, LOADS)):
            bad = [v for v in value if v not in valid]
            if bad or not value:
                raise ConfigError(f"toy3: {name}={list(value)}; valid values: {list(valid)}")
            refuse_repeats("toy3", name, value)
        self.check_router()
        keeps = self.keep_counts() if self.merges else []   # (a bad keep is refused as itself, unprefixed)
        try:  # each merge method's settings against the toy's layer (REAM: its score, its group size)
            for method in self.merges:
                for name in set(method.scores) & {"reap_code", *INTERVENTION_SCORES}:
                    raise ConfigError(f"{method.name}'s score {name!r}: the toy does not compute it (see scores)")
                if method.scores:
                    scores_for(list(method.scores), self.has_balance_bias, f"{method.name}'s score (router={self.router})")
                for keep in keeps:
                    method.check(keep, self.n_experts)
        except ConfigError as e:
            raise ConfigError(f"toy3: {e}") from None
        refuse_repeats("toy3", "scores", self.scores)
        n_pairs = self.n_experts * (self.n_experts - 1) // 2
        if not 0 <= self.eq6_pairs <= n_pairs:
            raise ConfigError(f"toy3: eq6_pairs={self.eq6_pairs}; expected 0 (no Eq. 6 check) to {n_pairs} "
                              f"(every pair of the {self.n_experts} experts)")
        if self.eq6_pairs and not self.merges:
            raise ConfigError(f"toy3: eq6_pairs={self.eq6_pairs} with merges=[]: the Eq. 6 check merges its pairs in "
                              "the merges' program, which merges=[] turns off; set toy.eq6_pairs=0 as well (or "
                              "keep a merge)")
        if "reap_code" in (*self.scores, *self.substitutes):
            raise ConfigError("toy3: the reap_code score needs expert outputs for pairs the layer did not "
                              "route, which the toy does not compute; use reap")
        interventional = [n for n in (*self.scores, *self.substitutes) if n in INTERVENTION_SCORES]
        if interventional:
            raise ConfigError(f"toy3: score(s) {interventional} remove each expert and reroute its tokens (or vote over "
                              "the router's preference orders), which the toy's statistics do not compute; use them "
                              "with `moejax score` or prune_real")
        refuse_repeats("toy3", "substitutes", self.substitutes)
        if self.substitutes:
            scores_for(self.substitutes, self.has_balance_bias, where=f"toy3 substitutes (router={self.router})")
        if not self.keep:
            raise ConfigError("toy3: keep is empty; give a count, a ratio of E, or a list of them")
        refuse_repeats("toy3", "keep", self.keep_counts(), self.keep)
        if self.n_calib < 1 or self.n_heldout < 1 or self.seed_batch < 1:
            raise ConfigError("toy3: n_calib, n_heldout and seed_batch must be >= 1")
        mesh = MeshConfig(self.mesh_data, self.mesh_expert)
        if self.backend == "ep" and self.n_experts % mesh.expert:
            raise ConfigError(f"toy3: n_experts={self.n_experts} does not split over mesh.expert={mesh.expert}")
        if mesh.expert_parallel and self.backend != "ep":
            raise ConfigError(f"toy3: mesh.expert={mesh.expert} needs toy.backend=ep (got {self.backend!r})")

    def check_router(self) -> None:
        """A softmax router has no balance bias: the `balanced` load (bias trained by auxiliary-loss-free
        steps) and scores that read the bias are not defined for it; refused here, naming the setting."""
        if self.router not in ROUTERS:
            raise ConfigError(f"toy3: router={self.router!r}; valid routers: {list(ROUTERS)}")
        has_bias = self.has_balance_bias
        if not has_bias and "balanced" in self.loads:
            raise ConfigError(f"toy3: loads={list(self.loads)} with router={self.router}: the balanced load trains "
                              "the sigmoid router's balance bias, and a softmax router has none; "
                              "use loads=[skewed] (toy.loads=[skewed])")
        scores_for(self.scores, has_bias, where=f"toy3 (router={self.router})")

    @property
    def needs_outputs(self) -> bool:
        """Whether the calibration pass brings the routed pairs' outputs to the host: the mone score
        and the substitutes' constants read their sums."""
        return bool(self.substitutes) or bool(set(OUTPUT_SCORES) & {*self.scores, *self.merge_scores})

    @property
    def merge_scores(self) -> tuple:
        """The scores the merges read per expert (REAM's centroid score)."""
        return tuple(dict.fromkeys(s for m in self.merges for s in m.scores))

    def merges_read(self, field: str) -> bool:
        """Whether a merge reads the `MergeStats` field `field` (stage one computes only those)."""
        return any(field in m.reads for m in self.merges)

    @property
    def has_balance_bias(self) -> bool:
        """Whether the layer's router has a balance bias (e_score_correction_bias): sigmoid only."""
        return self.router == "sigmoid"

    def keep_counts(self) -> list[int]:
        return [resolve_keep(k, self.n_experts, self.top_k) for k in self.keep]


def settings_from(cfg: dict) -> dict:
    """toy3's settings from the resolved Hydra config: the `toy` block plus seed, seeds and keep."""
    settings = dict(cfg.get("toy") or {})
    settings.update({k: cfg[k] for k in ("seed", "seeds", "keep", "merge") if cfg.get(k) is not None})
    mesh = MeshConfig.from_dict(cfg.get("mesh"))
    settings.update(mesh_data=mesh.data, mesh_expert=mesh.expert)
    if settings.get("backend", "auto") == "auto":  # the routed experts' backend follows the mesh
        settings["backend"] = "ep" if mesh.expert_parallel else "sorted"
    return settings

