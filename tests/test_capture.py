import pytest
import torch

from planner.capture import capture, flat_call_args, input_signature, module_path, placed_stage_nodes
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


def test_input_signature_tells_shapes_and_values_apart():
    a = input_signature((torch.zeros(2, 3),), {"flag": True})
    assert a == input_signature((torch.ones(2, 3),), {"flag": True})
    assert a != input_signature((torch.zeros(2, 4),), {"flag": True})
    assert a != input_signature((torch.zeros(2, 3),), {"flag": False})
    assert a != input_signature((torch.zeros(2, 3, dtype=torch.float64),), {"flag": True})


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
