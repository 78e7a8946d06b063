"""Example models built from `nvfp4_jax.NVFP4Dense`: an MLP and a GPT decoder."""

from models.gpt import GPT
from models.gpt import GPTConfig
from models.gpt import RopeScaling
from models.gpt import FUSED_LAYOUTS
from models.gpt import MLP_KINDS
from models.gpt import convert_fused_layout
from models.gpt import fused_permutation
from models.gpt import saved_fused_layout
from models.hf import config_from_hf
from models.hf import from_hf_tensors
from models.hf import hf_config
from models.hf import linear_layers
from models.hf import linear_rows
from models.hf import to_hf_tensors
from models.hf_export import calibrate
from models.hf_export import save_hf
from models.hf_import import load_hf
from models.mlp import MLP
from models.presets import PRESETS
from models.presets import format_count
from models.presets import param_count
from models.presets import preset
from models.presets import preset_table
