"""nvfp4-jax: training with NVIDIA's NVFP4 recipe in JAX and Flax."""

from nvfp4_jax.dispatch import default_implementation
from nvfp4_jax.fused import quantize_pair
from nvfp4_jax.fused import quantize_rht_t
from nvfp4_jax.fused import quantize_with_values
from nvfp4_jax.fused import quantize_x_and_rht_t
from nvfp4_jax.gemm import block_scaled_matmul
from nvfp4_jax.gemm import block_values_matmul
from nvfp4_jax.gemm import gemm_alpha
from nvfp4_jax.hadamard import default_sign_vector
from nvfp4_jax.hadamard import rht
from nvfp4_jax.hadamard import rht_matrix
from nvfp4_jax.hadamard import TE_SIGN_VECTOR_16
from nvfp4_jax.layers import NVFP4Dense
from nvfp4_jax.layers import NVFP4DotGeneral
from nvfp4_jax.layers import NVFP4Einsum
from nvfp4_jax.layers import NVFP4Linear
from nvfp4_jax.layers import RNG_STREAM
from nvfp4_jax.layers import apply_rules
from nvfp4_jax.layers import nvfp4_layer_paths
from nvfp4_jax.ops import dot_general
from nvfp4_jax.optim import MasterWeightsState
from nvfp4_jax.optim import master_params
from nvfp4_jax.optim import master_weights
from nvfp4_jax.recipe import Operand
from nvfp4_jax.recipe import Recipe
from nvfp4_jax.rules import LateSwitch
from nvfp4_jax.rules import PrecisionRules
from nvfp4_jax.rules import paper_rules
from nvfp4_jax.rules import precision_rules
from nvfp4_jax.mx import MXArray
from nvfp4_jax.mx import quantize_mx
from nvfp4_jax.numerics import E2M1_MAX
from nvfp4_jax.numerics import E2M1_VALUES
from nvfp4_jax.numerics import E4M3_MAX
from nvfp4_jax.numerics import MX_BLOCK
from nvfp4_jax.numerics import NVFP4_BLOCK
from nvfp4_jax.numerics import e2m1_decode
from nvfp4_jax.numerics import pack_e2m1
from nvfp4_jax.numerics import unpack_e2m1
from nvfp4_jax.nvfp4 import NVFP4Array
from nvfp4_jax.nvfp4 import quantize
from nvfp4_jax.quant import block_dequantize
from nvfp4_jax.quant import dequantize

__version__ = "0.1.0"
