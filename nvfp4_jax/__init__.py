"""nvfp4-jax: training with NVIDIA's NVFP4 recipe in JAX and Flax.

The public API, grouped as `__all__` groups it: the Flax layers and the
switch of an unmodified model, the quantized arrays and ops, the training ops
and optimizer, the recipe and per-layer precision rules, sharding, the E2M1 /
E4M3 numerics and the tools.
"""

from nvfp4_jax import _compat

# The deprecated paths (nvfp4_jax.layers, nvfp4_jax.ops.dot_general, ...)
# still work for this release, each with a DeprecationWarning.
_compat.install()

# pylint: disable=g-importing-member,g-bad-import-order

# Layers (Flax linen and NNX) and the switch of an unmodified model.
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

# Quantized arrays.
from nvfp4_jax.core.arrays import MXArray
from nvfp4_jax.core.arrays import NVFP4Array
from nvfp4_jax.core.arrays import NVFP4Values

# Ops: quantizers, the RHT, block values and GEMMs (`implementation=`).
from nvfp4_jax.core.dispatch import default_implementation
from nvfp4_jax.core.hadamard import default_sign_vector
from nvfp4_jax.core.hadamard import rht
from nvfp4_jax.core.hadamard import rht_matrix
from nvfp4_jax.ops.block_scaled_matmul.api import block_scaled_matmul
from nvfp4_jax.ops.block_scaled_matmul.api import block_values_matmul
from nvfp4_jax.ops.block_scaled_matmul.reference import gemm_alpha
from nvfp4_jax.ops.block_values.api import block_dequantize
from nvfp4_jax.ops.block_values.api import dequantize
from nvfp4_jax.ops.quantize.api import quantize
from nvfp4_jax.ops.quantize.api import quantize_with_values
from nvfp4_jax.ops.quantize.mx import quantize_mx
from nvfp4_jax.ops.quantize_pair.api import quantize_pair
from nvfp4_jax.ops.quantize_pair.api import quantize_x_and_rht_t
from nvfp4_jax.ops.quantize_rht_t.api import quantize_rht_t
from nvfp4_jax.ops.weight_only_matmul.api import weight_only_matmul

# Training: the quantized GEMMs' custom VJPs, remat and FP32 master weights.
from nvfp4_jax.training.dot_general import dot_general
from nvfp4_jax.training.names import remat_policy
from nvfp4_jax.training.master_weights import MasterWeightsState
from nvfp4_jax.training.master_weights import master_params
from nvfp4_jax.training.master_weights import master_weights
from nvfp4_jax.training.ragged_dot import ragged_dot

# Recipe and per-layer precision rules.
from nvfp4_jax.core.recipe import Operand
from nvfp4_jax.core.recipe import Recipe
from nvfp4_jax.flax.rules import LateSwitch
from nvfp4_jax.flax.rules import PrecisionRules
from nvfp4_jax.flax.rules import paper_rules
from nvfp4_jax.flax.rules import precision_rules

# Sharding: device meshes, per-layer shardings.
from nvfp4_jax import sharding
from nvfp4_jax.sharding import LinearSharding
from nvfp4_jax.sharding import MeshRules
from nvfp4_jax.sharding import mesh_rules

# Numerics: the E2M1 / E4M3 constants and codecs.
from nvfp4_jax.core.hadamard import TE_SIGN_VECTOR_16
from nvfp4_jax.core.numerics import E2M1_MAX
from nvfp4_jax.core.numerics import E2M1_VALUES
from nvfp4_jax.core.numerics import E4M3_MAX
from nvfp4_jax.core.numerics import MX_BLOCK
from nvfp4_jax.core.numerics import NVFP4_BLOCK
from nvfp4_jax.core.numerics import e2m1_decode
from nvfp4_jax.core.numerics import pack_e2m1
from nvfp4_jax.core.numerics import unpack_e2m1

# Tools: what ran (report), packed export.
from nvfp4_jax.tools import export
from nvfp4_jax.tools.report import Gemm
from nvfp4_jax.tools.report import Report
from nvfp4_jax.tools.report import compiled_report
from nvfp4_jax.tools.report import report

# pylint: enable=g-importing-member,g-bad-import-order

__version__ = "0.1.0"

__all__ = (
    # Layers (Flax linen and NNX) and the switch of an unmodified model.
    "NNXDotGeneral",
    "NNXEinsumOp",
    "NNXMoE",
    "NVFP4Dense",
    "NVFP4DotGeneral",
    "NVFP4Einsum",
    "NVFP4Linear",
    "NVFP4MoE",
    "RNG_STREAM",
    "apply_rules",
    "inject_linen",
    "inject_nnx",
    "nvfp4_layer_paths",
    # Quantized arrays.
    "MXArray",
    "NVFP4Array",
    "NVFP4Values",
    # Ops: quantizers, the RHT, block values and GEMMs (`implementation=`).
    "block_dequantize",
    "block_scaled_matmul",
    "block_values_matmul",
    "default_implementation",
    "default_sign_vector",
    "dequantize",
    "gemm_alpha",
    "quantize",
    "quantize_mx",
    "quantize_pair",
    "quantize_rht_t",
    "quantize_with_values",
    "quantize_x_and_rht_t",
    "rht",
    "rht_matrix",
    "weight_only_matmul",
    # Training: the quantized GEMMs' custom VJPs, remat and FP32 master
    # weights.
    "MasterWeightsState",
    "dot_general",
    "master_params",
    "master_weights",
    "ragged_dot",
    "remat_policy",
    # Recipe and per-layer precision rules.
    "LateSwitch",
    "Operand",
    "PrecisionRules",
    "Recipe",
    "paper_rules",
    "precision_rules",
    # Sharding: device meshes, per-layer shardings.
    "LinearSharding",
    "MeshRules",
    "mesh_rules",
    "sharding",
    # Numerics: the E2M1 / E4M3 constants and codecs.
    "E2M1_MAX",
    "E2M1_VALUES",
    "E4M3_MAX",
    "MX_BLOCK",
    "NVFP4_BLOCK",
    "TE_SIGN_VECTOR_16",
    "e2m1_decode",
    "pack_e2m1",
    "unpack_e2m1",
    # Tools: what ran (report), packed export.
    "Gemm",
    "Report",
    "compiled_report",
    "export",
    "report",
)


# `nv.layers`, `nv.gemm`, ...: the deprecated modules, as attributes.
__getattr__ = _compat.module_getattr(__name__)
