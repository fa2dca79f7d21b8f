import pytest
import torch

from hybrid_scale.attention.feature_maps import FEATURE_MAPS, make_feature_map


@pytest.mark.parametrize("name", sorted(FEATURE_MAPS))
def test_shapes_per_head(name):
    fmap = make_feature_map(name, num_heads=3, head_dim=8)
    x = torch.randn(2, 3, 5, 8)
    y = fmap(x)
    assert y.shape == (2, 3, 5, fmap.out_dim)
    assert fmap.out_dim == (16 if name == "hedgehog" else 8)
    assert torch.isfinite(y).all() and (y >= 0).all()


def test_hedgehog_identity_init_and_definition():
    fmap = make_feature_map("hedgehog", num_heads=2, head_dim=4)
    assert torch.equal(fmap.weight[1], torch.eye(4)) and torch.equal(fmap.bias, torch.zeros(2, 4))
    x = torch.randn(1, 2, 3, 4)
    y = fmap(x)
    torch.testing.assert_close(y, torch.cat([x.softmax(-1), (-x).softmax(-1)], -1))
    # per-head weights: changing head 1 leaves head 0 alone
    with torch.no_grad():
        fmap.weight[1] *= 3
    torch.testing.assert_close(fmap(x)[:, 0], y[:, 0])
    assert not torch.allclose(fmap(x)[:, 1], y[:, 1])


def test_hedgehog_reduced_feature_dim_and_exp_stabiliser():
    fmap = make_feature_map("hedgehog", num_heads=2, head_dim=8, feature_dim=4)
    assert fmap.weight.shape == (2, 8, 4) and fmap.out_dim == 8
    exp = make_feature_map("exp", num_heads=1, head_dim=4)
    x = torch.tensor([[[[1000.0, 999.0, 0.0, -5.0]]]])
    y = exp(x)
    torch.testing.assert_close(y, torch.exp(x - 1000.0))
    assert torch.isfinite(y).all()


def test_errors_name_the_fix():
    with pytest.raises(ValueError, match="unknown feature map 'cosine'; available: elu1, exp, hedgehog, relu, t2r"):
        make_feature_map("cosine", 2, 8)
    with pytest.raises(ValueError, match="feature_dim must equal head_dim"):
        make_feature_map("relu", 2, 8, feature_dim=4)
