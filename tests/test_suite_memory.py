"""The suite's own memory guard (conftest.py): what it clears when a test module ends must include the shared
cached models of model_helpers, or the programs they compiled would outlive their module."""

from __future__ import annotations

import conftest
import model_helpers


def test_the_shared_model_caches_are_cleared_with_the_compiled_programs():
    model_helpers.tiny_pair_paths()  # fills one cache cheaply (two small GGUF files, nothing compiled)
    assert model_helpers.tiny_pair_paths.cache_info().currsize >= 1
    conftest._clear_compiled_programs()
    assert model_helpers.tiny_pair_paths.cache_info().currsize == 0
    for cache in (model_helpers.tiny_target_model, model_helpers.tiny_pair_model):
        assert conftest.is_program_cache(cache), cache.__name__
