"""T5's blocks take their sub-layers from the model class: a variant with another feed-forward is
a short subclass (no constructor or forward copied), its weights load under the same names, and
only the swapped sub-layer computes differently. Throwaway variants (no model_type: they do not
register)."""
from __future__ import annotations

import torch
from torch.nn import functional as F

from hf_folders import save_client_model
from posbias_export.hf.architectures.t5 import T5Encoder, T5FeedForward
from posbias_export.hf.architectures.t5_decoder import T5Decoder
from posbias_export.hf.imported import ARCHITECTURES, PARTS
from posbias_export.hf.models import load_model


class SquaredReluFeedForward(T5FeedForward):
    """Primer's squared ReLU where T5 v1.1 has gated GELU (the weights' names unchanged)."""

    def forward(self, x):
        h = F.relu(self.wi_0(x)) ** 2 * self.wi_1(x) if self.gated else F.relu(self.wi(x)) ** 2
        return self.wo(h)


class SquaredReluEncoder(T5Encoder):
    feed_forward = SquaredReluFeedForward


class SquaredReluDecoder(T5Decoder):
    feed_forward = SquaredReluFeedForward


def test_a_variant_with_another_feed_forward_is_a_short_subclass(tmp_path):
    folder = save_client_model("t5_gated", tmp_path / "t5")  # T5 v1.1: gated GELU feed-forward
    encoder, decoder = load_model(folder).eval(), load_model(folder, part="decoder").eval()
    variant = SquaredReluEncoder(encoder.config)
    variant_decoder = SquaredReluDecoder(decoder.config, own_head=decoder.lm_head is not None,
                                         rescale=decoder.rescale != 1.0)
    for mine, weights in ((variant, encoder), (variant_decoder, decoder)):  # the same names: the weights load
        mine.load_state_dict(weights.state_dict())
        mine.eval()
    assert all(isinstance(b.layer[1].DenseReluDense, SquaredReluFeedForward) for b in variant.encoder.block)
    assert all(isinstance(b.layer[2].DenseReluDense, SquaredReluFeedForward) for b in variant_decoder.decoder.block)
    assert "t5" in ARCHITECTURES and ARCHITECTURES["t5"] is T5Encoder and PARTS["t5", "decoder"] is T5Decoder

    ids = torch.randint(3, 300, (2, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    with torch.no_grad():
        ours, theirs = encoder(ids, mask), variant(ids, mask)
        # the same weights through the variant's feed-forward: what the swap alone changes
        block = encoder.encoder.block[0]
        x = torch.randn(2, 5, encoder.config.d_model, generator=torch.Generator().manual_seed(1))
        ff = block.layer[1].DenseReluDense
        expected = ff.wo(F.relu(ff.wi_0(x)) ** 2 * ff.wi_1(x))
        assert torch.allclose(variant.encoder.block[0].layer[1].DenseReluDense(x), expected, atol=1e-6)
        target = torch.randint(3, 300, (2, 4), generator=torch.Generator().manual_seed(2))
        logits = decoder(target, torch.ones_like(target), ours, mask)
        variant_logits = variant_decoder(target, torch.ones_like(target), ours, mask)
    assert ours.shape == theirs.shape and not torch.allclose(ours, theirs, atol=1e-3)
    assert logits.shape == variant_logits.shape and not torch.allclose(logits, variant_logits, atol=1e-3)
