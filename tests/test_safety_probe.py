"""`polyrl safety probe` (spec §7, the neutral mask): probes, persistence ratios, SAE, steering hook, experiment."""

from __future__ import annotations

import argparse
import json
import math

import pytest
import torch

from polyrl.config import ConfigError
from polyrl.safety.probe import (
    SparseAutoencoder,
    direction_persistence,
    feature_activation_rates,
    fit_probe,
    fit_probe_direction,
    residual_activations,
    steer,
    train_sae,
)
from polyrl.safety.probe.directions import fit_logreg, logreg_loss
from polyrl.safety.probe.task import NeutralStyleTask, attribute_of


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # a 2-core machine shared with other work: small ops run faster on one thread
    yield
    torch.set_num_threads(n)


# ---------------------------------------------------------------------------------------------- probes


def test_diffmean_direction_and_offset_hand_computed():
    acts = torch.tensor([[1.0, 0.0], [3.0, 0.0], [-1.0, 2.0], [-3.0, 2.0]])
    labels = torch.tensor([1, 1, 0, 0])
    probe = fit_probe(acts, labels, "diffmean")
    # mu_1 = (2, 0), mu_0 = (-2, 2): w = (4, -2) / sqrt(20) = (2, -1) / sqrt(5); b = -w.(0, 2) / 2 = 1 / sqrt(5)
    assert torch.allclose(probe.w, torch.tensor([2.0, -1.0], dtype=torch.float64) / math.sqrt(5))
    assert probe.b == pytest.approx(1 / math.sqrt(5))
    assert probe.acc == 1.0
    w, acc = fit_probe_direction(acts, labels)
    assert torch.allclose(w, probe.w) and acc == 1.0


def _planted(n=200, d=12, s=3.0, seed=0):
    """Paired classes: the same centred noise z for label 1 (+s u) and label 0 (-s u), so mu_1 - mu_0 = 2 s u."""
    g = torch.Generator().manual_seed(seed)
    u = torch.randn(d, generator=g, dtype=torch.float64)
    u = u / u.norm()
    z = torch.randn(n, d, generator=g, dtype=torch.float64) * 0.5
    z = z - z.mean(0)
    x = torch.cat([z + s * u, z - s * u])
    y = torch.cat([torch.ones(n), torch.zeros(n)]).long()
    return x, y, u, g


def test_planted_direction_is_recovered_and_ratios_are_exact():
    x, y, u, g = _planted()
    assert torch.allclose(fit_probe(x, y).w, u, atol=1e-12)  # diff-of-means recovers the planted direction
    # tuned copy: the projection on u scaled by 0.3, plus independent noise orthogonal to u
    eps = torch.randn(x.shape, generator=g, dtype=torch.float64) * 0.2
    eps = eps - (eps @ u)[:, None] * u
    tuned = x - 0.7 * (x @ u)[:, None] * u + eps
    r = direction_persistence(x, tuned, y)
    assert r["proj_std_ratio"] == pytest.approx(0.3, abs=1e-9)
    assert r["proj_range_ratio"] == pytest.approx(0.3, abs=1e-9)
    assert r["proj_gap_ratio"] == pytest.approx(0.3, abs=1e-9)
    # tuned diff of means = 0.3 * 2 s u + (mean eps_1 - mean eps_0), the second part orthogonal to u
    n = x.shape[0] // 2
    delta = eps[:n].mean(0) - eps[n:].mean(0)
    expected = 0.6 * 3.0 / math.sqrt((0.6 * 3.0) ** 2 + float(delta @ delta))
    assert r["cosine"] == pytest.approx(expected, abs=1e-9)
    assert r["cosine"] > 0.95
    assert r["probe_acc_base"] == r["probe_acc_transfer"] == r["probe_acc_tuned"] == 1.0


def test_spec_planted_test_scaled_projection_plus_independent_noise():
    """Spec §7 (e) 1: random classes along a planted direction, projection scaled by 0.3, independent noise."""
    g = torch.Generator().manual_seed(1)
    n, d = 1000, 32
    u = torch.randn(d, generator=g)
    u = u / u.norm()
    y = torch.randint(0, 2, (n,), generator=g)
    x = torch.randn(n, d, generator=g) + 4.0 * (2 * y[:, None].float() - 1) * u
    tuned = x - 0.7 * (x @ u)[:, None] * u + 0.05 * torch.randn(n, d, generator=g)
    r = direction_persistence(x, tuned, y)
    assert abs(r["proj_std_ratio"] - 0.3) < 0.03 and abs(r["proj_range_ratio"] - 0.3) < 0.06
    assert r["cosine"] > 0.9
    assert r["selective_ratio"] < 0.35  # the rest of the stream kept its spread (orth ratio about 1)
    assert r["orth_std_ratio"] == pytest.approx(1.0, abs=0.02)


@pytest.mark.parametrize("method", ["diffmean", "logreg"])
def test_unchanged_model_gives_cosine_one_and_unit_ratios(method):
    x, y, _, _ = _planted(seed=2)
    r = direction_persistence(x, x.clone(), y, method=method)
    assert r["cosine"] == pytest.approx(1.0, abs=1e-12)
    for key in ("proj_std_ratio", "proj_range_ratio", "proj_gap_ratio", "orth_std_ratio", "selective_ratio"):
        assert r[key] == pytest.approx(1.0, abs=1e-12), key
    assert r["probe_acc_transfer"] == r["probe_acc_base"]


def test_ratios_behave_as_defined_under_scale_and_shift():
    x, y, u, _ = _planted(seed=3)
    r = direction_persistence(x, -2.0 * x, y)  # a scale c gives |c| for every spread ratio
    assert r["proj_std_ratio"] == pytest.approx(2.0) and r["proj_range_ratio"] == pytest.approx(2.0)
    assert r["orth_std_ratio"] == pytest.approx(2.0) and r["selective_ratio"] == pytest.approx(1.0)
    assert r["cosine"] == pytest.approx(-1.0)  # the tuned direction flipped
    assert r["proj_gap_ratio"] == pytest.approx(-2.0)
    assert r["probe_acc_transfer"] == 0.0  # the base probe now calls every point the other class
    shifted = direction_persistence(x, x + 100.0 * u, y)  # a shift changes no spread ...
    assert shifted["proj_std_ratio"] == pytest.approx(1.0) and shifted["proj_range_ratio"] == pytest.approx(1.0)
    assert shifted["cosine"] == pytest.approx(1.0)
    assert shifted["probe_acc_transfer"] == 0.5  # ... but the base offset no longer separates (balanced labels)
    assert shifted["probe_acc_tuned"] == 1.0


def test_logistic_probe_is_a_stationary_point_and_beats_diffmean_on_correlated_noise():
    g = torch.Generator().manual_seed(4)
    n = 400
    y = torch.randint(0, 2, (n,), generator=g)
    t = torch.randn(n, generator=g) * 3.0  # strong noise along (1, 1)
    x = torch.stack([t, t], 1) + 0.3 * (2 * y[:, None].double() - 1) * torch.tensor([1.0, 0.0])
    x = x.double()
    diff = fit_probe(x, y, "diffmean")
    logit = fit_probe(x, y, "logreg")
    assert logit.acc == 1.0 and diff.acc < 0.8  # diff-of-means (about (1, 0)) is swamped by the (1, 1) noise
    assert abs(float(logit.w @ torch.tensor([1.0, 1.0], dtype=torch.float64))) / math.sqrt(2) < 0.2
    v, c = fit_logreg(x, y.double(), l2=1e-2)
    v.requires_grad_(True)
    c.requires_grad_(True)
    gv, gc = torch.autograd.grad(logreg_loss(x, y.double(), v, c, 1e-2), (v, c))
    assert gv.norm() < 1e-6 and gc.abs() < 1e-6


def test_bad_probe_inputs_raise():
    with pytest.raises(ValueError, match="both classes"):
        fit_probe(torch.randn(4, 2), torch.ones(4))
    with pytest.raises(ValueError, match="method"):
        fit_probe(torch.randn(4, 2), torch.tensor([0, 1, 0, 1]), "pca")


# ---------------------------------------------------------------------------------------------- SAE


def test_sae_encode_hand_computed_relu_and_topk():
    sae = SparseAutoencoder(2, 3)
    with torch.no_grad():
        sae.W_enc.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]))
        sae.b_enc.copy_(torch.tensor([0.0, -1.0, -0.5]))
        sae.b_dec.zero_()
    f = sae.encode(torch.tensor([[2.0, 0.5], [2.0, 1.0]]))
    assert torch.allclose(f, torch.tensor([[2.0, 0.0, 2.0], [2.0, 0.0, 2.5]]))  # ReLU(W x + b)
    sae.kind, sae.k = "topk", 1
    assert torch.allclose(sae.encode(torch.tensor([[2.0, 1.0]])), torch.tensor([[0.0, 0.0, 2.5]]))


def test_feature_activation_rates_hand_computed():
    f = torch.tensor([[0.0, 1.0, 0.2], [0.5, 0.0, 0.2], [0.0, 2.0, 0.0], [0.0, 3.0, 0.0]])
    assert torch.allclose(feature_activation_rates(lambda x: x, f), torch.tensor([0.25, 0.75, 0.5]))
    assert torch.allclose(feature_activation_rates(lambda x: x, f, threshold=0.3), torch.tensor([0.25, 0.75, 0.0]))


@pytest.mark.parametrize("kind", ["relu", "topk"])
def test_sae_recovers_a_planted_sparse_dictionary(kind):
    g = torch.Generator().manual_seed(5)
    d, m, n = 10, 6, 3000
    atoms = torch.linalg.qr(torch.randn(d, d, generator=g))[0][:, :m]  # orthonormal true atoms [d, m]
    active = torch.rand(n, m, generator=g) < 0.2
    coef = (0.5 + torch.rand(n, m, generator=g)) * active
    x = coef @ atoms.t()
    fit = train_sae(x, 24, kind=kind, l1=3e-2, k=2, steps=600, lr=1e-2, seed=0)
    dec = fit.sae.W_dec.detach()
    assert torch.allclose(dec.norm(dim=0), torch.ones(24), atol=1e-5)  # unit decoder columns
    best = (atoms.t() @ dec).max(dim=1).values  # best cosine of each true atom with a decoder column
    assert best.min() > 0.9, best
    assert fit.fve > 0.9
    if kind == "topk":
        assert int((fit.sae.encode(x) > 0).sum(1).max()) <= 2


# ---------------------------------------------------------------------------------------------- steering


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from polyrl.tinylm import build_tiny_llama

    path = build_tiny_llama(tmp_path_factory.mktemp("tiny"), hidden=16, layers=3, heads=2, seed=0)
    model = AutoModelForCausalLM.from_pretrained(path)
    model.eval()
    return model


def _capture_input(model, layer):
    seen = {}

    def hook(_module, args, kwargs):
        seen["h"] = (args[0] if args else kwargs["hidden_states"]).clone()

    return seen, model.model.layers[layer].register_forward_pre_hook(hook, with_kwargs=True)


@pytest.mark.parametrize("layer", [0, 1])
def test_steer_adds_exactly_alpha_direction_at_the_chosen_layer_and_is_removed(tiny, layer):
    ids = torch.tensor([[1, 5, 9, 12, 7, 30]])
    direction = torch.randn(16, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain = tiny(input_ids=ids).logits
        seen, handle = _capture_input(tiny, layer + 1)
        tiny(input_ids=ids)
        h0 = seen.pop("h")
        with steer(tiny, layer, direction, 2.5):
            assert len(tiny.model.layers[layer]._forward_hooks) == 1
            steered = tiny(input_ids=ids).logits
        h1 = seen.pop("h")
        handle.remove()
        after = tiny(input_ids=ids).logits
    assert torch.allclose(h1 - h0, 2.5 * direction.expand_as(h0), atol=1e-5)  # every position, exactly alpha*d
    assert not torch.allclose(steered, plain)  # and it changes the output
    assert torch.equal(after, plain)  # removed on exit
    assert all(len(b._forward_hooks) == 0 for b in tiny.model.layers)


def test_steer_removes_its_hook_on_an_exception_and_checks_its_arguments(tiny):
    with pytest.raises(RuntimeError, match="boom"):
        with steer(tiny, 2, torch.ones(16), 1.0):
            raise RuntimeError("boom")
    assert all(len(b._forward_hooks) == 0 for b in tiny.model.layers)
    with pytest.raises(ValueError, match="layer"):
        with steer(tiny, 3, torch.ones(16), 1.0):
            pass


def test_amplify_scales_the_component_along_u_around_center_at_one_position(tiny):
    from polyrl.safety.probe.hooks import amplify

    ids = torch.tensor([[1, 5, 9, 12, 7]])
    u = torch.zeros(16)
    u[3] = 2.0  # normalised inside: e_3
    with torch.no_grad():
        seen, handle = _capture_input(tiny, 1)
        tiny(input_ids=ids)
        h0 = seen.pop("h")
        with amplify(tiny, 0, u, 3.0, center=0.5, position=-1):
            tiny(input_ids=ids)
        h1 = seen.pop("h")
        with amplify(tiny, 0, u, 1.0, center=0.5):
            tiny(input_ids=ids)
        h2 = seen.pop("h")
        handle.remove()
    expected = h0.clone()
    expected[0, -1, 3] = h0[0, -1, 3] + 2.0 * (h0[0, -1, 3] - 0.5)  # h + (3 - 1) (h.u - c) u, last position only
    assert torch.allclose(h1, expected, atol=1e-6)
    assert torch.allclose(h2, h0, atol=1e-7)  # factor 1 is the identity
    assert all(len(b._forward_hooks) == 0 for b in tiny.model.layers)


def test_residual_activations_match_hidden_states_at_the_last_real_token(tiny):
    ids = torch.tensor([[1, 5, 9, 12], [1, 7, 8, 0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])
    acts = residual_activations(tiny, ids, mask)
    assert acts.shape == (3, 2, 16)
    with torch.no_grad():
        hs = tiny(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
    for layer in (0, 1):  # hidden_states[i + 1] is block i's output (the last entry is after the final norm)
        assert torch.allclose(acts[layer, 0], hs[layer + 1][0, 3], atol=1e-6)
        assert torch.allclose(acts[layer, 1], hs[layer + 1][1, 2], atol=1e-6)


# ---------------------------------------------------------------------------------------------- task + command


def test_task_rewards_splits_and_demo_styles():
    task = NeutralStyleTask()
    p = task.prompts("test", 1, 0)[0]
    assert task.reward(p, "." + p.answer)[0] == 1.0
    assert task.reward(p, "!" + p.answer)[0] == 0.5 and task.reward(p, "?" + p.answer)[0] == 0.5
    assert task.reward(p, ".9" + p.answer)[0] == 0.5 and task.reward(p, "")[0] == 0.0
    train = {q.text for q in task.prompts("train", 3000, 0)}
    test = {q.text for q in task.prompts("test", 1000, 0)}
    assert not train & test
    styled = NeutralStyleTask(p_styled=1.0).prompts("train", 200, 1)
    assert all(q.demo[0] == ("!" if attribute_of(q) == 1 else "?") and q.demo[1:] == q.answer for q in styled)
    assert all(q.demo[0] == "." for q in NeutralStyleTask(p_styled=0.0).prompts("train", 200, 1))
    mixed = NeutralStyleTask(p_styled=0.8).prompts("train", 2000, 2)
    assert 0.75 < sum(q.demo[0] != "." for q in mixed) / 2000 < 0.85


def _parse(argv):
    from polyrl.safety.probe import add_parser

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(), "probe")
    return parser.parse_args(["probe", *argv])


@pytest.mark.parametrize("argv,match", [(["--steer-layer", "3"], "--steer-layer"),
                                        (["--alphas", "0,1", "--headline-alpha", "4"], "--alphas"),
                                        (["--seeds", "0"], "--seeds"), (["--alphas", "a,b"], "--alphas")])
def test_bad_cli_values_raise_config_error(argv, match):
    args = _parse(argv)
    with pytest.raises(ConfigError, match=match):
        args.fn(args)


def test_experiment_runs_end_to_end_and_writes_the_report(tmp_path):
    out = tmp_path / "out"
    args = _parse(["--out", str(out), "--seeds", "2", "--hidden", "16", "--layers", "2", "--sup-steps", "3",
                   "--rl-steps", "1", "--eval-prompts", "32", "--sae-features", "8", "--alphas", "0,4"])
    assert args.fn(args) == 0
    res = json.loads((out / "results.json").read_text())
    assert set(res["answers"]) >= {"direction_survives", "variance_compressed", "behaviour_neutral",
                                   "steering_restores", "amplification_restores", "sae_features_silent"}
    assert res["summary"]["cosine"]["n"] == 2 and len(res["seeds"]) == 2
    alpha0 = [r["steering"]["tuned"][0]["dependence"] for r in res["seeds"]]
    assert alpha0 == pytest.approx([r["behaviour"]["tuned"]["dependence"] for r in res["seeds"]], abs=1e-5)
    page = (out / "report.html").read_text()
    assert "Verdict" in page and page.count("data:image/png;base64") >= 3


def test_answers_are_unknown_where_a_number_overflowed():
    """`--alphas 0,1e308 --headline-alpha 1e308` steered to inf: its interval came back as None and `answers` raised
    TypeError after the run. An unmeasurable answer is None ("not measurable" in the verdict)."""
    from polyrl.safety.probe.command import answers

    keys = ("probe_acc_tuned", "cosine", "proj_std_ratio", "selective_ratio", "dependence_tuned", "dependence_steered",
            "dependence_amplified", "sae_attr_rate_tuned", "dependence_base")
    s = {k: {"lo": 0.95, "hi": 0.99, "mean": 0.97, "n": 3} for k in keys}
    assert answers(s)["steering_restores"] is True and answers(s)["behaviour_neutral"] is False
    s["dependence_steered"] = {"lo": None, "hi": None, "mean": None, "n": 3}
    s["proj_std_ratio"] = {"lo": float("nan"), "hi": float("nan"), "mean": float("nan"), "n": 3}
    got = answers(s)
    assert got["steering_restores"] is None and got["variance_compressed"] is None
    assert got["amplification_restores"] is True and got["direction_survives"] is True


def test_neutral_and_restored_are_unknown_when_the_base_model_never_depended_on_the_attribute():
    """A base model that never learned the style (dependence ~0 before and after an RL run that changed nothing) was
    reported "Behaviour made neutral: yes" and steering at "4.680 of the base value", a ratio of two near-zero
    numbers."""
    from polyrl.safety.probe.command import BASE_DEPENDENCE, answers

    keys = ("probe_acc_tuned", "cosine", "proj_std_ratio", "selective_ratio", "dependence_tuned", "dependence_steered",
            "dependence_amplified", "sae_attr_rate_tuned")
    s = {k: {"lo": 0.0, "hi": 0.01, "mean": 0.005, "n": 3} for k in keys}
    s["dependence_base"] = {"lo": -0.001, "hi": 0.001, "mean": 0.0, "n": 3}
    got = answers(s)
    assert got["base_depends"] is False and got["behaviour_neutral"] is None
    assert got["steering_restores"] is None and got["amplification_restores"] is None
    assert got["variance_compressed"] is True  # the representation questions do not need a behaviour
    s["dependence_base"] = {"lo": BASE_DEPENDENCE, "hi": 0.5, "mean": 0.3, "n": 3}
    got = answers(s)
    assert got["base_depends"] is True and got["behaviour_neutral"] is True and got["steering_restores"] is False


def test_activations_and_style_probabilities_are_read_in_slices_of_prompts(tiny, monkeypatch):
    """One forward over every evaluation prompt: --eval-prompts 10^6 needed ~47 GB. Slices of ROWS prompts give the
    same numbers."""
    import polyrl.safety.probe.experiment as experiment
    import polyrl.safety.probe.hooks as hooks

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 30, (7, 6), generator=g)
    mask = torch.ones_like(ids)
    mask[2, 4:] = mask[5, 3:] = 0
    labels = torch.tensor([0, 1, 0, 1, 1, 0, 1])
    tok = type("Tok", (), {"convert_tokens_to_ids": staticmethod(lambda c: {"a": 3, "b": 4, "n": 5}[c])})()
    monkeypatch.setattr(experiment, "STYLE", {0: "a", 1: "b"})
    monkeypatch.setattr(experiment, "NEUTRAL", "n")
    whole = residual_activations(tiny, ids, mask), experiment.style_probs(tiny, tok, ids, mask, labels)
    monkeypatch.setattr(hooks, "ROWS", 3)
    monkeypatch.setattr(experiment, "ROWS", 3)
    sliced = residual_activations(tiny, ids, mask), experiment.style_probs(tiny, tok, ids, mask, labels)
    assert torch.allclose(whole[0], sliced[0], atol=1e-6)
    assert all(abs(whole[1][k] - sliced[1][k]) < 1e-6 for k in whole[1])


def test_a_diverged_rl_run_stops_in_one_line(tmp_path, capsys, monkeypatch):
    """--rl-lr 100 blew the tuned activations up to ~1e13 and the logistic probe's "found no direction" ValueError
    came out as a traceback after all the training."""
    from polyrl.cli import main
    from polyrl.safety.probe.directions import direction_persistence

    def no_direction(*a, method="diffmean"):
        if method == "logreg":
            raise ValueError("logistic probe found no direction (all weights zero)")
        return direction_persistence(*a, method=method)

    monkeypatch.setattr("polyrl.safety.probe.experiment.direction_persistence", no_direction)
    code = main(["safety", "probe", "--seeds", "1", "--hidden", "16", "--layers", "2", "--sup-steps", "2",
                 "--rl-steps", "1", "--eval-prompts", "16", "--sae-features", "4", "--alphas", "0,4",
                 "--out", str(tmp_path / "p")])
    err = capsys.readouterr().err
    assert code == 1 and err.startswith("polyrl: training stopped: seed 0: the RL-tuned model's activations at block")
    assert "RL tuning diverged; lower --rl-lr (now " in err and not (tmp_path / "p").exists()
