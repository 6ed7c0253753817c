"""The import graph of `moejax/` (issue 31): every `import` and `from ... import` of a moejax module,
at module level or inside a function, is an edge, read from the source with `ast` (nothing is
imported; a package's `__init__`, which Python runs before any module below it, is an edge only
where it is imported by name). There is no cycle, and a new one fails here by name. The models are
a layer: nothing under `moejax/models/` imports a moejax module outside `MODELS_MAY_IMPORT` (the
loader `moejax.hf.model_io` imports the model, generation takes it as an argument, never the
reverse). The whole package is a house of floors (`FLOORS`): every module sits in exactly one room,
and no import runs up to a higher floor."""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "moejax"
# What the models stand on: their own package, the MoE layer (routing, dispatch, expert maps), the
# errors and the mesh; the checkpoint loader, evaluation, variants, scoring and commands are above.
MODELS_MAY_IMPORT = ("moejax.models", "moejax.moe", "moejax.errors", "moejax.parallel")


def modules() -> dict:
    out = {}
    for f in ROOT.rglob("*.py"):
        parts = f.relative_to(ROOT.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


def import_graph() -> dict:
    mods = modules()

    def resolve(name):
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph = {m: set() for m in mods}
    for m, f in mods.items():
        package = m if f.name == "__init__.py" else m.rpartition(".")[0]
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            else:
                continue
            graph[m] |= {t for t in map(resolve, (t for t in targets if t.startswith("moejax"))) if t and t != m}
    return graph


def cycles(graph: dict) -> set:
    """The strongly connected components of more than one module (Tarjan, iteratively)."""
    index, low, on, stack, found, counter = {}, {}, set(), [], set(), [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = set()
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.add(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        found.add(frozenset(comp))
    return found


def test_no_import_cycle():
    found = sorted(sorted(c) for c in cycles(import_graph()))
    assert not found, f"import cycles in moejax/ (function-level imports count): {found}"


def test_the_cycle_finder_finds_a_planted_cycle():
    graph = import_graph()
    graph["moejax.hf.io.storage"].add("moejax.hf.io.location")   # location imports storage (and remote, which does too)
    assert frozenset({"moejax.hf.io.storage", "moejax.hf.io.location", "moejax.hf.io.remote"}) in cycles(graph)
    assert "moejax.hf.io.location" in graph["moejax.hf.io.checkpoint_reader"]   # a module-level import
    assert "moejax.hf.io.remote" in graph["moejax.hf.io.location"]              # one inside a function


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def upward_imports(graph: dict) -> list:
    """(module under moejax.models, moejax module it imports outside MODELS_MAY_IMPORT), sorted."""
    return sorted((m, t) for m, targets in graph.items() if _within(m, "moejax.models") for t in targets
                  if not any(_within(t, allowed) for allowed in MODELS_MAY_IMPORT))


def test_models_import_nothing_above_them():
    found = upward_imports(import_graph())
    assert not found, (f"moejax/models/ imports above its layer (function-level imports count; allowed: "
                       f"{MODELS_MAY_IMPORT}): {found}")


def test_the_layer_check_finds_a_planted_upward_import():
    graph = import_graph()
    graph["moejax.models.causal_lm"].add("moejax.hf.model_io")   # from_pretrained as a method, once
    graph["moejax.models.qwen3_moe.model"].add("moejax")          # `from moejax import ...`: the root is above too
    assert upward_imports(graph) == [("moejax.models.causal_lm", "moejax.hf.model_io"),
                                     ("moejax.models.qwen3_moe.model", "moejax")]
    assert "moejax.moe.dispatch" in graph["moejax.models.layers"]   # an edge it allows is still an edge


# The house, lowest floor first. A room is a package (it and every module below it) or a module;
# the room `moejax` is the package face, `moejax/__init__.py`, alone. A module may import its own
# floor (rooms beside each other may import one another) and every floor below; an import up a
# floor fails `test_no_import_runs_up_a_floor`, naming both modules and both floors. A new module
# under a room is placed already; a new room must be added here.
FACE = "moejax"
FLOORS = (
    # 1: errors, the kill switch, the typed settings' refusals
    ("moejax.errors", "moejax.signals", "moejax.settings_check"),
    # 2: routing and dispatch, result files, the mesh, host buffers, settings registries
    ("moejax.moe", "moejax.results", "moejax.parallel", "moejax.host_memory", "moejax.registry"),
    # 3: the model families (on moe)
    ("moejax.models",),
    # 4: checkpoints and the loader (which imports the model)
    ("moejax.hf",),
    # 5: text and tokenizers (read through hf.io.staging); running a model (stream, nll, generate);
    #    the package face, whose lazy attributes are hf's loaders and the models' registry
    ("moejax.data", "moejax.inference", FACE),
    # 6: train_tiny (its loss is inference's nll, its skill match inference's generate)
    ("moejax.training",),
    # 7: scores and the calibration pass (on inference.stream), data-free statistics; the allocations
    #    (pure rules over per-layer statistics and a caller's fitness)
    ("moejax.scoring", "moejax.allocation"),
    # 8: VariantSpec, VariantPlan (kept sets from scoring.select)
    ("moejax.variants",),
    # 9: the merge methods (a merge's router forms from variants.spec)
    ("moejax.merging",),
    # 10: the carried pass, the lm-eval backend, the offline tasks
    ("moejax.evaluation",),
    # 11: the checkpoint commands; the experiments
    ("moejax.surgery", "moejax.experiments"),
    # 12: the entry points
    ("moejax.cli", "moejax.run"),
)


def rooms_of(module: str, floors=FLOORS) -> list:
    """[(floor, room)] of every room that holds `module` (floors numbered from 1): one, if placed."""
    return [(n, room) for n, rooms in enumerate(floors, 1) for room in rooms
            if module == room or (room != FACE and module.startswith(room + "."))]


def misplaced(graph: dict, floors=FLOORS) -> list:
    """(module, its rooms) for every module in no room or in several, sorted."""
    return sorted((m, [room for _, room in rooms_of(m, floors)]) for m in graph if len(rooms_of(m, floors)) != 1)


def upward(graph: dict, floors=FLOORS) -> list:
    """(importing module, its floor, imported module, its floor) for every import that runs up a
    floor, sorted. Modules in no room or several are left to `misplaced`."""
    floor = {m: rooms[0][0] for m in graph if len(rooms := rooms_of(m, floors)) == 1}
    return sorted((m, floor[m], t, floor[t]) for m, targets in graph.items() for t in targets
                  if m in floor and t in floor and floor[t] > floor[m])


def test_every_module_has_one_room():
    graph = import_graph()
    found = misplaced(graph)
    assert not found, ("moejax modules in no room of FLOORS, or in several (add the new room to a floor "
                       f"in tests/test_import_graph.py): {found}")
    empty = [room for rooms in FLOORS for room in rooms if room not in graph]
    assert not empty, f"rooms of FLOORS that are no moejax module or package (moved or removed?): {empty}"


def test_no_import_runs_up_a_floor():
    found = upward(import_graph())
    assert not found, ("imports that run up a floor of FLOORS (function-level imports count; move the helper "
                       "down to where its users are):\n" + "\n".join(
                           f"  {m} (floor {a}) imports {t} (floor {b})" for m, a, t, b in found))


def test_the_floor_check_finds_a_planted_upward_import():
    graph = import_graph()
    graph["moejax.training.config"].add("moejax.experiments")      # the settings check back in experiments
    graph["moejax.hf.model_io"].add(FACE)                           # `from moejax import ...` in the loader
    graph["moejax.scoring.observe"].add("moejax.evaluation.carried")
    assert upward(graph) == [("moejax.hf.model_io", 4, "moejax", 5),
                             ("moejax.scoring.observe", 7, "moejax.evaluation.carried", 10),
                             ("moejax.training.config", 6, "moejax.experiments", 11)]
    # what it allows is still an edge: beside on one floor, and down
    assert "moejax.errors" in graph["moejax.settings_check"] and "moejax.hf.io.staging" in graph["moejax.data"]
    assert "moejax.inference.stream" in graph["moejax.scoring.observe"]


def test_the_room_check_finds_a_planted_unplaced_module():
    graph = import_graph()
    graph["moejax.kitchen"] = {"moejax.errors"}                      # a new top-level module, in no room
    assert misplaced(graph) == [("moejax.kitchen", [])]
    assert upward(graph) == []                                       # an unplaced module is not a floor violation
    with_a_nested_room = FLOORS + (("moejax.hf.io",),)               # a room inside another room
    assert ("moejax.hf.io.storage", ["moejax.hf", "moejax.hf.io"]) in misplaced(graph, with_a_nested_room)
    assert rooms_of(FACE) == [(5, FACE)] and rooms_of("moejax.results") == [(2, "moejax.results")]


# The modules that import no JAX (nor flax, optax, orbax): `import moejax` and `moejax.results`
# (a notebook loads a sweep without JAX), the commands' parsers (`moejax.cli`, `moejax.run`: --help and
# the sweep controller), the experiments' configs and runner (Hydra composes and validates before a job
# asks for devices), the model configs, families and presets, the checkpoint files (`moejax.hf.io`,
# `quant`, the name maps) and the checkpoint tools' modules, which import JAX inside the job. A lazy
# import in one of these is the guarantee; everywhere else imports sit at module level.
JAX_FREE = (
    "moejax",
    "moejax.cli",
    "moejax.data",
    "moejax.errors",
    "moejax.host_memory",
    "moejax.evaluation", "moejax.evaluation.carried_rows", "moejax.evaluation.chat_template",
    "moejax.evaluation.routing_table", "moejax.evaluation.skills_tasks", "moejax.evaluation.tasks",
    "moejax.experiments", "moejax.experiments.eval_tasks", "moejax.experiments.prune_real",
    "moejax.experiments.settings",
    "moejax.experiments.runner", "moejax.experiments.score", "moejax.experiments.toy3",
    "moejax.experiments.toy3.config", "moejax.experiments.toy3.draw", "moejax.experiments.toy3.eq6",
    "moejax.experiments.toy3.host", "moejax.experiments.toy3.job", "moejax.experiments.toy3.results",
    "moejax.experiments.toy3.stage_one", "moejax.experiments.toy3.stage_two",
    "moejax.experiments.toy3.variants", "moejax.experiments.train_tiny",
    "moejax.hf", "moejax.hf.auto", "moejax.hf.check", "moejax.hf.fused_experts", "moejax.hf.io",
    "moejax.hf.io.checkpoint_reader", "moejax.hf.io.checkpoint_writer", "moejax.hf.io.location",
    "moejax.hf.io.remote", "moejax.hf.io.safetensors_format", "moejax.hf.io.staging", "moejax.hf.io.storage",
    "moejax.hf.keep_map", "moejax.hf.keep_map_formats",
    "moejax.hf.layout", "moejax.hf.mapping", "moejax.hf.provenance", "moejax.hf.quant",
    "moejax.hf.quant.decode", "moejax.hf.quant.encode", "moejax.hf.substitution",
    "moejax.inference",
    "moejax.allocation", "moejax.allocation.method", "moejax.allocation.threshold",
    "moejax.merging", "moejax.merging.average", "moejax.merging.clusters",
    "moejax.merging.method", "moejax.merging.ream",
    "moejax.models", "moejax.models.config_base", "moejax.models.deepseek_v3",
    "moejax.models.deepseek_v3.config", "moejax.models.deepseek_v3.names", "moejax.models.deepseek_v3.presets",
    "moejax.models.family", "moejax.models.glm4_moe", "moejax.models.glm4_moe.config",
    "moejax.models.glm4_moe.names", "moejax.models.glm4_moe.presets", "moejax.models.gqa_config",
    "moejax.models.gqa_names", "moejax.models.mixtral", "moejax.models.mixtral.config",
    "moejax.models.mixtral.names", "moejax.models.mixtral.presets", "moejax.models.names",
    "moejax.models.olmoe", "moejax.models.olmoe.config", "moejax.models.olmoe.names",
    "moejax.models.olmoe.presets", "moejax.models.qwen2_moe", "moejax.models.qwen2_moe.config",
    "moejax.models.qwen2_moe.names", "moejax.models.qwen2_moe.presets", "moejax.models.qwen3_moe",
    "moejax.models.qwen3_moe.config", "moejax.models.qwen3_moe.names", "moejax.models.qwen3_moe.presets",
    "moejax.models.gpt_oss", "moejax.models.gpt_oss.config", "moejax.models.gpt_oss.names",
    "moejax.models.gpt_oss.presets", "moejax.models.qwen3_next", "moejax.models.qwen3_next.config",
    "moejax.models.qwen3_next.names", "moejax.models.qwen3_next.presets", "moejax.models.qwen3_5_moe",
    "moejax.models.qwen3_5_moe.config", "moejax.models.qwen3_5_moe.names", "moejax.models.qwen3_5_moe.presets",
    "moejax.models.deepseek_v32", "moejax.models.deepseek_v32.config", "moejax.models.deepseek_v32.names",
    "moejax.models.deepseek_v32.presets", "moejax.models.glm_moe_dsa", "moejax.models.glm_moe_dsa.config",
    "moejax.models.glm_moe_dsa.names", "moejax.models.glm_moe_dsa.presets", "moejax.models.rope_settings",
    "moejax.models.registry", "moejax.models.variant",
    "moejax.moe",
    "moejax.parallel", "moejax.parallel.distributed", "moejax.parallel.mesh",
    "moejax.registry",
    "moejax.results",
    "moejax.run",
    "moejax.scoring", "moejax.scoring.data_free", "moejax.scoring.score_checkpoint", "moejax.scoring.scores",
    "moejax.scoring.select",
    "moejax.settings_check",
    "moejax.signals",
    "moejax.surgery", "moejax.surgery.diff", "moejax.surgery.inspect", "moejax.surgery.plan",
    "moejax.surgery.prune", "moejax.surgery.prune_keep_map", "moejax.surgery.prune_plan", "moejax.surgery.reroute", "moejax.surgery.substitute",
    "moejax.training", "moejax.training.checkpoints", "moejax.training.config", "moejax.training.corpus",
    "moejax.training.progress", "moejax.training.reroute_settings", "moejax.training.skill_match",
    "moejax.training.skills",
    "moejax.training.trainer",
    "moejax.variants", "moejax.variants.check", "moejax.variants.plan", "moejax.variants.spec",
)
JAX_MODULES = ("jax", "flax", "optax", "orbax")


def test_jax_free_modules_import_no_jax():
    code = ("import importlib, sys\n"
            "for name in sys.argv[1:]:\n"
            "    importlib.import_module(name)\n"
            f"    pulled = sorted(m for m in {JAX_MODULES!r} if m in sys.modules)\n"
            "    if pulled:\n"
            "        sys.exit(f'{name} imports {pulled}')\n")
    run = subprocess.run([sys.executable, "-c", code, *JAX_FREE], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr.strip().splitlines()[-1] if run.stderr.strip() else run.returncode


def test_the_jax_free_list_names_modules_that_exist():
    assert not set(JAX_FREE) - set(modules())
