import sys
import warnings

import pytest
import torch

from planner.capture import (ForwardHookWarning, capture, changed_values, flat_call_args, hooked_modules,
                            input_signature, module_path, numbers_kept, numbers_signature, placed_stage_nodes)
from planner.errors import PlannerError


class Branchy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x, scale: float = 1.0):
        if x.sum() > 0:  # data-dependent control flow: export cannot capture it
            return self.lin(x) * scale
        return self.lin(x)


def test_capture_keeps_the_callers_parameters_and_module_paths():
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))
    captured = capture(model, (torch.randn(5, 4),))
    gm = captured.graph_module
    assert gm.get_parameter("0.weight") is model[0].weight
    assert gm.get_buffer("1.running_mean") is model[1].running_mean
    assert {module_path(n) for n in captured.compute_nodes()} >= {"0", "1", "2"}


def test_captured_module_computes_what_the_model_computes():
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 2))
    x = torch.randn(5, 4)
    captured = capture(model, (x,))
    torch.manual_seed(3)
    expected = model(x)
    torch.manual_seed(3)
    assert torch.equal(captured.graph_module(x), expected)


def test_keyword_inputs_are_flattened_in_the_captured_order():
    class Kw(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(3, 3)

        def forward(self, x, *, bias=None):
            return self.lin(x) + (0 if bias is None else bias)

    x, b = torch.randn(2, 3), torch.randn(3)
    captured = capture(Kw(), (x,), {"bias": b})
    flat = flat_call_args(captured, (x,), {"bias": b})
    assert flat[0] is x and flat[1] is b
    with pytest.raises(PlannerError, match="structure"):
        flat_call_args(captured, (x,), {})


def test_errors_name_the_cause_and_a_fix():
    with pytest.raises(PlannerError, match="expected an nn.Module"):
        capture(lambda x: x, (torch.randn(1),))
    with pytest.raises(PlannerError, match="no tensor"):
        capture(torch.nn.Linear(2, 2), (3,))
    with pytest.raises(PlannerError, match="could not capture Branchy") as info:
        capture(Branchy(), (torch.randn(2, 4),))
    assert "Hint:" in str(info.value)
    with pytest.raises(PlannerError, match="could not capture"):
        capture(torch.nn.Linear(2, 2), (torch.randn(3, 5),))  # wrong input width


class SaysThenBranches(Branchy):
    def forward(self, x, scale: float = 1.0):
        print("said in forward", file=sys.stderr)
        return super().forward(x, scale)


class SkipsAtRandom(torch.nn.Module):
    """Residual blocks each skipped with probability one half, drawn from Python's or NumPy's generator."""

    def __init__(self, draw):
        super().__init__()
        self.draw = draw
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(4))

    def forward(self, x):
        for layer in self.layers:
            if not (self.training and self.draw() < 0.5):
                x = x + layer(x)
        return x


@pytest.mark.parametrize("generator", ["python", "numpy"])
def test_a_forward_that_draws_from_python_or_numpy_is_not_captured_and_draws_nothing_for_the_caller(generator):
    """Export runs the forward once, so a layer skipped at ``random.random() < p`` was captured skipped or kept
    for good: the planned module ran that one draw's layers on every step (outputs 1.4-2.2 apart from eager's)."""
    import random

    import numpy as np
    draw = random.random if generator == "python" else np.random.rand
    random.seed(0)
    np.random.seed(0)
    expected = random.random(), np.random.rand()
    random.seed(0)
    np.random.seed(0)
    with pytest.raises(PlannerError, match="Python's random module" if generator == "python" else "NumPy"):
        capture(SkipsAtRandom(draw), (torch.randn(2, 8),))
    assert (random.random(), np.random.rand()) == expected
    model = SkipsAtRandom(draw).eval()  # in eval it draws nothing: captured as usual
    assert capture(model, (torch.randn(2, 8),)).graph_module is not None


class WarmsUp(torch.nn.Module):
    """Scales its blocks by how many training calls it has seen, up to ``warmup``: a Python counter."""

    def __init__(self, warmup=3):
        super().__init__()
        self.calls, self.warmup, self.tag = 0, warmup, "warm"
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(4))

    def forward(self, x):
        if self.training:
            self.calls += 1
        self.warmup = self.warmup  # set again, unchanged: not a change
        scale = min(1.0, self.calls / self.warmup)
        for layer in self.layers:
            x = x + scale * layer(x)
        return x


def test_a_forward_that_changes_a_number_on_the_model_is_not_captured():
    """The graph reads ``self.calls`` as the constant of the call export traced and never adds to it: the planned
    module's blocks stayed scaled by the first call's 1/3 for good, where eager's reach 1 on the third step."""
    model = WarmsUp()
    with pytest.raises(PlannerError, match="changes calls, which a captured graph"):
        capture(model, (torch.randn(2, 8),))
    assert model.calls == 0  # export put it back
    assert capture(model.eval(), (torch.randn(2, 8),)).graph_module is not None  # in eval it counts nothing


class KeepsWhatItSaw(torch.nn.Module):
    """Keeps its last hidden state (as a model keeps an attention map for a plot), a list of norms, and an auxiliary
    loss (as a mixture of experts keeps its load balancing loss for the training loop to add)."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(2))
        self.last, self.norms = None, []

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        self.last = x.detach()
        self.norms.append(x.detach().norm())
        self.aux_loss = x.square().mean()
        return x


def test_a_forward_that_sets_or_fills_tensors_on_the_model_is_not_captured_and_leaves_them_as_they_were():
    """A captured graph neither sets attributes nor appends to lists: after a planned step they held what they held
    before (until 2026-12-07 a mixture of experts' load balancing losses were never this step's). A capture that
    refuses leaves no fake tensor behind: ``last`` is None again, ``norms`` empty, ``aux_loss`` never set."""
    model = KeepsWhatItSaw()
    with pytest.raises(PlannerError, match=r"sets or fills last \(set\), norms \(filled\), aux_loss \(set\)"):
        capture(model, (torch.randn(2, 8),))
    assert model.last is None and model.norms == [] and not hasattr(model, "aux_loss")


def test_numbers_kept_puts_back_the_tensors_and_containers_of_the_model():
    model = KeepsWhatItSaw()
    model.norms.append(torch.ones(()))
    kept = list(model.norms)
    with numbers_kept(model):
        model(torch.randn(2, 8))
    assert model.last is None and not hasattr(model, "aux_loss")
    assert len(model.norms) == 1 and model.norms[0] is kept[0]


def test_state_written_where_a_region_could_not_hold_it_is_refused_and_safe_writes_are_not():
    from tests.test_api import RunningCentred
    with pytest.raises(PlannerError, match="assigns or registers the buffer 0.running, which torch.export"):
        capture(torch.nn.Sequential(RunningCentred("assigned")), (torch.randn(4, 32),))
    for update in ("assigned", "read_first", "in_place_chain"):  # the root's assignment export records, as a copy_
        with pytest.raises(PlannerError, match="writes running in place where it also reads it"):
            capture(RunningCentred(update), (torch.randn(4, 32),))
    norm = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.BatchNorm1d(32))  # the kernel's own statistics
    assert capture(norm, (torch.randn(4, 32),)).graph_module is not None


class ScaledLazily(torch.nn.Module):
    """Registers a buffer on its first call, sized by the input (a mask or position cache made lazily)."""

    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(8, 8)

    def forward(self, x):
        if not hasattr(self, "scale"):
            self.register_buffer("scale", torch.linspace(0.5, 1.5, x.shape[-1]))
        return self.layer(x) * self.scale


def test_a_buffer_registered_on_the_first_call_is_registered_once_by_a_real_forward_then_captured():
    """No graph registers a buffer, and export registered a fake tensor in the model: until 2026-12-07 the model
    held it after planning (its own forward and its state dict then held a tensor with no data), and until
    2026-12-08 such a model was planned in parts. Capture now runs one forward without gradients, as the model's
    first call would, which registers the real buffer, and captures the model as its later calls run it."""
    model = torch.nn.Sequential(ScaledLazily())
    x = torch.randn(2, 8)
    captured = capture(model, (x,))
    assert type(model[0].scale) is torch.Tensor and torch.equal(model[0].scale, torch.linspace(0.5, 1.5, 8))
    assert "0.scale" in model.state_dict()
    assert torch.equal(captured.graph_module(x), model(x))


class CachedOnFirstCall(torch.nn.Module):
    """Rotary tables made when the sequence length changes (a length and two tensors kept as plain attributes,
    as many hand-written transformers do), a memo dict by shape, a BatchNorm and a dropout."""

    def __init__(self):
        super().__init__()
        self.layer, self.norm, self.drop = torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(6), torch.nn.Dropout(0.5)
        self.register_buffer("inv_freq", 1.0 / 100 ** (torch.arange(0, 8, 2).float() / 8))
        self.seq_len_cached, self.cos_cached, self.memo = None, None, {}

    def forward(self, x):
        if x.shape[1] != self.seq_len_cached:
            self.seq_len_cached = x.shape[1]
            self.cos_cached = torch.outer(torch.arange(x.shape[1]).float(), self.inv_freq).cos().repeat(1, 2)
        if x.shape not in self.memo:
            self.memo[x.shape] = torch.ones(x.shape[1:]).tril()
        return self.drop(self.norm(self.layer(x) * self.cos_cached + self.memo[x.shape]))


def test_a_cache_filled_on_the_first_call_is_filled_once_by_a_real_forward_leaving_statistics_and_draws_alone():
    """Until 2026-12-08 such a model was refused (it sets attributes and changes a number) and planned in parts,
    where its blocks could not be checkpointed whole. The forward capture runs first fills the caches as the first
    call would, and is not a training step: BatchNorm's statistics and torch's generator are as they were."""
    model, x = CachedOnFirstCall(), torch.randn(4, 6, 8)
    rng, mean = torch.get_rng_state(), model.norm.running_mean.clone()
    captured = capture(model, (x,))
    assert torch.equal(torch.get_rng_state(), rng) and torch.equal(model.norm.running_mean, mean)
    assert model.norm.num_batches_tracked == 0
    assert model.seq_len_cached == 6 and type(model.cos_cached) is torch.Tensor and list(model.memo) == [x.shape]
    reference = CachedOnFirstCall()
    reference.load_state_dict(model.state_dict())
    torch.manual_seed(1)
    theirs = reference(x)
    torch.manual_seed(1)
    assert torch.equal(captured.graph_module(x), theirs)
    assert torch.equal(model.cos_cached, reference.cos_cached)


def test_a_forward_that_sets_state_on_every_call_is_refused_with_the_first_forward_undone():
    """The forward capture runs to fill first-call caches is undone where the next capture still sets state: the
    counter, the kept tensors and lists and a buffer it registered are as they were."""
    class RegistersAndCounts(WarmsUp):
        def forward(self, x):
            if not hasattr(self, "scale"):
                self.register_buffer("scale", torch.ones(8))
            return super().forward(x) * self.scale

    counting = RegistersAndCounts()
    with pytest.raises(PlannerError, match="changes calls"):
        capture(counting, (torch.randn(2, 8),))
    assert counting.calls == 0 and not hasattr(counting, "scale") and "scale" not in counting.state_dict()
    keeping = KeepsWhatItSaw()
    with pytest.raises(PlannerError, match="sets or fills"):
        capture(keeping, (torch.randn(2, 8),))
    assert keeping.last is None and keeping.norms == [] and not hasattr(keeping, "aux_loss")


def test_a_failed_capture_leaves_stderr_to_the_model_not_to_exports_partial_graph(capsys, caplog):
    """torch.export prints the whole forward traced so far to stderr, twice, when it stops at data-dependent
    control flow, and logs that it found no user code for the symbol; a model planned in parts after such a failure
    printed both again for each part tried."""
    with pytest.raises(PlannerError, match="could not capture SaysThenBranches") as info:
        capture(SaysThenBranches(), (torch.randn(2, 4),))
    err = capsys.readouterr().err
    assert "said in forward" in err and "def forward" not in err
    assert not [r for r in caplog.records if "user code" in r.getMessage()]
    assert "def forward" in info.value.__cause__.partial_fx_graph  # kept with the error
    capture(SaysThenBranches().lin, (torch.randn(2, 4),))
    print("after", file=sys.stderr)
    assert capsys.readouterr().err == "after\n"


class Shifted(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x, target):
        return (self.lin(x) - target).square().mean()


def test_an_input_given_twice_is_captured_as_two_inputs():
    """``model(input_ids=ids, labels=ids)``: export read one input for both, and the graph ran on whichever it
    kept when the next call gave two different tensors."""
    x, other = torch.randn(3, 4), torch.randn(3, 4)
    model = Shifted()
    captured = capture(model, (x, x))
    assert len([n for n in captured.graph_module.graph.nodes if n.op == "placeholder" and n.users]) == 2
    assert torch.equal(captured.graph_module(x, other), model(x, other))
    assert torch.equal(captured.graph_module(x, x), model(x, x))


class HookedInForward(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        y.register_hook(lambda grad: grad * 2)
        return y


def test_a_graph_that_would_not_train_as_the_model_does_is_refused():
    x = torch.randn(2, 4)
    with pytest.raises(PlannerError, match="Tensor.register_hook"):
        capture(HookedInForward(), (x,))
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    handle = model[0].register_full_backward_hook(lambda module, grad_input, grad_output: None)
    with pytest.raises(PlannerError, match="backward hooks on '0'.*would not run"):
        capture(model, (x,))
    handle.remove()
    capture(model, (x,))  # without the hook it captures
    global_handle = torch.nn.modules.module.register_module_full_backward_hook(lambda module, gi, go: None)
    try:
        with pytest.raises(PlannerError, match="every module"):
            capture(model, (x,))
    finally:
        global_handle.remove()


def test_forward_hooks_keep_their_modules_out_of_the_graph_and_a_global_one_is_traced_and_named():
    """A hook's tensor ops would be in the graph, but what else it does (here: record each output) would have
    run once, at capture, on a fake tensor: the hooked module is not captured (optimize plans around it). A global
    hook is on every module, so it is traced and named."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    seen = []
    model[0].register_forward_hook(lambda module, args, out: seen.append(out) or out + 1)
    x = torch.randn(2, 4)
    with pytest.raises(PlannerError, match="forward hooks on '0'.*recording outputs, logging"):
        capture(model, (x,))
    assert seen == []  # refused before export ran it
    captured = capture(model[1], (x,))  # a module without hooks captures
    handle = torch.nn.modules.module.register_module_forward_hook(lambda module, args, out: None)
    try:
        with pytest.warns(ForwardHookWarning, match="every module \\(a global hook\\).*will not run again"):
            captured = capture(torch.nn.Sequential(torch.nn.Linear(4, 4)), (x,))
    finally:
        handle.remove()
    assert captured.graph_module is not None

    def make_inputs_require_grads(module, args, out):  # Hugging Face's enable_input_require_grads (PEFT)
        out.requires_grad_(True)

    plain = torch.nn.Sequential(torch.nn.Embedding(8, 4), torch.nn.Linear(4, 4))
    plain[0].register_forward_hook(make_inputs_require_grads)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ForwardHookWarning)
        capture(plain, (torch.tensor([[1, 2]]),))


def test_hooks_of_torchs_own_are_what_the_graph_computes():
    weight_normed = torch.nn.Sequential(torch.nn.utils.weight_norm(torch.nn.Linear(4, 4)), torch.nn.Tanh())
    assert hooked_modules(weight_normed) == []
    x = torch.randn(2, 4)
    assert torch.equal(capture(weight_normed, (x,)).graph_module(x), weight_normed(x))
    assert "recording" not in torch.Tensor.register_hook.__qualname__  # the recording wrapper is gone again


def test_input_signature_tells_shapes_and_values_apart():
    a = input_signature((torch.zeros(2, 3),), {"flag": True})
    assert a == input_signature((torch.ones(2, 3),), {"flag": True})
    assert a != input_signature((torch.zeros(2, 4),), {"flag": True})
    assert a != input_signature((torch.zeros(2, 3),), {"flag": False})
    assert a != input_signature((torch.zeros(2, 3, dtype=torch.float64),), {"flag": True})


def test_a_module_frozen_with_eval_stays_frozen_through_capture():
    """Capture put the whole model back in training (``model.train(True)``), which unfroze a BatchNorm frozen
    for fine-tuning, for the planned steps and for the caller's eager ones alike, until 2026-12-07."""
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU()).train()
    model[1].eval()
    x = torch.randn(2, 3, 8, 8)
    captured = capture(model, (x,))
    assert model.training and not model[1].training
    before = model[1].running_mean.clone()
    assert torch.equal(captured.graph_module(x), model(x))
    assert torch.equal(model[1].running_mean, before)  # frozen statistics: used, not updated


def test_numbers_signature_holds_the_numbers_the_graph_holds_as_constants():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.1))
    model.tau = 2.0
    before = numbers_signature(model)
    assert {(name, value) for _, name, _, value in before} >= {("tau", 2.0), ("p", 0.1), ("in_features", 2),
                                                                ("training", True)}
    model[0].register_full_backward_hook(lambda *args: None).remove()  # leaves nn.Module's flag set: not a number
    assert numbers_signature(model) == before
    model[1].eval()
    model.tau = float("nan")
    after = numbers_signature(model)
    assert after != before and numbers_signature(model) == after  # a NaN equals itself here
    x = torch.ones(2)
    assert changed_values(after, before, input_signature((x,), {"s": 1}), input_signature((x,), {"s": 2}), model,
                          (x,), {"s": 1}) == ["tau", "1.training", "kwargs['s']"]
    assert changed_values(after, before, input_signature((x[:1],), {}), input_signature((x,), {}), model,
                          (x[:1],), {}) == []  # a shape changed too: not only constants


class _CopiesItsInput(torch.nn.Module):
    def forward(self, x):
        return (x.contiguous() * 2).transpose(0, 1).contiguous().sum()


def test_layout_copies_are_named_after_their_input_and_placed_where_another_graph_would_not_make_them():
    made = capture(_CopiesItsInput(), (torch.randn(3, 2).t(),)).graph_module.graph  # an input in another layout
    assert [n.name for n in made.nodes if n.op == "call_function"] == [
        "x_contiguous", "mul", "transpose", "transpose_contiguous", "sum_1"]
    plain = capture(_CopiesItsInput(), (torch.randn(2, 3),)).graph_module.graph  # .contiguous() copies nothing
    assert [n.name for n in plain.nodes if n.op == "call_function"] == [
        "mul", "transpose", "transpose_contiguous", "sum_1"]
    # stages from a graph that made no copies: each copy joins the stage of its input, or of its first user
    assert placed_stage_nodes(made, [["mul"], ["transpose"], ["sum_1"]]) == (
        ("x_contiguous", "mul"), ("transpose", "transpose_contiguous"), ("sum_1",))


class LongInputsDoubled(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x):
        y = self.linear(x)
        return y * 2 if x.shape[0] > 4 else y  # another graph past 4 rows


def test_a_graph_is_no_larger_than_the_same_graph_on_inputs_at_least_as_large():
    from planner.capture import no_larger_than

    model = LongInputsDoubled()
    graphs = {n: capture(model, (torch.randn(n, 8),)).graph_module.graph for n in (2, 3, 6, 8)}
    assert no_larger_than(graphs[2], graphs[3]) and no_larger_than(graphs[6], graphs[8])
    assert no_larger_than(graphs[3], graphs[3])
    assert not no_larger_than(graphs[3], graphs[2])  # a tensor larger
    assert not no_larger_than(graphs[3], graphs[8])  # the branch: another graph
    doubled = capture(model.double(), (torch.randn(2, 8, dtype=torch.float64),)).graph_module.graph
    assert not no_larger_than(doubled, graphs[3])  # same sizes, another dtype
