"""Example models for the activation-checkpointing planner.

Each of ``examples.largeblock``, ``examples.gpt2``, ``examples.llama``,
``examples.resnet`` and ``examples.unet`` exposes ``build(size="test", seed=0)``
returning an :class:`examples.common.Example`; each also runs as a script
(``python -m examples.gpt2``) doing three AdamW steps at the "demo" size.
"""

from examples.common import EXAMPLES, SIZES, Example, build_example

__all__ = ["EXAMPLES", "SIZES", "Example", "build_example"]
