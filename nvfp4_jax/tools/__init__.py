"""Tools: what a model runs (`report`), which layers are sensitive
(`sensitivity`), packed export (`export`, `safetensors`), compiling for a
GPU that is not here (`aot`), and checking this GPU (`check_device`, the
`nvfp4-check-device` command: its speed tables in `speed`, its clocks in
`timing`, the kernels' SASS in `sass_report`)."""
