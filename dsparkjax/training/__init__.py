"""Training the small shipped target + DSpark drafter pair (`scripts/train_tiny.py`).

Kept apart from inference: nothing under `dsparkjax/model`, `spec` or the loaders imports it. The losses run
the inference forward itself (`TargetModel.step`, `DrafterModel.block_hidden`) on parameters built by the
GGUF loaders from a dict of arrays keyed by GGUF tensor name (`params.ArraySource`), so the gradients are
those of the shipped forward and the trained dict is written with the GGUF writer as it is.
"""
