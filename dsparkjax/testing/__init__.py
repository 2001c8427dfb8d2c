"""Instruments for tests and benchmarks, not used by decoding itself: an oracle proposer, random packed
weights and mHC inputs, and device timing."""
