"""Speculative decoding: the DSpark proposer, the width policy, and the propose/verify/accept/commit loop."""
