"""Tools: what a model runs (`report`), which layers are sensitive
(`sensitivity`), packed export (`export`, `safetensors`), compiling for a
GPU that is not here (`aot`)."""
