"""Presets resolve to exactly the documented parts; docs/methods.md is generated and never stale."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from polyrl.catalog import method_row, render_methods_markdown
from polyrl.methods import PRESETS, get_method
from polyrl.objectives import override, policy_loss
from tests.helpers import make_inputs

DOCS = Path(__file__).resolve().parents[1] / "docs" / "methods.md"

ISSUE_PRESETS = {
    "reinforce", "a2c", "ppo", "grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "dr_grpo", "dapo", "cispo",
    "gspo", "gspo_token", "maxrl", "dppo_tv", "dppo_kl", "scalerl", "cppo", "drpo", "spo", "ce_gppo", "pspo", "bapo",
    "sapo", "sspo", "troll", "turn_ppo", "s_ppo", "st_ppo", "humanline_grpo", "gdpo",
}


def test_every_named_method_has_a_preset():
    assert ISSUE_PRESETS <= set(PRESETS)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_resolves_with_paper_and_summary(name):
    m = get_method(name)
    assert m.name == name
    assert m.paper.startswith("https://") and m.summary


def test_docs_methods_md_is_current():
    assert DOCS.exists(), "run `polyrl docs --write docs/methods.md`"
    assert DOCS.read_text() == render_methods_markdown(), "docs/methods.md is stale: run `make docs`"


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_matches_its_row_in_docs(name):
    """Parse the committed table and compare every column with the resolved preset."""
    rows = [line for line in DOCS.read_text().splitlines() if line.startswith(f"| **{name}** |")]
    assert len(rows) == 1
    cells = [c.strip().strip("`") for c in rows[0].strip("|").split(" | ")]
    expected = list(method_row(get_method(name)).values())
    assert cells[1:] == expected[1:]


def test_dapo_is_token_mean_clip_higher_overlong_and_dynamic_sampling():
    m = get_method("dapo")
    assert m.aggregation.name == "token_mean"
    assert m.trust_region.name == "clip"
    assert (m.trust_region.params["eps_low"], m.trust_region.params["eps_high"]) == (0.2, 0.28)
    assert [s.name for s in m.shapers] == ["overlong_soft"]
    assert [f.name for f in m.filters] == ["zero_variance"]
    assert m.kl is None


def test_divergence_presets_anchor_to_the_rollout_policy():
    for name in ("dppo_tv", "dppo_kl", "cppo", "drpo", "scalerl"):
        assert get_method(name).anchor == "rollout", name
    assert get_method("grpo").anchor == "old"


def test_critic_presets_need_values():
    critics = {"a2c", "ppo", "spo", "turn_ppo", "s_ppo", "st_ppo", "ppo_adaptive_kl"}
    assert {n for n in PRESETS if get_method(n).needs_values} == critics


def test_grpo_all_equal_rewards_leave_only_the_kl_gradient():
    """GRPO property: equal rewards in a group -> A = 0 -> only the KL term moves the policy."""
    from polyrl.registry import ADVANTAGES, KL

    inp = make_inputs(B=4, T=5, seed=2, group_size=4)
    adv = ADVANTAGES.fn("grpo")(torch.ones(4, dtype=torch.float64), inp.group_ids, inp.mask)
    assert torch.count_nonzero(adv) == 0
    inp.adv = adv[:, None].expand_as(inp.logp) if adv.dim() == 1 else adv
    m = get_method("grpo")
    out = policy_loss(inp, m)
    (g,) = torch.autograd.grad(out.loss, inp.topk_logp)
    kl = KL.fn("k3")(inp.logp, inp.ref_logp, inp.old_logp)
    per_seq = (kl * inp.mask).sum(-1) / inp.mask.sum(-1)
    (g_kl,) = torch.autograd.grad(m.kl_coef * per_seq.sum() / inp.normalizer.num_seqs, inp.topk_logp)
    torch.testing.assert_close(g, g_kl)
    assert g.abs().sum() > 0


def test_a2c_equals_ppo_with_one_epoch_over_one_full_batch():
    """arXiv:2205.09123: at theta_old the clip never engages, so one PPO update == one A2C update."""
    torch.manual_seed(0)
    obs, V = torch.randn(16, 5), 7
    policy_a = torch.nn.Linear(5, V)
    policy_b = torch.nn.Linear(5, V)
    policy_b.load_state_dict(policy_a.state_dict())
    with torch.no_grad():
        actions = torch.distributions.Categorical(logits=policy_a(obs)).sample()
    returns = torch.randn(16)
    a2c, ppo = get_method("a2c"), override(get_method("ppo"), kl=None, kl_coef=0.0)
    from polyrl.types import LossInputs, Normalizer

    def step(policy, method):
        opt = torch.optim.RMSprop(policy.parameters(), lr=7e-4, alpha=0.99, eps=1e-5)
        logp = torch.log_softmax(policy(obs), -1).gather(-1, actions[:, None])  # [16, 1]: one token each
        mask = torch.ones_like(logp)
        inp = LossInputs(logp=logp, old_logp=logp.detach(), adv=returns[:, None], mask=mask,
                         normalizer=Normalizer.from_batch(mask, torch.arange(16)))
        opt.zero_grad()
        policy_loss(inp, method).loss.backward()
        opt.step()

    step(policy_a, a2c)
    step(policy_b, ppo)
    for pa, pb in zip(policy_a.parameters(), policy_b.parameters()):
        torch.testing.assert_close(pa, pb)
