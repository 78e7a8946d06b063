"""Tools: what a model runs (`report`), which layers are sensitive
(`sensitivity`), packed export (`export`, `safetensors`), compiling for a
GPU that is not here (`aot`), and checking this GPU (`check_device`, the
`nvfp4-check-device` command: its speed tables in `speed`, its clocks in
`timing`, the kernels' SASS in `sass_report`)."""

# The public names are `nvfp4_jax`'s (`nvfp4_jax.__all__`, the API
# reference); this package's modules are listed for the reference's
# "Subpackages" section and for `from ... import *`.
__all__ = (
    "aot",
    "check_device",
    "export",
    "report",
    "safetensors",
    "sass_report",
    "sensitivity",
    "speed",
    "timing",
)
