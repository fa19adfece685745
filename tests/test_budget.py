import pytest

from planner.budget import Budget, format_bytes, format_bytes_apart, parse_budget
from planner.errors import PlannerError


@pytest.mark.parametrize("text, expected", [
    ("8GB", 8 * 10**9), ("8 GB", 8 * 10**9), ("512MiB", 512 * 2**20), ("1.5GiB", int(1.5 * 2**30)),
    ("100kB", 100_000), ("64KiB", 65536), ("123", 123), ("2e3B", 2000), (4096, 4096), (1.5e9, 1_500_000_000),
])
def test_absolute_budgets_follow_si_and_iec_units(text, expected):
    assert parse_budget(text).absolute_bytes == expected


def test_percentages_resolve_against_the_eager_peak():
    budget = parse_budget("60%")
    assert budget.fraction_of_eager == pytest.approx(0.6)
    assert budget.resolve(eager_peak_bytes=2000) == 1200
    assert parse_budget("8GB").resolve(eager_peak_bytes=1) == 8 * 10**9


@pytest.mark.parametrize("bad", ["", "eight GB", "8 GX", "-5GB", "0%", "0", 0, -1, True, None, [1], "5%%"])
def test_malformed_budgets_raise_planner_error_with_a_hint(bad):
    with pytest.raises(PlannerError) as info:
        parse_budget(bad)
    assert "Hint:" in str(info.value)
    assert "budget" in str(info.value)


def test_budget_objects_pass_through():
    budget = Budget("1KB", absolute_bytes=1000)
    assert parse_budget(budget) is budget


def test_format_bytes_uses_binary_units():
    assert format_bytes(512) == "512 B"
    assert format_bytes(2048) == "2.00 KiB"
    assert format_bytes(5 * 2**20) == "5.00 MiB"
    assert format_bytes(3 * 2**40) == "3072.00 GiB"


def test_format_bytes_apart_shows_bytes_only_where_the_prints_agree():
    assert format_bytes_apart(2 * 2**20, 3 * 2**20) == ("2.00 MiB", "3.00 MiB")
    short, needed = format_bytes_apart(1_975_000, 1_975_304)
    assert short != needed and "1,975,000 B" in short and "1,975,304 B" in needed
    assert format_bytes_apart(5, 5) == ("5 B", "5 B")
