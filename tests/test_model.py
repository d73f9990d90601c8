"""load_policy errors and the chunked completion_logprobs against a plain full-logits computation."""

from __future__ import annotations

import shutil

import pytest
import torch

from polyrl.model import completion_logprobs, linear_head, load_policy, process_logits
from polyrl.tinylm import build_tiny_llama


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_llama(tmp_path_factory.mktemp("tiny"), hidden=32, layers=2, heads=2, seed=0)


@pytest.fixture(scope="module")
def policy(model_dir):
    threads = torch.get_num_threads()
    model, tokenizer = load_policy(model_dir)
    torch.set_num_threads(threads)
    with torch.no_grad():  # sharper, less uniform distributions than the 0.02-std init
        gen = torch.Generator().manual_seed(1)
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.2)
    return model, tokenizer


@pytest.fixture
def model64(policy):
    model, _ = policy
    copy = type(model)(model.config).to(torch.float64)
    copy.load_state_dict(model.state_dict())
    return copy.eval()


def make_batch(lengths_prompt, lengths_completion, vocab, seed=0):
    """Left-padded prompts + right-padded completions: input_ids/attention_mask [B, L], mask [B, T]."""
    gen = torch.Generator().manual_seed(seed)
    width_p, width_c = max(lengths_prompt), max(lengths_completion)
    batch = len(lengths_prompt)
    ids = torch.randint(4, vocab, (batch, width_p + width_c), generator=gen)
    attention = torch.zeros(batch, width_p + width_c, dtype=torch.long)
    mask = torch.zeros(batch, width_c)
    for i, (lp, lc) in enumerate(zip(lengths_prompt, lengths_completion)):
        ids[i, : width_p - lp] = 0
        ids[i, width_p + lc :] = 0
        attention[i, width_p - lp : width_p + lc] = 1
        mask[i, :lc] = 1.0
    return ids, attention, mask


def reference(model, ids, attention, mask, temperature=1.0, top_k=None, top_p=None):
    """Full [B, T, V] logits -> log_softmax -> gather; entropy from the full distribution."""
    position_ids = (attention.cumsum(-1) - 1).clamp_min(0)
    logits = model(input_ids=ids, attention_mask=attention, position_ids=position_ids).logits
    width = mask.shape[1]
    logits = logits[:, -width - 1 : -1]
    logprobs = process_logits(logits, temperature=temperature, top_k=top_k, top_p=top_p).log_softmax(-1)
    logp = torch.where(mask == 1, logprobs.gather(-1, ids[:, -width:, None]).squeeze(-1), 0.0)
    p = logprobs.exp()
    entropy = -(p * torch.where(torch.isinf(logprobs), 0.0, logprobs)).sum(-1) * mask
    return logp, entropy, logprobs


LENGTHS = ([3, 7, 5], [6, 2, 9])  # N = 17 scored tokens


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk_size", [1, 4, 5, 1000, None])
def test_chunked_logprobs_and_entropy_equal_full_logits(model64, temperature, chunk_size):
    ids, attention, mask = make_batch(*LENGTHS, model64.config.vocab_size)
    out = completion_logprobs(model64, ids, attention, mask, temperature=temperature, chunk_size=chunk_size)
    ref_logp, ref_entropy, _ = reference(model64, ids, attention, mask, temperature)
    assert out.logp.dtype == torch.float64
    torch.testing.assert_close(out.logp, ref_logp, rtol=0, atol=1e-10)
    torch.testing.assert_close(out.entropy, ref_entropy, rtol=0, atol=1e-10)
    assert (out.logp[mask == 0] == 0).all() and (out.entropy[mask == 0] == 0).all()
    assert (out.logp[mask == 1] < 0).all()


def test_gradient_equals_full_logits_gradient(model64):
    ids, attention, mask = make_batch(*LENGTHS, model64.config.vocab_size)
    weights = torch.linspace(-1.0, 2.0, mask.numel(), dtype=torch.float64).reshape(mask.shape)

    def grads(loss):
        model64.zero_grad()
        loss.backward()
        return {n: p.grad.clone() for n, p in model64.named_parameters()}

    out = completion_logprobs(model64, ids, attention, mask, temperature=0.7, chunk_size=4)
    chunked = grads((out.logp * weights).sum() + 0.3 * out.entropy.sum())
    ref_logp, ref_entropy, _ = reference(model64, ids, attention, mask, 0.7)
    full = grads((ref_logp * weights).sum() + 0.3 * ref_entropy.sum())
    assert set(chunked) == set(full)
    for name in full:
        torch.testing.assert_close(chunked[name], full[name], rtol=1e-9, atol=1e-12, msg=name)
    assert chunked["lm_head.weight"].abs().sum() > 0 and chunked["model.embed_tokens.weight"].abs().sum() > 0


def test_top_k_top_p_filters_match_reference(model64):
    ids, attention, mask = make_batch(*LENGTHS, model64.config.vocab_size)
    width = mask.shape[1]
    for _ in range(width):  # make every scored token the argmax given its prefix (greedy completion)
        _, _, logprobs = reference(model64, ids, attention, mask)
        ids[:, -width:] = torch.where(mask == 1, logprobs.argmax(-1), ids[:, -width:])
    ids[0, -width + 1] = logprobs[0, 1].argmin()  # one token outside the filters: log-prob -inf
    out = completion_logprobs(model64, ids, attention, mask, temperature=0.8, top_k=7, top_p=0.5, chunk_size=3)
    ref_logp, ref_entropy, _ = reference(model64, ids, attention, mask, 0.8, 7, 0.5)
    torch.testing.assert_close(out.logp, ref_logp, rtol=0, atol=1e-10)
    torch.testing.assert_close(out.entropy, ref_entropy, rtol=0, atol=1e-10)
    assert torch.isfinite(out.entropy).all() and out.logp[0, 1] == float("-inf")
    assert torch.isfinite(out.logp[0, 0]) and torch.isfinite(out.logp[1, :2]).all()


def test_topk_columns(model64):
    ids, attention, mask = make_batch(*LENGTHS, model64.config.vocab_size)
    out = completion_logprobs(model64, ids, attention, mask, topk=4, chunk_size=5)
    _, _, logprobs = reference(model64, ids, attention, mask)
    sel = mask.bool()
    targets = ids[:, -mask.shape[1] :]
    assert out.topk_ids.shape == (*mask.shape, 4)
    assert torch.equal(out.topk_ids[..., 0][sel], targets[sel])
    torch.testing.assert_close(out.topk_logp[..., 0], out.logp, rtol=0, atol=0)
    others = logprobs.scatter(-1, targets[..., None], float("-inf")).topk(3, dim=-1)
    torch.testing.assert_close(out.topk_logp[..., 1:][sel], others.values[sel], rtol=0, atol=1e-10)
    assert not (out.topk_ids[..., 1:] == out.topk_ids[..., :1]).any(dim=-1)[sel].any()
    # Evaluating at given ids (the rollout's support) gathers exactly there; garbage where mask == 0.
    given = out.topk_ids.flip(-1).masked_fill(~sel[..., None], 10**9)
    again = completion_logprobs(model64, ids, attention, mask, topk_ids=given)
    expected = logprobs.gather(-1, given.masked_fill(~sel[..., None], 0))
    torch.testing.assert_close(again.topk_logp[sel], expected[sel], rtol=0, atol=1e-10)


def test_fp32_head_on_bfloat16_model(policy):
    model, _ = policy
    bf16 = type(model)(model.config).to(torch.bfloat16).eval()
    bf16.load_state_dict(model.state_dict())
    ids, attention, mask = make_batch(*LENGTHS, model.config.vocab_size)
    out = completion_logprobs(bf16, ids, attention, mask, fp32_head=True, chunk_size=4)
    position_ids = (attention.cumsum(-1) - 1).clamp_min(0)
    with torch.no_grad():  # the last column predicts nothing and is not run (bf16 rounding depends on the shape)
        hidden = bf16.model(input_ids=ids[:, :-1], attention_mask=attention[:, :-1],
                            position_ids=position_ids[:, :-1]).last_hidden_state
        logits = hidden[:, -mask.shape[1] :].float() @ bf16.lm_head.weight.float().T
        ref = logits.log_softmax(-1).gather(-1, ids[:, -mask.shape[1] :, None]).squeeze(-1) * mask
    assert out.logp.dtype == torch.float32
    torch.testing.assert_close(out.logp, ref, rtol=0, atol=1e-5)
    out.logp.sum().backward()
    assert bf16.lm_head.weight.grad is not None and bf16.lm_head.weight.grad.dtype == torch.bfloat16


def test_backward_keeps_no_full_logits(model64):
    """With chunks, no tensor saved for backward has more than one chunk's worth of logits."""
    ids, attention, mask = make_batch([3, 7, 5, 4], [30, 28, 30, 25], model64.config.vocab_size)
    n_tokens, vocab = int(mask.sum()), model64.config.vocab_size
    sizes: list[int] = []  # sizes of saved tensors shaped like logits [..., V]

    def pack(t):
        if t.dim() >= 2 and t.shape[-1] == vocab:
            sizes.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = completion_logprobs(model64, ids, attention, mask, chunk_size=8)
    out.logp.sum().backward()
    assert max(sizes, default=0) <= 8 * vocab < n_tokens * vocab
    sizes.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        reference(model64, ids, attention, mask)
    assert max(sizes) >= n_tokens * vocab  # the hook does see full logits when they are saved


def test_no_grad_path_and_shape_errors(model64):
    ids, attention, mask = make_batch(*LENGTHS, model64.config.vocab_size)
    with torch.no_grad():
        out = completion_logprobs(model64, ids, attention, mask, with_entropy=False)
    assert out.entropy is None and out.topk_ids is None and not out.logp.requires_grad
    with pytest.raises(ValueError, match="completion width"):
        completion_logprobs(model64, ids, attention, torch.ones(3, ids.shape[1]))
    with pytest.raises(ValueError, match="attention_mask"):
        completion_logprobs(model64, ids, attention[:, 1:], mask)
    with pytest.raises(ValueError, match="temperature"):
        completion_logprobs(model64, ids, attention, mask, temperature=0.0)


def test_heads_that_rescale_logits_are_refused(model64):
    assert linear_head(model64) is model64.lm_head
    ids, attention, mask = make_batch(*LENGTHS, model64.config.vocab_size)
    for key, value in (("final_logit_softcapping", 30.0), ("logit_scale", 0.0625),
                       ("lm_head_multiplier", 0.25)):  # Falcon-H1 multiplies its logits
        setattr(model64.config, key, value)
        try:
            with pytest.raises(ValueError, match=key):
                completion_logprobs(model64, ids, attention, mask)
        finally:
            delattr(model64.config, key)
    assert completion_logprobs(model64, ids, attention, mask).logp.shape == mask.shape


def test_process_logits_by_hand():
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.15, 0.1]]))
    kept = torch.isfinite(process_logits(logits, top_k=2))
    assert kept.tolist() == [[True, True, False, False]]
    # top-p 0.6: 0.5 (mass before 0) kept, 0.25 (mass before 0.5) kept, 0.15 (before 0.75 > 0.6) removed.
    assert torch.isfinite(process_logits(logits, top_p=0.6)).tolist() == [[True, True, False, False]]
    assert torch.isfinite(process_logits(logits, top_p=0.4)).tolist() == [[True, False, False, False]]
    # a token whose mass before it equals top_p exactly is removed (TopPLogitsWarper's and vLLM's rule)
    quarters = torch.log(torch.full((1, 4), 0.25))
    assert torch.isfinite(process_logits(quarters, top_p=0.5)).tolist() == [[True, True, False, False]]
    assert torch.isfinite(process_logits(torch.log(torch.tensor([[0.5, 0.5]])), top_p=0.5)).tolist() == [[True, False]]
    torch.testing.assert_close(process_logits(logits, temperature=0.5), logits * 2)
    with pytest.raises(ValueError, match="top_p"):
        process_logits(logits, top_p=1.5)


def test_top_p_keeps_what_transformers_keeps():
    """The same support as TopPLogitsWarper: token for token on random distributions, and as many tokens where mass
    sits exactly on the boundary (which of tied tokens stays is the sort's choice, in either)."""
    from transformers.generation.logits_process import TopPLogitsWarper

    g = torch.Generator().manual_seed(0)
    dyadic = torch.log(torch.tensor([[0.5, 0.25, 0.125, 0.125], [0.25, 0.25, 0.25, 0.25], [0.5, 0.5, 0.0, 0.0]]))
    for top_p in (0.25, 0.5, 0.75, 0.9):
        logits = torch.randn(64, 12, generator=g, dtype=torch.float64) * 2
        theirs = torch.isfinite(TopPLogitsWarper(top_p)(None, logits.clone()))
        assert torch.equal(torch.isfinite(process_logits(logits, top_p=top_p)), theirs), top_p
        theirs = torch.isfinite(TopPLogitsWarper(top_p)(None, dyadic.double())).sum(-1)
        assert torch.equal(torch.isfinite(process_logits(dyadic.double(), top_p=top_p)).sum(-1), theirs), top_p


def test_load_policy_round_trip_and_threads(model_dir):
    threads = torch.get_num_threads()
    try:
        model, tokenizer = load_policy(model_dir, threads=1)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)
    assert not model.training and model.dtype == torch.float32
    assert tokenizer.decode(tokenizer("12+34=")["input_ids"], skip_special_tokens=True) == "12+34="
    model16, _ = load_policy(model_dir, dtype="bfloat16", threads=threads)
    assert model16.dtype == torch.bfloat16


def test_load_policy_errors_name_the_path(model_dir, tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(FileNotFoundError, match="model directory not found") as err:
        load_policy(missing)
    assert str(missing) in str(err.value) and "\n" not in str(err.value)
    no_tokenizer = tmp_path / "no_tokenizer"
    no_tokenizer.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(model_dir / name, no_tokenizer / name)
    with pytest.raises(FileNotFoundError, match="no tokenizer") as err:
        load_policy(no_tokenizer)
    assert str(no_tokenizer) in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_policy(tmp_path)
    with pytest.raises(ValueError, match="dtype"):
        load_policy(model_dir, dtype="int8")


@pytest.mark.parametrize("case", ["bias+softcap+topk", "filters+given_ids", "frozen head", "bias only, no entropy",
                                  "entropy unused by the loss"])
def test_chunked_head_gradients_equal_plain_autograd(case):
    """_ChunkedHead's hand-written backward (head matmul gradients accumulated into one buffer, chunk by chunk)
    equals autograd through the unchunked head, for every output it returns, with a bias, a soft-cap, top-K,
    sampling filters, given ids, a frozen head (no weight gradient, the states' still exact), and an entropy that
    the loss does not use (a metric: backward skips it)."""
    from polyrl.model import _ChunkedHead, _head_chunk

    gen = torch.Generator().manual_seed(3)
    n, hidden, vocab = 11, 6, 23
    states = torch.randn(n, hidden, dtype=torch.float64, generator=gen, requires_grad=True)
    weight = torch.randn(vocab, hidden, dtype=torch.float64, generator=gen, requires_grad=case != "frozen head")
    bias = torch.randn(vocab, dtype=torch.float64, generator=gen, requires_grad=True) if "bias" in case else None
    targets = torch.randint(0, vocab, (n,), generator=gen)
    given = torch.randint(0, vocab, (n, 3), generator=gen) if "given" in case else None
    settings = dict(temperature=0.7, top_k=None, top_p=None, with_entropy="no entropy" not in case,
                    topk=4 if "topk" in case else 0, fp32_head=False, softcap=5.0 if "softcap" in case else None)
    if "filters" in case:  # keep every target inside the filters: its log-prob is finite
        settings.update(top_k=20, top_p=0.95)
    inputs = [t for t in (states, weight, bias) if t is not None and t.requires_grad]
    weights = [torch.randn(n, *shape, dtype=torch.float64, generator=gen) for shape in ((), (), (4,), (3,))]

    def loss(outs):
        total = (outs[0] * weights[0]).nan_to_num(neginf=0.0).sum()
        if settings["with_entropy"] and "unused" not in case:
            total = total + (outs[1] * weights[1]).sum()
        if outs[3] is not None and outs[3].numel():
            k = outs[3].shape[-1]
            total = total + (outs[3] * weights[2 if k == 4 else 3]).nan_to_num(neginf=0.0).sum()
        return total

    chunked = _ChunkedHead.apply(states, weight, bias, targets, given, 4, settings)  # 3 chunks: 4 + 4 + 3
    plain = _head_chunk(states, targets, given, weight, bias, **settings)
    torch.testing.assert_close(chunked[0], plain[0], rtol=0, atol=1e-12)
    if plain[2] is not None:
        assert torch.equal(chunked[2], plain[2])
    got = torch.autograd.grad(loss(chunked), inputs)
    want = torch.autograd.grad(loss(plain), inputs)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)
    if case == "frozen head":
        assert weight.grad is None and len(inputs) == 1
