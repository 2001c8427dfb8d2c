"""dsparkjax: DeepSeek-V4-Flash inference with exact DSpark speculative decoding in JAX."""
