"""Constant attention masks handed back to the kernel as ``is_causal`` or no mask (planner.masks)."""

import pytest
import torch

from planner.capture import capture
from planner.masks import SDPA, ImpliedMask, drop_constant_masks, implied_mask, sdpa_arguments

F = torch.nn.functional


def _attention_calls(graph_module):
    return [sdpa_arguments(n) for n in graph_module.graph.nodes if sdpa_arguments(n) is not None]


def _exported(model, *args):
    return torch.export.export(model, args, strict=False).module()


class MaskedAttention(torch.nn.Module):
    """Attention with the mask ``make_mask(length, x)`` builds; ``also_return`` hands the mask out too."""

    def __init__(self, make_mask, also_return=False):
        super().__init__()
        self.make_mask, self.also_return = make_mask, also_return
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x):
        mask = self.make_mask(x.shape[-2], x)
        h = self.proj(x)
        out = F.scaled_dot_product_attention(h, h, h, attn_mask=mask)
        return (out, mask) if self.also_return else out


def _causal(length, x):
    return torch.ones(length, length, dtype=torch.bool).tril()


def _additive_causal(length, x):
    return torch.full((length, length), float("-inf")).triu(1)


def _everything(length, x):
    return torch.ones(x.shape[0], 1, length, length, dtype=torch.bool)


def _window(length, x):  # causal, two keys back: a constant, but no kernel flag says it
    rows, columns = torch.arange(length)[:, None], torch.arange(length)[None, :]
    return (columns <= rows) & (columns > rows - 3)


def _padding(length, x):  # read from the input's values: not a constant
    return (x[:, :, :, :1] > -10).expand(-1, -1, -1, length)


def _drawn(length, x):  # causal whatever it draws, but dropping the draw would move the generator
    return _causal(length, x) & (torch.rand(length, length) >= 0)


@pytest.mark.parametrize("make_mask,implied", [(_causal, ImpliedMask.CAUSAL), (_additive_causal, ImpliedMask.CAUSAL),
                                               (_everything, ImpliedMask.EVERY_KEY)])
def test_a_constant_causal_or_see_everything_mask_becomes_the_kernel_flag_and_computes_the_same(make_mask, implied):
    model, x = MaskedAttention(make_mask), torch.randn(2, 2, 16, 8)
    graph_module = _exported(model, x)
    assert drop_constant_masks(graph_module) == 1
    (call,) = _attention_calls(graph_module)
    assert call["attn_mask"] is None and call["is_causal"] is (implied is ImpliedMask.CAUSAL)
    assert [n.target for n in graph_module.graph.nodes if n.op == "call_function"][-1] is SDPA  # builders erased
    assert sum(n.op == "call_function" for n in graph_module.graph.nodes) == 2  # linear and attention
    torch.testing.assert_close(graph_module(x), model(x), rtol=0, atol=1e-6)


def test_masks_that_are_not_constant_or_say_something_else_stay():
    x = torch.randn(2, 2, 16, 8)
    for make_mask in (_window, _padding, _drawn):
        graph_module = _exported(MaskedAttention(make_mask), x)
        before = len(graph_module.graph.nodes)
        assert drop_constant_masks(graph_module) == 0, make_mask.__name__
        assert len(graph_module.graph.nodes) == before
        assert _attention_calls(graph_module)[0]["attn_mask"] is not None


def test_a_mask_held_as_a_buffer_stays():
    class Buffered(MaskedAttention):
        def __init__(self):
            super().__init__(None)
            self.register_buffer("visible", torch.ones(16, 16, dtype=torch.bool).tril())

        def forward(self, x):
            h = self.proj(x)
            return F.scaled_dot_product_attention(h, h, h, attn_mask=self.visible)

    graph_module = _exported(Buffered(), torch.randn(2, 2, 16, 8))
    assert drop_constant_masks(graph_module) == 0  # the caller may change a buffer between steps


def test_a_mask_something_else_reads_keeps_the_ops_that_build_it():
    model, x = MaskedAttention(_causal, also_return=True), torch.randn(2, 2, 16, 8)
    graph_module = _exported(model, x)
    assert drop_constant_masks(graph_module) == 1
    out, mask = graph_module(x)
    assert torch.equal(mask, _causal(16, x))
    torch.testing.assert_close(out, model(x)[0], rtol=0, atol=1e-6)


def test_implied_mask_broadcasts_and_refuses_what_does_not_broadcast():
    causal = torch.ones(5, 7, dtype=torch.bool).tril()  # more keys than queries: tril from the top left
    assert implied_mask(causal, 5, 7) is ImpliedMask.CAUSAL
    assert implied_mask(causal, 7, 5) is None
    assert implied_mask(torch.ones(3, dtype=torch.bool), 4, 4) is None
    assert implied_mask(torch.zeros(4, 4, dtype=torch.long), 4, 4) is None


def test_hugging_face_gpt2_runs_its_attention_as_written_and_trains_bit_for_bit():
    """Exported, GPT-2 builds its causal mask from ``arange`` (27 ops a step) and hands it to the kernel; the
    captured graph calls it with ``is_causal`` as the model does, and its loss and gradients are the model's."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=4,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(config).train()
    ids = torch.randint(0, 64, (2, 32))
    captured = capture(model, (ids,), {"labels": ids})
    calls = _attention_calls(captured.graph_module)
    assert len(calls) == 2 and all(c["attn_mask"] is None and c["is_causal"] for c in calls)
    assert not any(n.target is torch.ops.aten.le.Tensor for n in captured.compute_nodes())
    graph_loss = captured.graph_module(ids, labels=ids).loss
    graph_loss.backward()
    graph_grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    loss = model(ids, labels=ids).loss
    loss.backward()
    assert torch.equal(graph_loss, loss)
    assert all(torch.equal(graph_grads[name], p.grad) for name, p in model.named_parameters())


def test_padding_given_as_an_input_keeps_its_mask():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=1, n_head=4)
    ids = torch.randint(0, 64, (2, 32))
    captured = capture(transformers.GPT2LMHeadModel(config).train(), (ids,),
                       {"attention_mask": torch.ones_like(ids), "labels": ids})
    assert all(c["attn_mask"] is not None for c in _attention_calls(captured.graph_module))


def test_a_graph_captured_on_meta_works_its_mask_out_on_the_cpu():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=4, use_cache=False)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config).train()
    ids = torch.zeros(1, 64, dtype=torch.long, device="meta")
    captured = capture(model, (ids,), {"labels": ids}, replay_dropout=False)
    calls = _attention_calls(captured.graph_module)
    assert len(calls) == 2 and all(c["attn_mask"] is None and c["is_causal"] for c in calls)
