"""nvfp4-jax: training with NVIDIA's NVFP4 recipe in JAX and Flax."""

from nvfp4_jax import _compat

_compat.install()  # Old module paths (nvfp4_jax.fused, ...) keep importing.

from nvfp4_jax.tools import export
from nvfp4_jax.core.dispatch import default_implementation
from nvfp4_jax.ops.quantize_pair.api import quantize_pair
from nvfp4_jax.ops.quantize_rht_t.api import quantize_rht_t
from nvfp4_jax.ops.quantize.api import quantize_with_values
from nvfp4_jax.ops.quantize_pair.api import quantize_x_and_rht_t
from nvfp4_jax.ops.block_scaled_matmul.api import block_scaled_matmul
from nvfp4_jax.ops.block_scaled_matmul.api import block_values_matmul
from nvfp4_jax.ops.block_scaled_matmul.reference import gemm_alpha
from nvfp4_jax.ops.weight_only_matmul.api import weight_only_matmul
from nvfp4_jax.core.hadamard import default_sign_vector
from nvfp4_jax.core.hadamard import rht
from nvfp4_jax.core.hadamard import rht_matrix
from nvfp4_jax.core.hadamard import TE_SIGN_VECTOR_16
from nvfp4_jax.flax.inject import inject_linen
from nvfp4_jax.flax.inject import inject_nnx
from nvfp4_jax.flax.linen import NVFP4Dense
from nvfp4_jax.flax.linen import NVFP4DotGeneral
from nvfp4_jax.flax.linen import NVFP4Einsum
from nvfp4_jax.flax.linen import RNG_STREAM
from nvfp4_jax.flax.linen import nvfp4_layer_paths
from nvfp4_jax.flax.moe import NNXMoE
from nvfp4_jax.flax.moe import NVFP4MoE
from nvfp4_jax.flax.nnx import NNXDotGeneral
from nvfp4_jax.flax.nnx import NNXEinsumOp
from nvfp4_jax.flax.nnx import NVFP4Linear
from nvfp4_jax.flax.nnx import apply_rules
from nvfp4_jax.training.dot_general import dot_general
from nvfp4_jax.training.ragged_dot import ragged_dot
from nvfp4_jax.training.names import remat_policy
from nvfp4_jax.training.master_weights import MasterWeightsState
from nvfp4_jax.training.master_weights import master_params
from nvfp4_jax.training.master_weights import master_weights
from nvfp4_jax.core.recipe import Operand
from nvfp4_jax.tools.report import Gemm
from nvfp4_jax.tools.report import Report
from nvfp4_jax.tools.report import report
from nvfp4_jax.tools.report import compiled_report
from nvfp4_jax.core.recipe import Recipe
from nvfp4_jax.flax.rules import LateSwitch
from nvfp4_jax.flax.rules import PrecisionRules
from nvfp4_jax.flax.rules import paper_rules
from nvfp4_jax.flax.rules import precision_rules
from nvfp4_jax import sharding
from nvfp4_jax.sharding import LinearSharding
from nvfp4_jax.sharding import MeshRules
from nvfp4_jax.sharding import mesh_rules
from nvfp4_jax.core.arrays import MXArray
from nvfp4_jax.ops.quantize.mx import quantize_mx
from nvfp4_jax.core.numerics import E2M1_MAX
from nvfp4_jax.core.numerics import E2M1_VALUES
from nvfp4_jax.core.numerics import E4M3_MAX
from nvfp4_jax.core.numerics import MX_BLOCK
from nvfp4_jax.core.numerics import NVFP4_BLOCK
from nvfp4_jax.core.numerics import e2m1_decode
from nvfp4_jax.core.numerics import pack_e2m1
from nvfp4_jax.core.numerics import unpack_e2m1
from nvfp4_jax.core.arrays import NVFP4Array
from nvfp4_jax.core.arrays import NVFP4Values
from nvfp4_jax.ops.quantize.api import quantize
from nvfp4_jax.ops.block_values.api import block_dequantize
from nvfp4_jax.ops.block_values.api import dequantize

__version__ = "0.1.0"


def __getattr__(name: str):
  # `nv.gemm`, `nv.fused`, ...: the old modules, as attributes (see _compat).
  old = f"nvfp4_jax.{name}"
  if old in _compat.MOVED or old in _compat.SPLIT:
    import importlib  # pylint: disable=g-import-not-at-top
    return importlib.import_module(old)
  raise AttributeError(f"module 'nvfp4_jax' has no attribute {name!r}")
