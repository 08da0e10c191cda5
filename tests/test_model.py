"""Model behaviour in PyTorch: causality, q_len < k_len, padding, config validation."""
from __future__ import annotations

import pytest
import torch

import posbias_export as pbe
from conftest import SMALL, lm_inputs


@pytest.mark.parametrize("bias", pbe.BIASES)
def test_decoder_is_causal(bias):
    """Changing token t never changes logits before t."""
    model = pbe.build_model(pbe.ModelConfig(bias=bias, **SMALL), seed=0)
    ids = lm_inputs(2, 40)
    t = 23
    changed = ids.clone()
    changed[:, t] = (changed[:, t] + 1) % 256
    with torch.no_grad():
        a, b = model(ids), model(changed)
    assert torch.equal(a[:, :t], b[:, :t])
    assert not torch.allclose(a[:, t:], b[:, t:])  # and the change is seen from t on


@pytest.mark.parametrize("bias", pbe.BIASES)
def test_bidirectional_sees_the_future(bias):
    model = pbe.build_model(pbe.ModelConfig(bias=bias, causal=False, **SMALL), seed=0)
    ids = lm_inputs(1, 20)
    changed = ids.clone()
    changed[:, 15] = (changed[:, 15] + 1) % 256
    with torch.no_grad():
        assert not torch.allclose(model(ids)[:, :15], model(changed)[:, :15])


@pytest.mark.parametrize("bias", pbe.BIASES)
def test_block_queries_fewer_than_keys(bias):
    """Queries are the last q_len positions: block(x[-q:], context=x) == block(x)[-q:]."""
    block = pbe.build_model(pbe.ModelConfig(bias=bias, **SMALL), seed=0, arch="block")
    x = torch.randn(2, 30, SMALL["dim"], generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = block(x)
        tail = block(x[:, -7:], x)
    torch.testing.assert_close(tail, full[:, -7:], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bias", pbe.BIASES)
def test_left_padding_does_not_shift_positions(bias):
    model = pbe.build_model(pbe.ModelConfig(bias=bias, **SMALL), seed=0)
    ids = lm_inputs(1, 12)
    padded = torch.cat([torch.zeros(1, 5, dtype=torch.int64), ids], dim=1)
    mask = torch.cat([torch.zeros(1, 5), torch.ones(1, 12)], dim=1).to(torch.int64)
    with torch.no_grad():
        alone = model(ids)
        with_pad = model(padded, mask)[:, 5:]
    torch.testing.assert_close(with_pad, alone, rtol=1e-5, atol=1e-5)


def test_same_seed_same_weights():
    a = pbe.build_model(pbe.ModelConfig(bias="t5", **SMALL), seed=3)
    b = pbe.build_model(pbe.ModelConfig(bias="t5", **SMALL), seed=3)
    c = pbe.build_model(pbe.ModelConfig(bias="t5", **SMALL), seed=4)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not all(torch.equal(sa[k], sc[k]) for k in sa)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(bias="nope"), "unknown bias"),
        (dict(num_heads=0), "num_heads must be a positive integer"),
        (dict(dim=130, num_heads=4), "divisible"),
        (dict(bias="window", dim=12, num_heads=4), "even head dimension"),
        (dict(num_layers=-1), "num_layers"),
        (dict(bias="window", bias_params={"window": 0}), "window must be >= 1"),
        (dict(bias="alibi", bias_params={"window": 8}), "bias 'alibi' has no hyper-parameter 'window'"),
    ],
    ids=["unknown-bias", "heads-0", "indivisible", "odd-rope-dim", "layers", "window-0", "foreign-param"],
)
def test_config_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        pbe.ModelConfig(**kwargs)


def test_config_round_trips_through_dict():
    cfg = pbe.ModelConfig(bias="sandwich", bias_params={"sin_dim": 32}, causal=False)
    assert pbe.ModelConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="unknown model config keys: bogus"):
        pbe.ModelConfig.from_dict({**cfg.to_dict(), "bogus": 1})


def test_config_reads_the_fields_older_files_carry():
    """Files and checkpoints written before hyper-parameters moved into the families carry
    them as top-level fields: the config's own family takes its values, the others had no
    effect and are dropped."""
    old = {**pbe.ModelConfig(bias="window").to_dict(), "window": 32, "sandwich_dim": 16, "t5_num_buckets": 8,
           "t5_max_distance": 20}
    del old["bias_params"]
    assert pbe.ModelConfig.from_dict(old).bias_params == {"window": 32}
    old["bias"] = "t5"
    assert pbe.ModelConfig.from_dict(old).bias_params == {"num_buckets": 8, "max_distance": 20}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16], ids=str)
def test_sdpa_form_equals_explicit_form(dtype):
    """The opset-23 form (SDPA with the bias as a float mask) in every dtype a reference or a
    model runs in, with a float32 bias and masked keys: equal to the explicit form (the float64
    reference used to fail: float64's lowest does not fit the float32 mask)."""
    from posbias_export.nn.attention import attend

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 5, 8, generator=gen, dtype=torch.float64).to(dtype) for _ in range(3))
    bias = pbe.create_bias("alibi", num_heads=4)(5, 5)  # [4, 5, 5] float32
    allowed = torch.ones(5, 5, dtype=torch.bool).tril()
    explicit = attend(q, k, v, bias, allowed, "explicit").double()
    sdpa = attend(q, k, v, bias, allowed, "sdpa").double()
    tol = {torch.float64: 1e-12, torch.float32: 1e-6, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(sdpa, explicit, atol=tol, rtol=tol)


def test_one_return_type_per_call():
    """forward returns the output alone, whatever the inputs; the cache path is its own call,
    step, which always returns (output, presents); the two agree on the logits."""
    import torch

    model = pbe.build_model(pbe.ModelConfig(bias="alibi", dim=32, num_heads=2, num_layers=2), seed=0).eval()
    ids = torch.randint(0, 256, (2, 7))
    mask = torch.ones_like(ids)
    with torch.no_grad():
        plain, masked = model(ids), model(ids, mask)
        stepped = model.step(ids, mask, model.empty_past(2))
    assert isinstance(plain, torch.Tensor) and isinstance(masked, torch.Tensor)
    assert isinstance(stepped, tuple) and len(stepped) == 2 and len(stepped[1]) == 2
    torch.testing.assert_close(stepped[0], plain, rtol=1e-5, atol=1e-6)
    block = model.blocks[0]
    x = torch.randn(2, 7, 32)
    assert isinstance(block(x), torch.Tensor) and isinstance(block.attn(x), torch.Tensor)
    out, (k, v) = block.step(x, None, (torch.zeros(2, 2, 0, 16), torch.zeros(2, 2, 0, 16)))
    assert out.shape == x.shape and k.shape == v.shape == (2, 2, 7, 16)
