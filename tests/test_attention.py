"""Attention as the model runs it (planner.attention): constant masks handed back to the kernel as ``is_causal`` or
no mask, and repeated key/value heads as ``enable_gqa``."""

import pytest
import torch

from planner.attention import (SDPA, ImpliedMask, attention_calls, drop_constant_masks, group_repeated_heads,
                                implied_mask, kernel_shares_heads)
from planner.capture import capture

F = torch.nn.functional


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
    (call,) = attention_calls(graph_module)
    assert call["attn_mask"] is None and call["is_causal"] is (implied is ImpliedMask.CAUSAL)
    assert [n.target for n in graph_module.graph.nodes if n.op == "call_function"][-1] is SDPA  # builders erased
    assert sum(n.op == "call_function" for n in graph_module.graph.nodes) == 2  # linear and attention
    torch.testing.assert_close(graph_module(x), model(x), rtol=0, atol=1e-6)


@pytest.mark.parametrize("make_mask", [_causal, _everything])
def test_a_model_of_plain_pytorch_keeps_the_mask_it_builds_and_trains_as_eager_bit_for_bit(make_mask):
    """Only Hugging Face builds its mask because it is exported; other code builds it eagerly too, and the kernel
    may sum in another order without it (Falcon, whose code builds its mask eagerly, trains 7.5e-9 apart from eager
    once handed ``is_causal``; at this size the two agree), so the call stays as written."""
    model, x = MaskedAttention(make_mask), torch.randn(2, 2, 16, 8)
    captured = capture(model, (x,))
    (call,) = attention_calls(captured.graph_module)
    assert call["attn_mask"] is not None and not call["is_causal"]
    graph_grads = torch.autograd.grad(captured.graph_module(x).square().sum(), list(model.parameters()))
    eager_grads = torch.autograd.grad(model(x).square().sum(), list(model.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(graph_grads, eager_grads))


def test_masks_that_are_not_constant_or_say_something_else_stay():
    x = torch.randn(2, 2, 16, 8)
    for make_mask in (_window, _padding, _drawn):
        graph_module = _exported(MaskedAttention(make_mask), x)
        before = len(graph_module.graph.nodes)
        assert drop_constant_masks(graph_module) == 0, make_mask.__name__
        assert len(graph_module.graph.nodes) == before
        assert attention_calls(graph_module)[0]["attn_mask"] is not None


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
    calls = attention_calls(captured.graph_module)
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
    assert all(c["attn_mask"] is not None for c in attention_calls(captured.graph_module))


def _hugging_face(name: str, **fields):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config, model = {"gpt2": ("GPT2Config", "GPT2LMHeadModel"), "llama": ("LlamaConfig", "LlamaForCausalLM"),
                     "bert": ("BertConfig", "BertForMaskedLM")}[name]
    return getattr(transformers, model)(getattr(transformers, config)(**fields)).train()


def test_an_all_ones_mask_is_dropped_for_hugging_face_models_only():
    from planner.attention import without_unmasking_mask

    model = _hugging_face("gpt2", vocab_size=64, n_positions=32, n_embd=32, n_layer=1, n_head=4)
    ids = torch.randint(0, 64, (2, 32))
    ones, padded = torch.ones_like(ids), torch.ones_like(ids).index_fill_(1, torch.tensor([30, 31]), 0)
    assert without_unmasking_mask(model, {"input_ids": ids, "attention_mask": ones}).keys() == {"input_ids"}
    assert without_unmasking_mask(model, {"attention_mask": ones.bool()}) == {}
    assert without_unmasking_mask(model, {"attention_mask": padded})["attention_mask"] is padded
    assert without_unmasking_mask(model, {"attention_mask": None}) == {"attention_mask": None}
    assert without_unmasking_mask(torch.nn.Linear(2, 2), {"attention_mask": ones})["attention_mask"] is ones


HUGGING_FACE_CONFIGS = {  # no attention dropout, which capture spells out on the CPU: the kernel calls stay
    "gpt2": dict(vocab_size=64, n_positions=64, n_embd=32, n_layer=2, n_head=4, attn_pdrop=0.0),
    "llama": dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2),
    "bert": dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 max_position_embeddings=64, attention_probs_dropout_prob=0.0),
}


@pytest.mark.parametrize("name", HUGGING_FACE_CONFIGS)
def test_a_tokenizers_all_ones_mask_plans_and_trains_as_no_mask_and_padding_keeps_its_own(name):
    """What a tokenizer hands over for an unpadded batch (``attention_mask`` of ones) is planned and run as the model
    given no mask (the kernel called causal or unmasked), and trains bit for bit like the model given it, its other
    dropouts included; a padded batch of the same shape plans apart, masked, and trains like the model too."""
    import planner

    model = _hugging_face(name, **HUGGING_FACE_CONFIGS[name])
    ids = torch.randint(0, 64, (2, 64))
    optimized = planner.optimize(model, "85%", example_kwargs={"input_ids": ids, "attention_mask": torch.ones_like(
        ids), "labels": ids}, profile_repeats=0)
    calls = attention_calls(optimized.planned.captured.graph_module)
    assert calls and all(c["attn_mask"] is None for c in calls)
    assert all(c["is_causal"] for c in calls) == (name != "bert")
    padded = torch.ones_like(ids).index_fill_(1, torch.arange(56, 64), 0)
    for mask in (torch.ones_like(ids), padded):
        results = []
        for module in (optimized, model):
            torch.manual_seed(1)
            loss = module(input_ids=ids, attention_mask=mask, labels=ids).loss
            loss.backward()
            results.append((loss.detach(), {k: p.grad.clone() for k, p in model.named_parameters()}))
            model.zero_grad(set_to_none=True)
        (planned_loss, planned_grads), (loss, grads) = results
        assert torch.equal(planned_loss, loss) and all(torch.equal(planned_grads[k], grads[k]) for k in grads)
    assert len(optimized._planned) == 2  # the padded batch was planned apart, with its mask
    assert any(c["attn_mask"] is not None for c in attention_calls(optimized.planned.captured.graph_module))


def test_a_graph_captured_on_meta_works_its_mask_out_on_the_cpu():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=4, use_cache=False)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config).train()
    ids = torch.zeros(1, 64, dtype=torch.long, device="meta")
    captured = capture(model, (ids,), {"labels": ids}, replay_dropout=False)
    calls = attention_calls(captured.graph_module)
    assert len(calls) == 2 and all(c["attn_mask"] is None and c["is_causal"] for c in calls)


class RepeatedHeads(torch.nn.Module):
    """Grouped-query attention spelled as Hugging Face's ``repeat_kv`` does it: 4 query heads, 2 key/value heads."""

    def __init__(self, dropout_p=0.0, masked=False):
        super().__init__()
        self.dropout_p, self.masked = dropout_p, masked

    def forward(self, q, kv):
        def repeat(x):
            return x[:, :, None].expand(2, 2, 2, 16, 8).reshape(2, 4, 16, 8)
        mask = (kv[:, :1, :, :1] > -10).expand(-1, -1, -1, 16) if self.masked else None
        return F.scaled_dot_product_attention(q, repeat(kv), repeat(kv * 2), attn_mask=mask,
                                              dropout_p=self.dropout_p, is_causal=not self.masked)


def test_repeated_key_and_value_heads_go_to_the_kernel_grouped():
    q, kv = torch.randn(2, 4, 16, 8), torch.randn(2, 2, 16, 8)
    graph_module = _exported(RepeatedHeads(), q, kv)
    assert group_repeated_heads(graph_module) == 1
    (call,) = attention_calls(graph_module)
    assert call["enable_gqa"] and call["is_causal"] and tuple(call["key"].meta["val"].shape) == (2, 2, 16, 8)
    assert not any(n.target is torch.ops.aten.expand.default for n in graph_module.graph.nodes)  # copies erased
    torch.testing.assert_close(graph_module(q, kv), RepeatedHeads()(q, kv), rtol=0, atol=1e-6)


def test_heads_stay_repeated_under_a_mask_or_dropout_or_a_kernel_that_would_copy_them():
    q, kv = torch.randn(2, 4, 16, 8), torch.randn(2, 2, 16, 8)
    for model in (RepeatedHeads(masked=True), RepeatedHeads(dropout_p=0.5)):
        assert group_repeated_heads(_exported(model, q, kv)) == 0
    assert kernel_shares_heads(q.to("meta"), kv.to("meta"), kv.to("meta")) is False  # float32 on a GPU: math


def _mistral(**fields):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, **fields)
    return transformers.MistralForCausalLM(config).train()


def test_hugging_face_grouped_query_attention_saves_each_head_once_and_trains_bit_for_bit(monkeypatch):
    """Exported with its mask, Mistral copies each key/value head for both query heads it serves; run as the model
    runs it (``enable_gqa``), the step saves 2 x 16 KiB less a layer (its key and value), and its gradients are the
    model's to the last bit (3.7e-9 apart with the copies)."""
    import planner.capture
    from planner.meter import LiveMemoryMeter
    model, ids = _mistral(), torch.randint(0, 64, (4, 64))
    captured = capture(model, (ids,), {"labels": ids})
    calls = attention_calls(captured.graph_module)
    assert len(calls) == 2 and all(c["enable_gqa"] and c["key"].meta["val"].shape[1] == 2 for c in calls)
    loss = captured.graph_module(ids, labels=ids).loss
    loss.backward()
    graph_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    expected = model(ids, labels=ids).loss
    expected.backward()
    assert torch.equal(loss, expected) and all(torch.equal(g, p.grad) for g, p in zip(graph_grads, model.parameters()))

    def held_for_backward(captured):  # live storages once the forward is done, counted op by op
        with LiveMemoryMeter() as meter:
            loss = captured.graph_module(ids, labels=ids).loss
        held = meter.live_bytes
        loss.backward()
        model.zero_grad()
        return held
    monkeypatch.setattr(planner.capture, "restore_attention",  # the heads stay copied
                        lambda graph_module, model: drop_constant_masks(graph_module))
    with_copies = capture(model, (ids,), {"labels": ids})
    assert held_for_backward(with_copies) - held_for_backward(captured) == 2 * 2 * (4 * 2 * 64 * 8 * 4)


def test_a_graph_captured_on_meta_groups_heads_for_16_bit_attention_only():
    for dtype, grouped in ((torch.bfloat16, True), (torch.float32, False)):
        with torch.device("meta"):
            model = _mistral().to(dtype)
        ids = torch.zeros(1, 64, dtype=torch.long, device="meta")
        captured = capture(model, (ids,), {"labels": ids}, replay_dropout=False)
        assert all(c["enable_gqa"] is grouped for c in attention_calls(captured.graph_module)), dtype


def test_a_plan_made_with_an_all_ones_mask_applies_to_the_same_inputs():
    """``plan`` and ``apply`` (and the CLI, which captures as ``plan`` does) drop the mask alike, so the plan's
    fingerprint is the one ``apply`` finds."""
    import planner

    model = _hugging_face("gpt2", **HUGGING_FACE_CONFIGS["gpt2"])
    ids = torch.randint(0, 64, (2, 64))
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    plan = planner.Plan.from_json(planner.plan(model, "85%", example_kwargs=inputs, profile_repeats=0).to_json())
    applied = planner.apply(model, plan, example_kwargs=inputs)
    assert applied.plan.fingerprint == plan.fingerprint and applied(**inputs).loss.requires_grad
