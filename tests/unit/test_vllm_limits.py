"""Tier 1: what the vLLM engine checks of image items before it hands them to vLLM, without
starting one (the engine itself: tests/integration/test_vllm_images.py)."""

import numpy as np
import pytest

from rayeval.config.schema import Generation, ModelSpec
from rayeval.core.backends.base import ImageRequest
from rayeval.core.backends.vllm import IMAGES_PER_PROMPT, Engine
from rayeval.errors import SpecError

pytest.importorskip("PIL")


def _engine(vllm: dict, chosen: int | None) -> Engine:
    import torch

    engine = Engine(ModelSpec(backend="vllm", vllm=vllm), 1, torch.device("cpu"), "t", {})
    engine._default_images = chosen          # what _start chose for a vision model
    return engine


def _request(n: int) -> ImageRequest:
    return ImageRequest("User:<image>" * n + " how many?", tuple(
        np.zeros((8, 8, 3), np.uint8) for _ in range(n)))


@pytest.mark.parametrize("vllm, chosen, limit", [
    ({}, IMAGES_PER_PROMPT, 1),
    ({"limit_mm_per_prompt": {"image": 3}}, None, 3),
    ({"limit_mm_per_prompt": {"image": {"count": 2}}}, None, 2),
])
def test_an_item_with_more_images_than_the_engine_takes_is_one_line(vllm, chosen, limit):
    engine = _engine(vllm, chosen)
    assert engine.images_per_prompt == limit
    with pytest.raises(SpecError) as info:
        engine.generate_images([_request(1), _request(limit + 1)], [10, 11],
                               Generation(max_new_tokens=2))
    message = str(info.value)
    assert message.startswith("model.vllm.limit_mm_per_prompt: item 11 has "
                              f"{limit + 1} images, more than the engine's {limit}")
    assert f"limit_mm_per_prompt: {{image: {limit + 1}}}" in message and "\n" not in message
