//! Checkpoints as safetensors: atomic writes, strict loads that name the offending tensor.
