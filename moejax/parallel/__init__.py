"""Device meshes and parameter sharding for expert parallelism (the "ep" dispatch backend).

    from moejax.parallel import MeshConfig, make_mesh, shard_model
    mesh = make_mesh(MeshConfig(expert=8))
    model = shard_model(model, mesh)            # routed experts split over "expert", rest replicated
    with jax.set_mesh(mesh):
        logits = model.jitted()(input_ids)
"""

from moejax.parallel.mesh import MeshConfig, make_mesh
from moejax.parallel.sharding import SHARDING_RULES, partition_specs, shard_model

__all__ = ["MeshConfig", "make_mesh", "SHARDING_RULES", "partition_specs", "shard_model"]
