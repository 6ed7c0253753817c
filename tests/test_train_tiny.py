"""experiment=train_tiny on a reduced config: the loss falls, the balance biases move, held-out files
stay out of training, orbax resume continues where it stopped (and reproduces an uninterrupted
run), the saved checkpoint loads in transformers with the same held-out perplexity, and bad
settings are refused before any training."""

import dataclasses
import json
import math
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from moejax.errors import ConfigError, MoejaxError
from moejax.experiments import train_tiny as tt
from moejax.training.config import ORBAX_SUFFIX, ArchConfig, DataConfig, TrainConfig
from moejax.training.corpus import build_corpus
from moejax.training.progress import Progress
from moejax.training.trainer import Trainer, batch_gradients, next_token_loss, training_losses

ROOT = Path(__file__).resolve().parents[1]
N, M = 20, 30   # first run, then resumed to

SMALL_ARCH = dict(hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=3,
                  num_attention_heads=2, num_key_value_heads=2, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
                  v_head_dim=8, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
                  max_position_embeddings=64)


def settings(path, extra_text=(), **train):
    return {"path": str(path), "seed": 0, "arch": dict(SMALL_ARCH),
            "data": {"seq_len": 32, "eval_tokens": 2048, "text": list(map(str, extra_text))},
            "train": {"steps": N, "batch_size": 8, "lr": 1e-2, "warmup_steps": 3, "checkpoint_every": 10,
                      "eval_every": 10, "bias_update_rate": 1e-2, "rng_impl": "rbg",
                      "decay_steps": M, **train}}  # one schedule for N and M steps: one compiled step


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("train_tiny")
    notes = root / "notes"
    notes.mkdir()
    for i in range(6):
        (notes / f"note{i}.txt").write_text(f"extra text number {i}\n" * 50)
    cfg = tt.Config.from_mapping(settings(root / "tiny", extra_text=[notes]))
    df, timings = tt.run(cfg)
    return cfg, df, timings, notes


def metric(df, name):
    return df[df.metric == name].sort_values("step")


def test_loss_falls_and_balance_biases_move(trained):
    cfg, df, timings, _ = trained
    loss = metric(df, "train_loss")
    assert list(loss.step) == list(range(1, N + 1))
    assert loss.value.tail(3).mean() < loss.value.head(3).mean() - 0.5
    assert metric(df, "start_step").value.tolist() == [0]
    assert timings["tokens_per_s"] > 0 and timings["train_s"] > 0
    held = metric(df, "heldout_loss")
    assert list(held.step) == [10, N] and np.isfinite(held.value).all()
    record = json.loads((Path(cfg.path) / tt.RECORD).read_text())
    assert record["heldout_ppl"] == pytest.approx(math.exp(record["heldout_loss"]))
    assert record["steps"] == N and record["train_s"] > 0 and "jax" in record["versions"]
    from moejax import from_pretrained

    model = from_pretrained(cfg.path)
    for layer in model.model.layers[cfg.model_config().first_k_dense_replace:]:
        bias = np.asarray(layer.mlp.bias[...])
        assert (bias != 0).any() and (bias < 0).any() and (bias > 0).any()
        assert np.allclose(bias / cfg.train.bias_update_rate, np.round(bias / cfg.train.bias_update_rate),
                           atol=1e-3)  # only sign steps moved it (no gradient reached it)
    shares = metric(df, "max_load_share")
    assert len(shares) == cfg.model_config().num_hidden_layers - cfg.model_config().first_k_dense_replace


def test_heldout_files_are_disjoint_from_training_and_recorded(trained):
    cfg, _, _, notes = trained
    record = json.loads((Path(cfg.path) / tt.RECORD).read_text())
    train, held = record["train"], record["heldout"]
    assert train and held and not set(train) & set(held)
    assert held[:3] == ["difflib.py", "textwrap.py", "fractions.py"]   # the fixed list first
    assert Path(record["stdlib_root"]).is_dir() and all((Path(record["stdlib_root"]) / n).is_file() for n in held
                                                        if not Path(n).is_absolute())
    assert not any("site-packages" in n or n.startswith("test/") for n in train + held)
    extra = {str(p.resolve()) for p in notes.iterdir()}
    assert extra <= set(train) | set(held)                           # data.text files are split too
    # held out = the fixed list plus exactly the files whose hash falls in the fraction; ~5% of them
    names = sorted(set(train) | set(held))
    fixed = [n for n in cfg.data.heldout_always if n in names]
    assert held[:len(fixed)] == fixed
    assert set(held) == set(fixed) | {n for n in names if hash_share(n) < cfg.data.heldout_fraction}
    assert len(train) + len(held) == len(names)
    assert 0.02 < len(held) / len(names) < 0.10


def hash_share(name: str) -> float:
    """The documented stable hash: the first 8 bytes of sha256("moejax-heldout:" + name), big-endian,
    as a fraction of 2**64 (the same on every machine and Python version)."""
    import hashlib

    return int.from_bytes(hashlib.sha256(("moejax-heldout:" + name).encode("utf-8")).digest()[:8], "big") / 2.0**64


def test_split_heldout_against_its_definition():
    """split_heldout on hand-picked names: the files of `always` present (in `always`'s order)
    then every other file whose stable hash falls below the fraction (in input order); training
    files keep the input order. Pinned literally too: a changed hash would silently change which
    files a published tiny model was evaluated on."""
    from moejax.data import split_heldout

    names = ["difflib.py"] + [f"pkg/mod{i}.py" for i in reversed(range(12))] + ["textwrap.py"]
    always = ("textwrap.py", "absent.py", "difflib.py")
    train, held = split_heldout(names, 0.3, always)
    assert held == ["textwrap.py", "difflib.py", "pkg/mod10.py", "pkg/mod6.py", "pkg/mod5.py", "pkg/mod1.py"]
    assert train == [n for n in names if n not in held]
    # the same from the definition, for several fractions (the held-out set only grows with it)
    previous = set()
    for fraction in (0.05, 0.3, 0.5, 0.9):
        train, held = split_heldout(names, fraction, always)
        fixed = [n for n in always if n in names]
        want = fixed + [n for n in names if n not in fixed and hash_share(n) < fraction]
        assert held == want and train == [n for n in names if n not in want]
        assert previous <= set(held)
        previous = set(held)
    assert split_heldout(names, 0.3) == ([n for n in names if hash_share(n) >= 0.3],
                                         [n for n in names if hash_share(n) < 0.3])


def test_resume_continues_from_the_latest_checkpoint(trained, tmp_path, caplog):
    cfg, df, _, notes = trained
    out = tmp_path / "tiny"
    shutil.copytree(cfg.orbax_dir, tmp_path / ("tiny" + ORBAX_SUFFIX))
    assert sorted(int(p.name) for p in (tmp_path / "tiny.orbax").iterdir() if p.name.isdigit()) == [10, N]
    # micro-batches are how a step is computed, not what it is: a run resumes with another count
    more = tt.Config.from_mapping(settings(out, extra_text=[notes], steps=M, micro_batches=2))
    with caplog.at_level("INFO", logger="moejax.experiments.train_tiny"):
        df2, _ = tt.run(more)
    assert f"resuming from step {N}" in caplog.text
    assert metric(df2, "start_step").value.tolist() == [N]
    loss2 = metric(df2, "train_loss")
    assert list(loss2.step) == list(range(1, M + 1))                   # history carried over
    np.testing.assert_array_equal(loss2.value[loss2.step <= N], metric(df, "train_loss").value)
    assert json.loads((out / tt.RECORD).read_text())["steps"] == M
    assert max(int(p.name) for p in (tmp_path / "tiny.orbax").iterdir() if p.name.isdigit()) == M


def test_interrupted_run_resumed_equals_uninterrupted(trained, tmp_path):
    cfg, df, _, notes = trained
    shutil.copytree(cfg.orbax_dir, tmp_path / "tiny.orbax")
    shutil.rmtree(tmp_path / "tiny.orbax" / str(N))                   # as if stopped after step 10
    again = tt.Config.from_mapping(settings(tmp_path / "tiny", extra_text=[notes]))
    df2, _ = tt.run(again)
    assert metric(df2, "start_step").value.tolist() == [10]
    np.testing.assert_allclose(metric(df2, "train_loss").value, metric(df, "train_loss").value, rtol=1e-5)
    from moejax.hf.io.checkpoint_reader import CheckpointReader

    a, b = CheckpointReader(cfg.path), CheckpointReader(tmp_path / "tiny")
    for name in a.keys():
        np.testing.assert_allclose(a.read(name), b.read(name), rtol=1e-4, atol=1e-6, err_msg=name)


def test_changed_settings_refuse_to_resume(trained, tmp_path):
    cfg, _, _, notes = trained
    shutil.copytree(cfg.orbax_dir, tmp_path / "tiny.orbax")
    changed = tt.Config.from_mapping(settings(tmp_path / "tiny", extra_text=[notes], lr=5e-3))
    with pytest.raises(ConfigError, match=r"different settings \(train\.lr\).*train\.resume=false"):
        tt.run(changed)
    fewer = tt.Config.from_mapping(settings(tmp_path / "tiny", extra_text=[notes], steps=5))
    with pytest.raises(ConfigError, match="already holds step 20, past train.steps=5"):
        tt.run(fewer)


def test_transformers_loads_it_and_agrees_on_heldout_perplexity(trained):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    import jax.numpy as jnp

    from moejax import from_pretrained

    cfg, _, _, _ = trained
    record = json.loads((Path(cfg.path) / tt.RECORD).read_text())
    ids = build_corpus(cfg).heldout_ids
    assert ids.size == record["heldout_tokens"]
    hf = transformers.DeepseekV3ForCausalLM.from_pretrained(cfg.path, dtype=torch.float32,
                                                            attn_implementation="eager",
                                                            experts_implementation="eager").eval()
    bias = hf.model.layers[1].mlp.gate.e_score_correction_bias.detach().numpy()
    assert (bias < 0).any()                                           # the trained bias arrived
    with torch.no_grad():
        logits = hf(torch.as_tensor(ids, dtype=torch.long)).logits.float()
        logp = torch.log_softmax(logits[:, :-1], -1)
        hf_loss = -logp.gather(-1, torch.as_tensor(ids[:, 1:, None], dtype=torch.long)).mean().item()
    model = from_pretrained(cfg.path, dtype=jnp.float32)
    ours = float(next_token_loss(model.jitted()(jnp.asarray(ids)).logits_BSV, jnp.asarray(ids)))
    assert math.exp(hf_loss) == pytest.approx(math.exp(ours), rel=1e-4)
    assert math.exp(hf_loss) == pytest.approx(record["heldout_ppl"], rel=1e-4)
    assert 1.5 < record["heldout_ppl"] < 256


def test_saved_checkpoint_has_a_byte_level_tokenizer(trained):
    transformers = pytest.importorskip("transformers")

    cfg, _, _, _ = trained
    tok = transformers.AutoTokenizer.from_pretrained(cfg.path)
    assert tok.encode("def f():\n    return 'é'\n") == list("def f():\n    return 'é'\n".encode("utf-8"))
    assert tok.eos_token_id == 0 and tok.bos_token_id is None
    assert tok.model_max_length == cfg.model_config().max_position_embeddings
    config = transformers.AutoConfig.from_pretrained(cfg.path)
    assert (config.eos_token_id, config.pad_token_id, config.bos_token_id) == (0, 0, None)


@pytest.mark.parametrize("change,match", [
    ({"train": {"stepz": 3}}, r"unknown setting\(s\) \['train\.stepz'\]"),
    ({"arch": {"num_experts_per_tok": 9}}, r"train_tiny: arch: num_experts_per_tok=9 exceeds n_routed_experts=8"),
    ({"data": {"seq_len": 128}}, "data.seq_len=128 exceeds arch.max_position_embeddings=64"),
    ({"arch": {"family": "gpt2"}}, r"arch\.family='gpt2'; registered families"),
    ({"arch": {"hidden_size": "wide"}}, r'hidden_size="wide" \(str\), expected a positive integer'),
    ({"arch": {"n_group": 3}}, "n_routed_experts=8 is not divisible by n_group=3"),
    ({"train": {"steps": "many"}}, r"train\.steps='many'; expected int"),
    ({"bogus": 1}, r"unknown setting\(s\) \['bogus'\]"),
    ({"path": ""}, "model.path=FOLDER"),
    ({"train": {"micro_batches": 3}}, r"train\.micro_batches=3 must be >= 1 and divide train\.batch_size=8"),
])
def test_bad_settings_are_refused_before_training(tmp_path, change, match):
    s = settings(tmp_path / "tiny")
    for key, value in change.items():
        if isinstance(value, dict):
            s[key] = {**s[key], **value}
        else:
            s[key] = value
    with pytest.raises(ConfigError, match=match):
        tt.Config.from_mapping(s)
    assert not (tmp_path / "tiny").exists() and not (tmp_path / "tiny.orbax").exists()


def _tree(root: Path) -> dict:
    return {str(p.relative_to(root)): p.read_bytes() if p.is_file() else None for p in sorted(root.rglob("*"))}


def test_training_never_replaces_a_folder_it_did_not_make(trained, tmp_path, monkeypatch):
    """model.path is the output of training and the input of prune_real / eval_skills: a Hugging
    Face checkpoint there (or another training's output) is refused before any work, naming the
    folder, unless train.overwrite=true; this training's own output (same settings) is rerun."""
    cfg, _, _, notes = trained
    hf = tmp_path / "hf"
    shutil.copytree(cfg.path, hf)
    (hf / tt.RECORD).unlink()
    (hf / "generation_config.json").write_text('{"bos_token_id": 1}')
    other = tmp_path / "other"
    shutil.copytree(cfg.path, other)
    before = _tree(tmp_path)

    def no_work(*_):
        raise AssertionError("refusals come before any work")

    monkeypatch.setattr(tt, "build_corpus", no_work)
    with pytest.raises(ConfigError, match=f"^{hf}: model.path exists and is not a training output of these "
                                          r"settings .*set train\.overwrite=true to replace it$"):
        tt.run(tt.Config.from_mapping(settings(hf, extra_text=[notes])))
    with pytest.raises(ConfigError, match=f"^{other}: model.path exists and is a training output of other settings"):
        tt.run(tt.Config.from_mapping(settings(other, extra_text=[notes], lr=5e-3)))
    with pytest.raises(MoejaxError, match=re.escape(f"model.path (the training output) is inside the input {notes}")):
        tt.run(tt.Config.from_mapping(settings(notes / "model", extra_text=[notes])))
    assert _tree(tmp_path) == before
    tt.check_output(tt.Config.from_mapping(settings(other, extra_text=[notes])))   # a rerun of the same settings
    tt.check_output(tt.Config.from_mapping(settings(hf, extra_text=[notes], overwrite=True)))   # told explicitly
    tt.check_output(tt.Config.from_mapping(settings(tmp_path / "new", extra_text=[notes])))
    (tmp_path / "empty").mkdir()
    tt.check_output(tt.Config.from_mapping(settings(tmp_path / "empty", extra_text=[notes])))   # nothing to lose
    (tmp_path / "file").write_text("x")
    (tmp_path / "link").symlink_to(other)
    for path, why in (("file", "model.path is a file"), ("link", "model.path is a symbolic link")):
        with pytest.raises(ConfigError, match=f"^{tmp_path / path}: {why}"):
            tt.check_output(tt.Config.from_mapping(settings(tmp_path / path, extra_text=[notes], overwrite=True)))


def test_train_skills_refuses_a_checkpoint_at_model_path(tmp_path):
    """The experiment as a user runs it, with a copied override pointing at a model: exit
    non-zero, one line, the folder untouched."""
    import subprocess
    import sys

    from hf_fixtures import make_checkpoint

    make_checkpoint(tmp_path / "model", seed=1)
    (tmp_path / "model" / "generation_config.json").write_text('{"bos_token_id": 1}')
    before = _tree(tmp_path / "model")
    out = subprocess.run([sys.executable, "-m", "moejax.run", "experiment=train_skills",
                          f"model.path={tmp_path / 'model'}", f"hydra.run.dir={tmp_path / 'run'}"],
                         capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode != 0
    assert f"{tmp_path / 'model'}: model.path exists and is not a training output of these settings" in out.stderr
    assert _tree(tmp_path / "model") == before


def test_yaml_defaults_compose_into_the_dataclass_defaults(monkeypatch, tmp_path):
    """conf/experiment/train_tiny.yaml names only model=tiny's path and the registered dataclass
    defaults (moejax.experiments.register_configs): composing it gives exactly the dataclasses'."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from moejax.experiments.runner import experiment_config

    monkeypatch.setenv("MOEJAX_HOME", str(tmp_path))
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=["experiment=train_tiny"])
        moved = compose("config", overrides=["experiment=train_tiny", "model.path=/elsewhere", "train.steps=7"])
    typed = experiment_config(OmegaConf.to_container(cfg, resolve=True))[1]
    assert typed.path == str(tmp_path / "models" / "tiny")               # model=tiny's path
    assert typed.orbax_dir == tmp_path / "models" / "tiny.orbax"
    assert (typed.arch, typed.data, typed.train) == (ArchConfig(), DataConfig(), TrainConfig())
    assert dataclasses.replace(typed, path="x").fingerprint() == tt.Config(path="x").fingerprint()
    other = experiment_config(OmegaConf.to_container(moved, resolve=True))[1]
    assert other.path == "/elsewhere" and other.train.steps == 7
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        four = compose("config", overrides=["experiment=train_skills", "seeds=4", "seed=2"])
    four = experiment_config(OmegaConf.to_container(four, resolve=True))[1]
    assert (four.seeds, four.workers) == (4, 0)
    assert [(c.seed, Path(c.path).name) for c in four.seed_configs()] == [(k, f"seed-{k}") for k in range(2, 6)]
    assert {Path(c.path).parent.name for c in four.seed_configs()} == {"skills-deepseek_v3"}


def test_progress_line_only_on_a_terminal():
    import io

    class Tty(io.StringIO):
        def isatty(self):
            return True

    quiet, tty = io.StringIO(), Tty()
    for stream in (quiet, tty):
        bar = Progress(total=10, start=0, stream=stream)
        bar.update(10, 1.2345, 5000.0)
        bar.close()
    assert quiet.getvalue() == ""
    assert "10/10" in tty.getvalue() and "loss 1.234" in tty.getvalue() and "5,000 tok/s" in tty.getvalue()


@pytest.mark.slow  # 22 s; prune_real itself is checked against transformers and numpy by tests/test_prune_real.py
def test_prune_real_on_the_trained_model(trained, tmp_path):
    """The reduced train_tiny, then prune_real on it through the Hydra runner: its held-out files
    are the defaults, every score and both keeps are reported, keep=E gives the unpruned numbers."""
    from moejax.experiments.runner import run_job
    from moejax.results import load
    from moejax.scoring.scores import ALL_SCORES

    cfg = trained[0]
    record = json.loads((Path(cfg.path) / "moejax_tiny.json").read_text())
    # keep 2 of 8 in 4 routing groups of 2 is refused unless both kept experts share a group (the
    # variant rule: a token could be routed to pruned experts), so the smallest keep here is 4
    run_job({"name": "prune_real", "model": {"path": cfg.path}, "keep": [8, 0.5, 6],
             "data": {"seq_len": 32, "calib_tokens": 1024, "heldout_tokens": 256, "batch_size": 8},
             "prune": {"sequential": True}}, tmp_path / "run")
    df = load(tmp_path / "run")
    ppl = df[df.metric == "perplexity"]
    texts = set(ppl.text) - {"all"}
    assert texts - {"LICENSE.txt"} and texts - {"LICENSE.txt"} <= {Path(f).name for f in record["heldout"]}
    assert set(ppl[ppl["form"] == "one_shot"].method) == set(ALL_SCORES)  # man, msan, max_act and aimer included
    assert set(ppl.keep.dropna()) == {8, 6, 4}
    unpruned = ppl[ppl["form"] == "none"].set_index("text").value
    full = ppl[ppl.keep == 8]
    assert (full.value.to_numpy() == full.text.map(unpruned).to_numpy()).all()
    assert unpruned["all"] < 256  # the trained model beats a uniform guess over bytes


@pytest.mark.parametrize("alpha", [0.0, 0.01])
def test_micro_batches_give_the_whole_batchs_gradient(trained, alpha):
    """train.micro_batches=M takes the batch's gradient as the mean over M slices, one after
    another: the same gradient, loss and loads as the whole batch at once (the loads exactly; the
    gradients within float32 summation order), with and without the balance loss (a mean over
    sequences, so the slices' mean is the batch's). Summing the slices' gradients instead of
    averaging them, or averaging the loads, fails here; Adam's normalisation would hide the
    first from a comparison of parameters after a step."""
    import jax
    import jax.numpy as jnp

    cfg = trained[0]
    model = Trainer(cfg).model
    mc = cfg.model_config()
    losses = training_losses(mc.n_experts, mc.num_experts_per_tok, alpha)
    ids = jnp.asarray(np.random.default_rng(3).integers(1, 256, size=(cfg.train.batch_size, cfg.data.seq_len)),
                      jnp.int32)
    (ce1, loads1), g1 = jax.jit(lambda m, x: batch_gradients(losses, m, x, 1))(model, ids)
    for M in (2, 4):
        (ce, loads), g = jax.jit(lambda m, x: batch_gradients(losses, m, x, M))(model, ids)
        np.testing.assert_allclose(float(ce), float(ce1), rtol=1e-6)
        assert set(loads) == set(loads1)
        for l in loads1:
            np.testing.assert_array_equal(np.asarray(loads[l]), np.asarray(loads1[l]))
        flat1, flat = jax.tree.leaves(g1), jax.tree.leaves(g)
        assert len(flat) == len(flat1) > 0
        for a, b in zip(flat1, flat):
            scale = float(jnp.abs(a).max())
            np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-5 * scale + 1e-12)


def test_balance_bias_step_follows_the_rule_in_numpy(trained):
    """DeepSeek-V3's auxiliary-loss-free rule (SPEC section 4's `bias -= rate * sign(load -
    mean(load))`, the docstring's `bias_e += rate * sign(mean_load - load_e)`), recomputed in numpy
    from the experts each token chose in the step's batch: two real training steps (the second
    starting from a nonzero bias) move every MoE layer's bias by exactly that. A flipped sign
    (which training, the loss and the range checks above all survive) fails here."""
    import jax.numpy as jnp

    cfg = trained[0]
    trainer = Trainer(cfg)            # the same settings: the compiled step of the fixture is reused
    rate = np.float32(cfg.train.bias_update_rate)
    moe_layers = range(cfg.model_config().first_k_dense_replace, cfg.model_config().num_hidden_layers)
    rng = np.random.default_rng(7)
    moved = 0
    for _ in range(2):
        ids = jnp.asarray(rng.integers(1, 256, size=(cfg.train.batch_size, cfg.data.seq_len)), jnp.int32)
        before = {l: np.array(trainer.model.model.layers[l].mlp.bias[...]) for l in moe_layers}
        # the loads of the step's batch under the current parameters and bias: the compiled held-out
        # pass (of the fixture's eval batch shape) on the batch repeated, divided by the repeats
        reps = cfg.train.eval_batch_size // cfg.train.batch_size
        _, counts = trainer._evaluate(trainer.state, jnp.tile(ids, (reps, 1)))
        assert all((np.asarray(counts[l]) % reps == 0).all() for l in moe_layers)
        load = {l: np.asarray(counts[l], np.int64) // reps for l in moe_layers}
        trainer.state, _ = trainer.step(trainer.state, ids)
        after = trainer.model
        for l in moe_layers:
            assert load[l].sum() == ids.size * cfg.model_config().num_experts_per_tok
            assert load[l].min() < load[l].mean() < load[l].max()        # the batch is unbalanced
            # busy experts (load above the mean) go down, idle ones up, at-mean ones stay
            want = before[l] + rate * np.sign(load[l].mean() - load[l]).astype(np.float32)
            got = np.asarray(after.model.layers[l].mlp.bias[...])
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-7, err_msg=f"layer {l}")
            moved += int((before[l] != 0).any())
    assert moved == len(moe_layers)                                       # the second step started off zero


# Each family's tiny preset reduced to a few seconds of training: (arch overrides, MoE layers, has a bias).
REDUCED = {
    "qwen3_moe": ({"num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
                   "num_experts": 8, "moe_intermediate_size": 16}, 1, False),
    "mixtral": ({"num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "num_local_experts": 8,
                 "intermediate_size": 16}, 2, False),
    "olmoe": ({"num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2, "num_experts": 8,
               "intermediate_size": 16}, 2, False),
    "glm4_moe": ({"num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
                  "n_routed_experts": 8, "n_group": 2, "topk_group": 1, "moe_intermediate_size": 16}, 1, True),
    "qwen2_moe": ({"num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "num_experts": 8,
                   "moe_intermediate_size": 16, "shared_expert_intermediate_size": 16}, 1, False),
    "gpt_oss": ({"num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
                 "num_local_experts": 8, "intermediate_size": 16, "sliding_window": 8}, 2, False),
    "qwen3_next": ({"num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
                    "num_experts": 8, "moe_intermediate_size": 16, "shared_expert_intermediate_size": 16,
                    "linear_num_key_heads": 1, "linear_num_value_heads": 2, "linear_key_head_dim": 16,
                    "linear_value_head_dim": 16, "layer_types": ["linear_attention", "full_attention"]}, 2, False),
    "deepseek_v32": ({"num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2, "q_lora_rank": 16,
                      "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 8,
                      "n_routed_experts": 8, "n_group": 2, "topk_group": 1, "moe_intermediate_size": 16,
                      "index_n_heads": 2, "index_head_dim": 16, "index_topk": 16}, 1, True),
    "glm_moe_dsa": ({"num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2, "q_lora_rank": 16,
                     "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 8,
                     "n_routed_experts": 8, "moe_intermediate_size": 16, "index_n_heads": 2, "index_head_dim": 16,
                     "index_topk": 16, "indexer_types": ["full", "full"]}, 1, True),
    "qwen3_5_moe": ({"num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
                     "num_experts": 8, "moe_intermediate_size": 16, "shared_expert_intermediate_size": 16,
                     "linear_num_key_heads": 1, "linear_num_value_heads": 2, "linear_key_head_dim": 16,
                     "linear_value_head_dim": 16, "layer_types": ["linear_attention", "full_attention"]}, 2, False),
    "kimi_k25": ({"num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2, "q_lora_rank": 16,
                  "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 8,
                  "n_routed_experts": 8, "moe_intermediate_size": 16}, 1, True),
}


@pytest.mark.parametrize("family", [f if f == "qwen3_moe" else pytest.param(f, marks=pytest.mark.slow)
                                    for f in REDUCED])
def test_each_family_trains_and_loads_in_transformers(tmp_path, family):
    """arch.family=FAMILY on a reduced budget (Qwen3-MoE in the default run, every family with -m slow):
    the family's model, balanced as it trains (bias steps with a balance bias, else the balance loss
    at 0.01), the loss falls, and transformers' class for the family loads the result with the
    held-out loss train_tiny recorded."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")

    overrides, n_moe, has_bias = REDUCED[family]
    s = settings(tmp_path / family, steps=12)
    s["arch"] = {"family": family, "hidden_size": 32, "intermediate_size": 64, "num_experts_per_tok": 2,
                 "max_position_embeddings": 64, **overrides}
    s["train"] = {**s["train"], "eval_every": 0, "checkpoint_every": 12, "decay_steps": 12}
    cfg = tt.Config.from_mapping(s)
    assert cfg.balance_loss_alpha == (0.0 if has_bias else 0.01) and len(cfg.model_config().moe_layers) == n_moe
    df, _ = tt.run(cfg)
    loss = metric(df, "train_loss")
    assert loss.value.tail(3).mean() < loss.value.head(3).mean() - 0.5
    assert ("bias_min" in set(df.metric)) == has_bias and len(metric(df, "max_load_share")) == n_moe
    record = json.loads((Path(cfg.path) / tt.RECORD).read_text())
    assert record["family"] == family and record["config"]["train"]["aux_loss_alpha"] == cfg.balance_loss_alpha
    from family_fixtures import TRANSFORMERS_ARCHITECTURE

    architecture = json.loads((Path(cfg.path) / "config.json").read_text())["architectures"][0]
    hf_class = getattr(transformers, TRANSFORMERS_ARCHITECTURE.get(family, architecture))
    hf = hf_class.from_pretrained(cfg.path, dtype=torch.float32, attn_implementation="eager",
                                  experts_implementation="eager").eval()
    ids = build_corpus(cfg).heldout_ids
    with torch.no_grad():
        logp = torch.log_softmax(hf(torch.as_tensor(ids, dtype=torch.long)).logits.float()[:, :-1], -1)
        hf_loss = -logp.gather(-1, torch.as_tensor(ids[:, 1:, None], dtype=torch.long)).mean().item()
    assert hf_loss == pytest.approx(record["heldout_loss"], rel=1e-4)


NOT_TRAINED = {"deepseek_v4"}   # refused by name: a fresh model's hash tables are zeros (PASSES_NOT_IMPLEMENTED)


@pytest.mark.parametrize("family", ["deepseek_v3", *REDUCED, *NOT_TRAINED])
def test_every_family_has_a_tiny_preset(family):
    """train_tiny accepts every registered family it can train: its TINY preset builds the family's
    config (every key checked by the family's class) and model shapes, with the byte-level
    vocabulary; a family it cannot train is refused by name before any work."""
    import jax.numpy as jnp
    from flax import nnx

    from moejax.hf.auto import AutoModelForCausalLM
    from moejax.models.registry import FAMILIES

    assert set(REDUCED) | {"deepseek_v3"} | NOT_TRAINED == set(FAMILIES)
    if family in NOT_TRAINED:
        with pytest.raises(ConfigError, match=rf"^{FAMILIES[family].title}: training from scratch \(train_tiny\) "
                                                   "is not implemented for this family yet: a fresh model's hash"):
            tt.Config.from_mapping({"path": "unused", "arch": {"family": family}})
        return
    cfg = tt.Config.from_mapping({"path": "unused", "arch": {"family": family}})
    model_cfg = cfg.model_config()
    assert type(model_cfg) is FAMILIES[family].config_class and model_cfg.vocab_size == 256
    model = nnx.eval_shape(lambda: AutoModelForCausalLM.from_config(model_cfg, jnp.float32))
    assert model.model.embed_tokens.shape == (256, model_cfg.hidden_size)


def test_several_seeds_in_one_job_equal_single_seed_runs(tmp_path):
    """seeds=2 trains seeds 3 and 4 in two processes, one per core, each at <model.path>/seed-<k>;
    each equals the ordinary single-seed run of its seed (this process, both cores) within float32
    reordering. (Run on one core, as the workers are, the single-seed run is byte-identical:
    docs/benchmarks.md shows it with taskset.) The two seeds differ from each other far more."""
    from safetensors.numpy import load_file

    def cfg(path, **top):
        s = settings(path, steps=6, eval_every=3, checkpoint_every=6, decay_steps=6, micro_batches=2)
        s["data"].update(seq_len=48, mix={"code": 0.5, "sort": 0.5}, skill_eval_docs=2, skill_bytes=20_000)
        return tt.Config.from_mapping({**s, **top})

    df, timings = tt.run(cfg(tmp_path / "multi", seed=3, seeds=2))
    assert sorted(df.seed.unique()) == [3, 4] and timings["workers"] == 2
    assert timings["train_flops"] > 0 and timings["dense_gflops"] > 0
    curves = df[df.metric == "skill_exact_match"]
    assert sorted(curves.step.unique()) == [3, 6] and set(curves.seed) == {3, 4}
    weights = {}
    for k in (3, 4):
        single = tmp_path / f"single-{k}"
        tt.run(cfg(single, seed=k))
        a, b = load_file(tmp_path / "multi" / f"seed-{k}" / "model.safetensors"), load_file(single / "model.safetensors")
        assert a.keys() == b.keys()
        for name in a:
            np.testing.assert_allclose(a[name], b[name], rtol=0, atol=1e-4 * np.abs(b[name]).max(), err_msg=name)
        record = json.loads((tmp_path / "multi" / f"seed-{k}" / tt.RECORD).read_text())
        assert record["config"]["seed"] == k
        weights[k] = a
    apart = max(np.abs(weights[3][n] - weights[4][n]).max() / np.abs(weights[3][n]).max() for n in weights[3])
    assert apart > 0.1
    table = tt.summary_table(df)
    assert list(table.columns) == ["seed 3", "seed 4"]


def test_several_seeds_refuse_a_checkpoint_as_their_folder(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    s = settings(tmp_path, steps=2)
    with pytest.raises(ConfigError, match="holds a checkpoint"):
        tt.run(tt.Config.from_mapping({**s, "seeds": 2}))
    with pytest.raises(ConfigError, match=r"seeds=0; expected an integer >= 1"):
        tt.Config.from_mapping({**s, "seeds": 0})
