"""Tools: what a model runs (`report`), which layers are sensitive
(`sensitivity`), packed export (`export`, `safetensors`)."""
