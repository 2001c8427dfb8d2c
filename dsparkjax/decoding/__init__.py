"""Decoding: the device programs (program.py), the Decoder that compiles and runs them (decoder.py), the
step-level Engine (engine.py), and `generate` / `forward` built on them; the proposer protocol and the DSpark
drafter (proposer.py) and the width policy (width.py). docs/decoding.md is the design note."""
