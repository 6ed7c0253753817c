"""toy3's inputs: each seed's layer and tokens, drawn on the host (`draw_inputs`)."""

from __future__ import annotations

import numpy as np

from moejax.experiments.toy3.config import Toy3Config


def draw_inputs(cfg: Toy3Config, seeds) -> list[dict]:
    """Everything random about each seed (SPEC section 4), drawn on the host with numpy: the
    layer's weights router [E, D], w1 [E, D, F], w2 [E, F, D], and the tokens under each offset,
    x_cal [O, n_calib, D] and x_held [O, n_heldout, D], all float32.

    numpy rather than jax.random: the draw is cheap either way, but XLA took ~2.6 s to compile
    the jax.random version, a quarter of a cold run. Weights, offset direction, calibration and
    held-out tokens come from separate child streams, so changing a token count leaves the
    weights as they were. (The `random` score uses its own stream, [seed, 0].)
    """
    return [_draw(cfg, int(seed)) for seed in seeds]


def _draw(cfg: Toy3Config, seed: int) -> dict:
    g_model, g_dir, g_cal, g_held = (np.random.default_rng(s)
                                     for s in np.random.SeedSequence([seed, 1]).spawn(4))
    d, h, n_experts = cfg.d_model, cfg.d_hidden, cfg.n_experts

    def normal(gen, shape, std=1.0):
        return gen.standard_normal(shape, dtype=np.float32) * np.float32(std)

    router = normal(g_model, (n_experts, d), d ** -0.5)
    w1 = normal(g_model, (n_experts, d, h), d ** -0.5)
    w2 = normal(g_model, (n_experts, h, d), h ** -0.5)
    v = g_dir.standard_normal(d)
    directions = {"ones": np.ones(d) / np.sqrt(d), "random": v / np.linalg.norm(v)}
    mu_OD = (cfg.offset_scale * np.sqrt(d) * np.stack([directions[o] for o in cfg.offsets])).astype(np.float32)
    # The same noise under both offsets: the offset comparison is paired.
    x_cal = mu_OD[:, None] + normal(g_cal, (cfg.n_calib, d))
    x_held = mu_OD[:, None] + normal(g_held, (cfg.n_heldout, d))
    return {"router": router, "w1": w1, "w2": w2, "x_cal": x_cal, "x_held": x_held}
