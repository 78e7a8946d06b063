"""Training on a device mesh: what each axis splits (`MeshRules`), the
sharded quantizers, how a layer's GEMMs run on one shard (`per_shard`) and
where its operands live outside `shard_map` (`operands`), and what a
compiled program communicates (`hlo`).

    mesh = nvfp4_jax.sharding.make_mesh(data=2, fsdp=2, model=2)
    rules = nvfp4_jax.sharding.MeshRules(mesh=mesh)
    with nvfp4_jax.sharding.mesh_rules(rules):     # while tracing the step
      logits = model.apply(params, tokens)
"""

from nvfp4_jax.ops.quantize.sharded import quantize
from nvfp4_jax.ops.quantize_pair.sharded import quantize_pair
from nvfp4_jax.ops.quantize_rht_t.sharded import quantize_rht_t
from nvfp4_jax.sharding.hlo import Collective
from nvfp4_jax.sharding.hlo import collectives
from nvfp4_jax.sharding.mesh import AXES
from nvfp4_jax.sharding.mesh import GPT_TENSOR_PARALLEL
from nvfp4_jax.sharding.mesh import LinearSharding
from nvfp4_jax.sharding.mesh import MeshRules
from nvfp4_jax.sharding.mesh import TENSOR_STYLES
from nvfp4_jax.sharding.mesh import current_rules
from nvfp4_jax.sharding.mesh import linear_sharding_for
from nvfp4_jax.sharding.mesh import make_mesh
from nvfp4_jax.sharding.mesh import mesh_rules

__all__ = (
    # Meshes and what each axis splits.
    "make_mesh", "MeshRules", "mesh_rules", "current_rules", "AXES",
    "TENSOR_STYLES", "GPT_TENSOR_PARALLEL",
    # One layer's split.
    "LinearSharding", "linear_sharding_for",
    # The sharded quantizers.
    "quantize", "quantize_pair", "quantize_rht_t",
    # What a compiled program communicates.
    "collectives", "Collective",
)
