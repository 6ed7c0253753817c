"""Router distillation's settings (`moejax.training.reroute`): `RerouteSettings`, the one declaration
of their defaults, used by `moejax reroute` (its flags override them) and the experiments
(`prune.reroute=true` with `router_distillation.lr=...`). JAX-free (optax imported when the
schedule is built), so the experiments check them before JAX is imported."""

from __future__ import annotations

import dataclasses

import numpy as np

from moejax.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class RerouteSettings:
    steps: int = 200
    lr: float = 1e-3
    warmup: int = 10               # linear warmup steps (0: none)
    final_lr_fraction: float = 0.1  # the cosine decays to lr * this at the last step
    weight_decay: float = 0.0      # AdamW's decoupled decay (0: plain Adam), on the router weights
    batch_size: int = 8            # sequences per step
    holdout: float = 0.1           # the last max(1, floor(holdout * N)) of the N sequences are held out: they
    #                                select the routers kept and are never trained on (0: select on the training tokens)
    eval_every: int = 10           # the held-out KL is measured every this many steps (and before the first step,
    #                                after the last)

    def check(self) -> "RerouteSettings":
        """Refused before any work, naming the setting."""
        def integer(name, low):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < low:
                raise ConfigError(f"reroute: {name}={v!r}; expected an integer >= {low}")

        integer("steps", 1)
        integer("warmup", 0)
        integer("batch_size", 1)
        integer("eval_every", 1)
        if self.warmup >= self.steps and self.warmup:
            raise ConfigError(f"reroute: warmup={self.warmup} must be below steps={self.steps}")
        for name, low, high in (("lr", 0.0, 1.0), ("final_lr_fraction", 0.0, 1.0), ("weight_decay", 0.0, 1.0),
                                ("holdout", 0.0, 0.5)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not np.isfinite(v) or not low <= v <= high \
                    or (name == "lr" and v == 0):
                raise ConfigError(f"reroute: {name}={v!r}; expected a number in {'(' if name == 'lr' else '['}"
                                  f"{low}, {high}]")
        return self

    def schedule(self):
        """Linear warmup from 0 to lr over `warmup` steps, then a cosine to lr * final_lr_fraction."""
        import optax

        return optax.warmup_cosine_decay_schedule(0.0, self.lr, self.warmup, self.steps,
                                                  self.lr * self.final_lr_fraction)

    def optimizer(self):
        """AdamW (optax.GradientTransformation) on `schedule`, decoupled weight decay."""
        import optax

        return optax.adamw(self.schedule(), weight_decay=self.weight_decay)
