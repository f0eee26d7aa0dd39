"""NaN and inf in config values: ``check_range`` refuses them, and one pass over a config's float
fields names the first by its full key (issue 54)."""

import math
from dataclasses import dataclass, field

import pytest

from tandem.config.finite import check_finite_floats, no_limit_at_inf
from tandem.config.overrides import config_from_overrides
from tandem.config.validation import check_finite, check_positive, check_range


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_check_range_refuses_non_finite_values_naming_the_field(value):
    with pytest.raises(ValueError) as error:
        check_range("actor.engine", "lr", value, 0.0, 1.0)
    assert str(error.value) == f"actor.engine.lr={value!r} is not allowed: it must be a finite number"
    with pytest.raises(ValueError, match="lr=.* it must be a finite number"):
        check_range("engine", "lr", value)  # no bounds at all: NaN still fails (every comparison is False)


def test_check_range_takes_inf_only_when_the_field_allows_it_and_the_bounds_still_apply():
    check_range("c", "cap", math.inf, low=0.0, allow_inf=True)
    check_positive("c", "cap", math.inf, allow_inf=True)
    with pytest.raises(ValueError, match=r"c.cap=-inf is outside the allowed range \[0.0, inf\)"):
        check_range("c", "cap", -math.inf, low=0.0, allow_inf=True)
    with pytest.raises(
        ValueError, match=r"c.cap=nan is not allowed: it must be a number or inf \(no limit\)"
    ):
        check_range("c", "cap", math.nan, low=0.0, allow_inf=True)
    check_range("c", "n", 3, 0, 5)  # ints and finite floats pass as before
    check_range("c", "x", 0.5, 0.0, 1.0)
    check_finite("", "a.b", 7)  # not a float: nothing to say


@dataclass(frozen=True)
class Inner:
    rate: float = 0.1
    cap: float = no_limit_at_inf(2.0)
    bounds: tuple[float, float] = (0.9, 0.99)
    clip: float | None = None
    extra: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Outer:
    inner: Inner = field(default_factory=Inner)
    steps: int = 3
    scale: float = 1.0


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["scale=nan"], "scale=nan"),
        (["inner.rate=inf"], "inner.rate=inf"),
        (["inner.rate=-inf"], "inner.rate=-inf"),
        (["inner.cap=nan"], "inner.cap=nan"),
        (["inner.bounds=[0.9,nan]"], "inner.bounds[1]=nan"),
        (["inner.clip=inf"], "inner.clip=inf"),
    ],
)
def test_the_override_loader_names_every_non_finite_float_by_its_full_key(overrides, key):
    with pytest.raises(ValueError) as error:
        config_from_overrides(Outer, overrides)
    assert str(error.value).startswith(f"{key} is not allowed: it must be")


def test_an_instance_is_checked_the_same_way():
    check_finite_floats(Outer, Outer(), prefix="run.")
    broken = Outer(inner=Inner(bounds=(math.inf, 0.9)))
    with pytest.raises(
        ValueError, match=r"^run.inner.bounds\[0\]=inf is not allowed: it must be a finite number$"
    ):
        check_finite_floats(Outer, broken, prefix="run.")


def test_a_field_whose_inf_means_no_limit_takes_inf_from_yaml_and_the_command_line(tmp_path):
    yaml = tmp_path / "run.yaml"
    yaml.write_text("inner:\n  cap: .inf\n  extra:\n    x: .nan\n")
    assert config_from_overrides(Outer, [], str(yaml)).inner.cap == math.inf  # a free-form dict is the user's
    assert config_from_overrides(Outer, ["inner.cap=inf"]).inner.cap == math.inf
    yaml.write_text("scale: .inf\n")
    with pytest.raises(ValueError, match="^scale=inf is not allowed"):
        config_from_overrides(Outer, [], str(yaml))
