"""Factories for the command line: each returns ``(model, example_inputs, example_kwargs)`` at the test size.

    planner plan examples/factories.py:gpt2 --budget 50% -o plan.json
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a file by the CLI

from examples.common import build_example  # noqa: E402


def _factory(name: str):
    def build():
        example = build_example(name, size="test")
        return example.model, example.example_inputs, example.example_kwargs
    build.__name__ = name
    build.__doc__ = f"The {name} example at the test size, as (model, example_inputs, example_kwargs)."
    return build


largeblock = _factory("largeblock")
gpt2 = _factory("gpt2")
llama = _factory("llama")
resnet = _factory("resnet")
unet = _factory("unet")
