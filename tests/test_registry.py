"""Parameter validation: every bad setting is one clear error naming part, parameter, value and rule."""

from __future__ import annotations

from typing import Literal

import pytest
import torch

import polyrl.methods  # noqa: F401
from polyrl.methods import get_method
from polyrl.registry import TRUST_REGIONS, PartError, Registry, parse_part


@pytest.fixture()
def reg():
    r = Registry("widget", 1)

    @r.register("w", ranges={"eps": ">=0", "p": "[0, 1]"},
                check=lambda p: "lo must not exceed hi" if p["lo"] > p["hi"] else None)
    def w(x, *, eps: float = 0.1, p: float = 0.5, n: int = 3, flag: bool = False,
          mode: Literal["a", "b"] = "a", cap: float | None = None, lo: float = 0.0, hi: float = 1.0):
        """Do nothing useful."""
        return x

    return r


def test_defaults_are_filled_and_strings_are_coerced(reg):
    part = reg.resolve("w", {"eps": "0.3", "n": "5", "flag": "true", "mode": "b", "cap": "none"})
    assert dict(part.params) == {"eps": 0.3, "p": 0.5, "n": 5, "flag": True, "mode": "b", "cap": None,
                                 "lo": 0.0, "hi": 1.0}
    assert str(reg.resolve("w", {})) .startswith("w:eps=0.1")


@pytest.mark.parametrize(
    "params, fragments",
    [
        ({"epz": 0.1}, ["widget 'w'", "unknown parameter 'epz'", "did you mean 'eps'", "allowed parameters"]),
        ({"eps": -0.1}, ["'eps' = -0.1", "out of range", ">=0"]),
        ({"p": 1.5}, ["'p' = 1.5", "[0, 1]"]),
        ({"eps": "abc"}, ["'eps' = 'abc'", "must be float"]),
        ({"n": 2.5}, ["'n' = 2.5", "must be int"]),
        ({"flag": 1.0}, ["'flag'", "must be bool"]),
        ({"mode": "c"}, ["'mode' = 'c'", "one of 'a', 'b'"]),
        ({"eps": float("nan")}, ["'eps' = nan"]),
        ({"lo": 2.0}, ["lo must not exceed hi"]),
    ],
)
def test_bad_settings_name_everything(reg, params, fragments):
    with pytest.raises(PartError) as e:
        reg.resolve("w", params)
    msg = str(e.value)
    assert "\n" not in msg
    for f in fragments:
        assert f in msg, (f, msg)


def test_unknown_part_suggests_the_nearest(reg):
    with pytest.raises(PartError, match=r"unknown widget 'ww' \(did you mean 'w'\?\); allowed: w"):
        reg.resolve("ww")


def test_registration_requires_typed_defaults():
    r = Registry("x", 1)
    with pytest.raises(ValueError, match="needs a default"):
        r.register("a")(lambda t, *, eps: t)

    def untyped(t, *, eps=0.1):
        return t

    with pytest.raises(ValueError, match="type annotation"):
        r.register("b")(untyped)


def test_parse_part():
    assert parse_part("dppo_tv:delta_low=0.1,delta_high=0.2") == ("dppo_tv", {"delta_low": "0.1", "delta_high": "0.2"})
    assert parse_part(" clip ") == ("clip", {})
    with pytest.raises(PartError, match="key=value"):
        parse_part("clip:eps_low")


def test_builtin_clip_rejects_negative_epsilon_and_bad_dual_clip():
    with pytest.raises(PartError, match="'eps_low' = -0.2"):
        TRUST_REGIONS.resolve("clip", {"eps_low": -0.2})
    with pytest.raises(PartError, match="dual_clip_c"):
        TRUST_REGIONS.resolve("clip", {"dual_clip_c": 0.5})


def test_override_merges_parameters_of_the_same_part_and_resets_for_another():
    dapo = get_method("dapo", trust_region="clip:eps_high=0.3")
    assert dict(dapo.trust_region.params)["eps_low"] == 0.2 and dict(dapo.trust_region.params)["eps_high"] == 0.3
    swapped = get_method("dapo", trust_region="cispo")
    assert swapped.trust_region.name == "cispo"
    with pytest.raises(PartError, match="unknown method 'dapoo'.*did you mean 'dapo'"):
        get_method("dapoo")
    with pytest.raises(PartError, match="kl_coef"):
        get_method("grpo", kl_coef=-1.0)


def test_user_part_registers_and_composes():
    """The README's 'add your own trust region' example, run for real."""
    from polyrl.objectives import build_method, policy_loss
    from tests.helpers import make_inputs

    name = "test_tanh_clip"
    if name not in TRUST_REGIONS:
        @TRUST_REGIONS.register(name, ranges={"scale": ">0"})
        def tanh_clip(inp, log_ratio, *, scale: float = 0.2):
            """Bound the ratio smoothly: l = -(1 + scale * tanh((rho - 1) / scale)) * A."""
            rho = log_ratio.clamp(-20, 20).exp()
            return -(1 + scale * torch.tanh((rho - 1) / scale)) * inp.adv, {}

    m = build_method("mine", advantage="grpo", trust_region=f"{name}:scale=0.1", aggregation="token_mean")
    inp = make_inputs(same_policies=True)
    out = policy_loss(inp, m)
    (g,) = torch.autograd.grad(out.loss, inp.topk_logp)
    torch.testing.assert_close(g[..., 0], -inp.adv * inp.mask / inp.normalizer.num_tokens)
    with pytest.raises(PartError, match="'scale' = 0"):
        build_method("mine", advantage="grpo", trust_region=f"{name}:scale=0", aggregation="token_mean")


def test_registration_refuses_a_signature_the_kind_is_not_called_with_and_a_bad_range_rule():
    """A plugin trust region without log_ratio was accepted and failed with a TypeError in the first training step;
    ranges={"scale": "positive"} failed with a ValueError traceback when a value was checked."""
    r = Registry("trust_region", 2)
    with pytest.raises(PartError, match=r"^trust_region 'one' \(.*\) takes 1 to 1 positional arguments; this "
                                        r"trust_region is called with 2"):
        r.register("one")(lambda inp, *, scale=1.0: inp)  # its settings are never reached
    with pytest.raises(PartError, match="takes 3 to 3 positional arguments"):
        r.register("three")(lambda inp, log_ratio, extra, *, scale=1.0: inp)

    def scaled(inp, log_ratio, *, scale: float = 1.0):
        return inp

    with pytest.raises(PartError, match=r"range rule 'positive' is not one of"):
        r.register("bad_rule", ranges={"scale": "positive"})(scaled)
    r.register("ok", ranges={"scale": "(0, 10]"})(scaled)

    def optional(inp, log_ratio, spare=None, *, scale: float = 1.0):  # called with 2 of its 2 to 3: fine
        return inp

    def varargs(*args, scale: float = 1.0):
        return args

    r.register("optional")(optional)
    r.register("varargs")(varargs)


def test_an_advantage_tagged_for_extra_inputs_may_take_them():
    """needs_greedy advantages are passed the greedy rewards after the five inputs, needs_sum_pi_sq ones two more: a
    plugin ReMax taking them was refused."""
    from polyrl.registry import ADVANTAGES

    def my_remax(rewards, group_ids, mask, values, token_rewards, greedy_rewards, *, eps: float = 1e-6):
        return rewards

    ADVANTAGES.register("test_my_remax", tags=("needs_greedy",))(my_remax)
    try:
        with pytest.raises(PartError, match="takes 6 to 6 positional arguments; this advantage is called with 5"):
            ADVANTAGES.register("test_untagged")(my_remax)
    finally:
        ADVANTAGES._specs.pop("test_my_remax", None)
