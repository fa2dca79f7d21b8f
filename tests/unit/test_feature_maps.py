import pytest
import torch

from hybrid_scale.attention.hedgehog.feature_maps import FEATURE_MAPS, make_feature_map


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


@pytest.mark.parametrize("name", sorted(FEATURE_MAPS))
@pytest.mark.parametrize("feature_dim", [None, 6])
def test_every_map_has_the_size_and_parameters_its_spec_declares(name, feature_dim):
    """feature_specs.FEATURE_MAP_SPECS (what preflight and the config read, without torch) agrees with each module:
    the size phi returns and the parameters it owns."""
    from hybrid_scale.attention.hedgehog.feature_specs import FEATURE_MAP_SPECS

    spec = FEATURE_MAP_SPECS[name]
    if not spec.learnable and feature_dim is not None:
        pytest.skip("a map without a projection keeps head_dim")
    fmap = make_feature_map(name, num_heads=3, head_dim=8, feature_dim=feature_dim)
    assert fmap(torch.randn(1, 3, 2, 8)).shape[-1] == fmap.out_dim == spec.out_dim(8, feature_dim)
    assert sum(p.numel() for p in fmap.parameters()) == spec.params(3, 8, feature_dim)
