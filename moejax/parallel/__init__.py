"""Device meshes and parameter sharding for expert parallelism (the "ep" dispatch backend).

    from moejax.parallel import MeshConfig, make_mesh, shard_model
    mesh = make_mesh(MeshConfig(expert=8))
    model = shard_model(model, mesh)            # routed experts split over "expert", rest replicated
    with jax.set_mesh(mesh):
        logits = model.jitted()(input_ids).logits_BSV

Importing this package does not import JAX (the mesh config is read before JAX may start).
"""

from moejax.parallel.mesh import MeshConfig, make_mesh, mesh_context, request_cpu_devices

__all__ = ["MeshConfig", "make_mesh", "mesh_context", "request_cpu_devices", "SHARDING_RULES", "partition_specs",
           "shard_model"]


def __getattr__(name):
    if name in ("SHARDING_RULES", "partition_specs", "shard_model"):
        from moejax.parallel import sharding

        return getattr(sharding, name)
    raise AttributeError(name)
