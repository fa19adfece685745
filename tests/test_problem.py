"""The execution model on hand-built problems, checked against what PyTorch does (worked out by hand)."""

import pytest

from planner.problem import (InputSaving, Phase, Problem, RecomputeOption, Region, Schedule, Stage, TensorInfo,
                             input_saving, liveness, simulate, without_empty_regions)
from planner.solvers import solve
from tests.solver_problems import bn_relu_conv, cached_head_input, held_norm_output


def chain(n=4, act=100, boundary=10, grads=0, fixed=1000):
    """n stages; stage i makes a boundary tensor read by i+1 and an activation it saves itself."""
    stages = tuple(Stage(f"s{i}", 1.0, 2.0, grad_bytes=grads, options=(
        RecomputeOption("all", frozenset(), 1.0), RecomputeOption("cache", frozenset({f"a{i}"}), 0.25)))
        for i in range(n))
    tensors = []
    for i in range(n):
        tensors.append(TensorInfo(f"a{i}", act, producer=i, savers=frozenset({i}), node=f"a{i}"))
        if i < n - 1:
            tensors.append(TensorInfo(f"x{i}", boundary, producer=i, consumers=frozenset({i + 1}),
                                      savers=frozenset({i + 1}), node=f"x{i}"))
    return Problem(stages, tuple(tensors), fixed_bytes=fixed)


def test_store_all_keeps_every_saved_tensor_until_its_backward():
    problem = chain()
    result = simulate(problem, Schedule())
    # all activations (4 x 100) and boundaries (3 x 10) are alive at the end of the forward
    assert result.peak_bytes == 1000 + 400 + 30
    assert result.recompute_seconds == 0
    assert result.step_seconds == pytest.approx(12.0)


def test_uniform_keeps_boundaries_and_recomputes_one_stage_at_a_time():
    problem = chain()
    result = simulate(problem, Schedule.uniform(4))
    events = {(e.phase, e.stage): e.total_bytes for e in result.events}
    assert events[(Phase.FORWARD, 3)] == 1000 + 30  # boundaries held by the next region
    assert events[(Phase.RECOMPUTE, 3)] == 1000 + 30 + 100
    assert events[(Phase.BACKWARD_START, 0)] == 1000 + 100  # x0.. freed as their regions finish
    assert events[(Phase.BACKWARD, 0)] == 1000  # what outlives stage 0's backward, plus its workspace (0)
    assert result.peak_bytes == 1130
    assert result.recompute_seconds == pytest.approx(4.0)


def test_merged_region_recomputes_all_of_its_stages_at_once():
    problem = chain()
    result = simulate(problem, Schedule((Region(0, 3),)))
    recompute = next(e for e in result.events if e.phase is Phase.RECOMPUTE)
    # stage 3's backward already freed a3 and x2; the region recomputes a0..a2 and x0, x1 at once
    assert recompute.activation_bytes == 300 + 20
    assert result.recompute_seconds == pytest.approx(3.0)


def test_a_region_reruns_its_stages_one_after_another():
    """Stage 0 caches ``c``, which only it reads: the cache is consumed by stage 0's re-run, before stage 1 re-runs;
    stage 1's copy ``s1`` does not exist yet while stage 0 re-runs. A region that caches runs to its end, one that
    caches nothing stops after the last tensor it saves (``t1``, read by a later stage, is then not made again)."""
    options = (RecomputeOption("all", frozenset(), 1.0), RecomputeOption("cache_c", frozenset({"c"}), 0.5, 5))
    stages = (Stage("s0", 1.0, 2.0, options=options), Stage("s1", 1.0, 2.0, forward_workspace_bytes=7),
              Stage("s2", 1.0, 2.0))
    tensors = (TensorInfo("c", 100, 0, node="c"), TensorInfo("s0", 10, 0, savers=frozenset({0}), node="s"),
               TensorInfo("s1", 20, 1, savers=frozenset({1}), node="t"),
               TensorInfo("t1", 40, 1, consumers=frozenset({2}), savers=frozenset({2}), node="t"))
    problem = Problem(stages, tensors)

    def recompute(options):
        events = simulate(problem, Schedule((Region(0, 2, options),))).events
        return next(e for e in events if e.phase is Phase.RECOMPUTE).total_bytes

    # caching: stage 0 re-runs with the cache, s0 and its workspace; stage 1 with s0, s1, t1 and its workspace
    assert recompute((1, 0)) == max(100 + 10 + 5, 10 + 20 + 40 + 7) == 115
    # nothing cached: c is stage 0's temporary (its forward workspace, 0 here), stage 1 stops before t1
    assert recompute((0, 0)) == max(10 + 0, 10 + 20 + 7) == 37


def test_a_tensor_nothing_saves_dies_once_its_last_reader_has_re_run():
    """The BatchNorm's output is made again by the region's re-run, read by the ReLU's and freed: it is not alive
    while the convolution re-runs (ResNet's sublayer plans were one feature map over)."""
    events = simulate(bn_relu_conv(), Schedule.from_segments([(0, 3)])).events
    recompute = next(e for e in events if e.phase is Phase.RECOMPUTE)
    # the convolution, the last stage, stops once it saved its input: the ReLU's output, its own (saved by it
    # here), its workspace; the ReLU's re-run saw the BatchNorm's output and its own (100 + 100) below that
    assert recompute.total_bytes == 100 + 40 + 300


def test_an_input_saving_that_needs_the_re_run_to_go_on_counts_only_where_a_later_stage_follows():
    """``through_only``: the ReLU's re-run frees the BatchNorm's output only when it runs through (the convolution
    follows in its region); a region ending at the ReLU stops there, still holding it."""
    problem = bn_relu_conv(conv_workspace=0, relu_held_input=60, through_only=True)

    def recompute(segments, stage):
        events = simulate(problem, Schedule.from_segments(segments)).events
        return max(e.total_bytes for e in events if e.phase is Phase.RECOMPUTE and e.stage == stage)

    assert recompute([(0, 3)], 2) == max(100 + 100, 100 + 40) == 200  # as with the saving anywhere
    # the ReLU last: it stops once it saved its output, the BatchNorm's output (100) still held, its workspace (60)
    assert recompute([(0, 2)], 1) == 100 + 100 + 60


def test_an_input_the_region_made_is_not_held_through_its_readers_re_run():
    """The ReLU's recompute workspace (60) is what holding the BatchNorm's output adds to it, as when a region
    holds its inputs; a region that made it frees it inside the ReLU as the eager step does."""
    problem = bn_relu_conv(conv_workspace=0, relu_held_input=60)

    def recompute(segments):
        events = simulate(problem, Schedule.from_segments(segments)).events
        return max(e.total_bytes for e in events if e.phase is Phase.RECOMPUTE and e.stage == 2)

    # one region: the ReLU re-runs beside the BatchNorm's output (100) with its own (100), no workspace; the
    # convolution, stopping once it saved its input, with the ReLU's output and its own (40)
    assert recompute([(0, 3)]) == max(100 + 100, 100 + 40) == 200
    # the ReLU's region holds the BatchNorm's output from outside: the ReLU's workspace counts
    assert recompute([(0, 1), (1, 3)]) == max(100 + 100 + 60, 100 + 100 + 40) == 260


def test_cached_nodes_are_kept_from_the_forward_and_not_recomputed():
    problem = chain()
    schedule = Schedule((Region(1, 2, (1,)),))
    life = liveness(problem, schedule, next(t for t in problem.tensors if t.name == "a1"))
    assert life.held_from == 1 and life.copy_range is None
    assert simulate(problem, schedule).recompute_seconds == pytest.approx(0.25)


def test_output_still_held_is_recomputed_as_a_second_copy():
    stages = (Stage("a", 1, 1), Stage("b", 1, 1))
    shared = TensorInfo("h", 100, producer=0, consumers=frozenset({1}), savers=frozenset({0, 1}), node="h",
                        is_output=True)
    problem = Problem(stages, (shared,))
    life = liveness(problem, Schedule((Region(0, 1),)), shared)
    assert life.held_from == -1  # the caller holds the output
    assert life.copy_range == (0, 0)  # and the recomputation of stage 0 makes it again
    recompute = next(e for e in simulate(problem, Schedule((Region(0, 1),))).events if e.phase is Phase.RECOMPUTE)
    assert recompute.activation_bytes == 200


def test_stage_internal_temporaries_belong_to_the_workspace():
    stages = (Stage("a", 1, 1, forward_workspace_bytes=7),)
    temp = TensorInfo("tmp", 500, producer=0, node="tmp")
    result = simulate(Problem(stages, (temp,)), Schedule())
    assert result.events[0].total_bytes == 7


def test_model_outputs_stay_alive_through_the_backward():
    stages = (Stage("a", 1, 1),)
    out = TensorInfo("logits", 64, producer=0, node="n", is_output=True)
    result = simulate(Problem(stages, (out,)), Schedule.uniform(1))
    assert all(e.activation_bytes >= 64 for e in result.events)


def test_backward_peak_is_what_outlives_the_stage_plus_its_workspace():
    problem = chain()
    stages = tuple(s if i != 2 else Stage(s.name, 1.0, 2.0, backward_workspace_bytes=500, options=s.options)
                   for i, s in enumerate(problem.stages))
    result = simulate(Problem(stages, problem.tensors, problem.fixed_bytes), Schedule())
    stage2 = [e for e in result.events if e.stage == 2 and e.phase in (Phase.BACKWARD_START, Phase.BACKWARD)]
    # start: a0..a2, x0 and x1 (x2 went with stage 3); what outlives stage 2: a0, a1 and x0 (x1 is saved only by
    # stage 2), plus stage 2's measured workspace
    assert stage2[0].total_bytes == 1000 + 300 + 20
    assert stage2[1].total_bytes == 1000 + 200 + 10 + 500


def test_gradients_accumulate_over_the_backward():
    problem = chain(grads=5)
    backward = [e for e in simulate(problem, Schedule()).events if e.phase is Phase.BACKWARD]
    assert [e.gradient_bytes for e in backward] == [5, 10, 15, 20]


def test_invalid_schedules_and_problems_are_rejected():
    with pytest.raises(ValueError):
        Schedule((Region(0, 2), Region(1, 3)))
    with pytest.raises(ValueError):
        Region(2, 2)
    with pytest.raises(ValueError):
        simulate(chain(), Schedule((Region(0, 9),)))
    with pytest.raises(ValueError):
        simulate(chain(), Schedule((Region(0, 1, (5,)),)))
    with pytest.raises(ValueError):
        Problem((Stage("a", 1, 1),), (TensorInfo("t", 1, producer=3),))


def test_is_chain():
    assert chain().is_chain()
    skip = TensorInfo("skip", 1, producer=0, consumers=frozenset({3}), node="s")
    assert not Problem(chain().stages, chain().tensors + (skip,)).is_chain()


def test_a_cached_output_is_held_by_the_caller_and_counted_once():
    option = RecomputeOption("cache", frozenset({"logits"}), 0.0)
    stages = (Stage("a", 1, 1, options=(RecomputeOption("all", frozenset(), 1.0), option)),)
    out = TensorInfo("logits", 64, producer=0, node="logits", is_output=True)
    problem = Problem(stages, (out,))
    life = liveness(problem, Schedule((Region(0, 1, (1,)),)), out)
    assert life.held_from == -1 and life.consumed_at is None
    recompute = next(e for e in simulate(problem, Schedule((Region(0, 1, (1,)),))).events
                     if e.phase is Phase.RECOMPUTE)
    assert recompute.activation_bytes == 64


def _encoder_decoder(returned: bool) -> Problem:
    """An encoder whose output only the first decoder stage reads, and that the model may return as well."""
    stages = tuple(Stage(name, 1.0, 2.0) for name in ("encoder", "decoder0", "decoder1", "head"))
    tensors = (TensorInfo("encoder_out", 100, 0, consumers=frozenset({1}), node="e", returned=returned),
               TensorInfo("a0", 50, 0, savers=frozenset({0}), node="a0"),
               TensorInfo("a1", 30, 1, savers=frozenset({1}), node="a1"),
               TensorInfo("a2", 20, 2, savers=frozenset({2}), node="a2"),
               TensorInfo("h", 5, 2, consumers=frozenset({3}), savers=frozenset({3}), node="h"))
    return Problem(stages, tensors, fixed_bytes=1000)


def test_a_returned_output_the_caller_lets_go_lives_to_the_end_of_the_forward_and_of_its_region_re_run():
    """T5 returns its encoder's output beside the loss: the caller drops it before the backward
    (``hold_outputs=False``), but the forward keeps it to its end, and a region that makes it returns it, so the
    region's re-run keeps it to its end too (a T5 region from the encoder to the decoder measured 32,768 bytes
    over its prediction under autocast while the model let it die in its last reader)."""
    dropped, returned = _encoder_decoder(False), _encoder_decoder(True)
    forward = [e.total_bytes for e in simulate(returned, Schedule()).events if e.phase is Phase.FORWARD]
    assert forward == [1000 + 150, 1000 + 180, 1000 + 205, 1000 + 205]  # encoder_out, a0, a1, a2, h
    assert simulate(dropped, Schedule()).peak_bytes == 1000 + 180  # encoder_out dies in decoder0
    region = Schedule((Region(0, 3),))

    def recompute(problem):
        return next(e.total_bytes for e in simulate(problem, region).events if e.phase is Phase.RECOMPUTE)

    assert recompute(returned) == 1000 + 100 + 50 + 30 + 20  # decoder1 re-runs beside encoder_out
    assert recompute(dropped) == 1000 + 100 + 50 + 30  # at its most while decoder0 re-runs
    assert not returned.is_chain() and dropped.is_chain()


def test_a_region_that_made_some_of_the_inputs_a_stage_frees_holds_only_the_others_through_its_re_run():
    """Stage 2 reads ``b0`` (made by stage 0) and ``b1`` (stage 1) last and nothing saves them: its working set
    holds both through its re-run, as a region holds its inputs. A region from stage 1 made ``b1``, which dies
    inside stage 2's re-run (12 bytes less at its peak); one from stage 0 made both (20 less)."""
    saving = (InputSaving(since=1, option_bytes=(12,)), InputSaving(since=0, option_bytes=(20,)))
    stages = (Stage("s0", 1.0, 2.0), Stage("s1", 1.0, 2.0),
              Stage("s2", 1.0, 2.0, backward_workspace_bytes=0, input_savings=saving))
    tensors = (TensorInfo("b0", 8, 0, consumers=frozenset({2}), node="b0"),
               TensorInfo("b1", 12, 1, consumers=frozenset({2}), node="b1"),
               TensorInfo("a2", 500, 2, savers=frozenset({2}), node="a2"))
    problem = Problem(stages, tensors)

    def recompute(start):
        region = Region(start, 3)
        assert input_saving(problem, region, 2) == {2: 0, 1: 12, 0: 20}[start]
        return next(e.total_bytes for e in simulate(problem, Schedule((region,))).events
                    if e.phase is Phase.RECOMPUTE)

    assert recompute(2) == 8 + 12 + 500  # both are the region's inputs
    assert recompute(1) == 8 + 12 + 500 - 12
    assert recompute(0) == 8 + 12 + 500 - 20
    with pytest.raises(ValueError, match="saves on inputs"):
        Problem((Stage("s0", 1.0, 2.0, input_savings=saving[:1]),), ())


def test_a_stage_needs_more_in_its_forward_while_something_holds_a_tensor_it_frees_early():
    """The norm's output ``a`` is read last by the layer and saved by nothing: eager frees it inside the layer,
    whose measured workspace is what is left beside it. Held through the layer (a region starting there keeps it
    as its input; the norm's cache keeps it, the layer stored or in the norm's region), the layer's forward needs
    ``Stage.held_inputs`` says (1200) more; made and freed inside one region, it does not."""
    problem = held_norm_output(held_forward=1200)

    def layer_forward(*regions):
        return next(e.total_bytes for e in simulate(problem, Schedule(regions)).events
                    if e.phase is Phase.FORWARD and e.stage == 1)

    assert layer_forward() == 100 + 500 + 300 + 10  # a, what the norm and the layer save, c
    assert layer_forward(Region(1, 2)) == 100 + 500 + 10 + 1200
    assert layer_forward(Region(0, 1, (1,))) == 100 + 300 + 10 + 1200
    assert layer_forward(Region(0, 2, (1, 0))) == 100 + 10 + 1200
    assert layer_forward(Region(0, 2)) == 100 + 10


def _with_a_residual_stage() -> Problem:
    """Two MLP stages, each saving 400 bytes, with a residual add between them that saves nothing."""
    stages = (Stage("mlp0", 1.0, 2.0), Stage("add", 0.1, 0.1, saves_nothing=True), Stage("mlp1", 1.0, 2.0))
    tensors = (TensorInfo("a0", 400, 0, savers=frozenset({0})), TensorInfo("h0", 100, 0, frozenset({1})),
               TensorInfo("h1", 100, 1, frozenset({2})), TensorInfo("a1", 400, 2, savers=frozenset({2})))
    return Problem(stages, tensors, fixed_bytes=1000)


def test_a_region_of_stages_that_save_nothing_is_dropped_and_no_plan_keeps_one():
    problem = _with_a_residual_stage()
    uniform = Schedule.uniform(3)
    kept = without_empty_regions(problem, uniform)
    assert [(r.start, r.stop) for r in kept.regions] == [(0, 1), (2, 3)]
    assert without_empty_regions(problem, kept) is kept
    assert without_empty_regions(problem, Schedule((Region(0, 2),))).regions == (Region(0, 2),)  # mlp0 saves
    before, after = simulate(problem, uniform), simulate(problem, kept)
    assert after.peak_bytes <= before.peak_bytes and after.recompute_seconds <= before.recompute_seconds
    for method in ("auto", "ilp", "dp", "uniform", "chen_sqrt"):
        plan = solve(problem, before.peak_bytes, method=method)
        assert all(not all(problem.stages[k].saves_nothing for k in range(r.start, r.stop)) for r in plan.regions)
        assert plan.predicted_peak_bytes == simulate(problem, plan.schedule).peak_bytes
    uniform_plan = solve(problem, before.peak_bytes, method="uniform")
    assert [(r.start, r.stop) for r in uniform_plan.regions] == [(0, 1), (2, 3)]


def test_a_cached_tensor_the_next_stage_saves_last_counts_once_in_its_backward():
    """``cached_head_input``: the layer saves the block's output ``x`` (200 bytes) and frees it early in its
    backward; its workspace (3,000) holds ``x`` at its peak and needs 300 less once ``x`` is gone. Stored, the
    layer's backward event counts ``x`` in the workspace alone; with the block's region caching ``x``, ``x`` is
    alive past the layer's backward (until the block's re-run), and counts once: the workspace beside it is
    3,000 - min(0 + 200, 300) = 2,800. With a region caching nothing, ``x`` is the block's output, held by the
    layer alone: nothing changes."""
    problem = cached_head_input()

    def layer_backward(schedule):
        return next(e for e in simulate(problem, schedule).events if (e.phase, e.stage) == (Phase.BACKWARD, 1))

    stored = layer_backward(Schedule())  # block_saved 500, head's gradients 0: 500 + 3,000
    assert (stored.activation_bytes, stored.workspace_bytes, stored.total_bytes) == (500, 3000, 3500)
    cached = layer_backward(Schedule((Region(0, 1, (1,)),)))  # x cached, block_saved recomputed
    assert (cached.activation_bytes, cached.workspace_bytes, cached.total_bytes) == (200, 2800, 3000)
    plain = layer_backward(Schedule((Region(0, 1, (0,)),)))
    assert (plain.activation_bytes, plain.workspace_bytes) == (0, 3000)
    region = layer_backward(Schedule((Region(0, 1, (1,)), Region(1, 3))))  # the layer first of a region
    assert (region.activation_bytes, region.workspace_bytes) == (200, 2800)
