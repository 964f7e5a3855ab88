import pytest

from repro.case.descriptors import (
    AttnConfig,
    BatchDescriptor,
    ConfigError,
    descriptor_from_label,
    full_decode_descriptors,
)


def test_full_decode_descriptors_largest_first_and_uniform():
    cfg = AttnConfig(num_speculative_tokens=3, capture_sizes=(1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64))
    descs = full_decode_descriptors(cfg)
    assert [d.num_tokens for d in descs] == sorted({d.num_tokens for d in descs}, reverse=True)
    assert descs[0] == BatchDescriptor(64, 16, 4)
    assert descs[-1] == BatchDescriptor(4, 1, 4)  # sizes 1, 2 and 4 all round up to one request of 4 tokens
    assert all(d.num_tokens == 4 * d.num_reqs for d in descs)
    assert len(descs) == 9


def test_query_lens_make_dummy_remainder_goes_last():
    assert BatchDescriptor(10, 3).query_lens() == [3, 3, 4]
    assert BatchDescriptor(8, 2).max_query_len == 4


@pytest.mark.parametrize(
    "kw, msg",
    [
        (dict(num_heads_q=30, num_heads_kv=8), "multiple"),
        (dict(head_dim=100), "head_dim"),
        (dict(page_size=10), "page_size"),
        (dict(num_splits=-1), "num_splits"),
        (dict(capture_sizes=()), "capture_sizes"),
    ],
)
def test_bad_config_is_a_config_error(kw, msg):
    with pytest.raises(ConfigError, match=msg):
        AttnConfig(**kw)


def test_max_batch_follows_vllm_sizing():
    assert AttnConfig(max_num_seqs=8, capture_sizes=(1, 64)).max_batch == 64
    assert AttnConfig(max_num_seqs=256, capture_sizes=(1, 64)).max_batch == 256


def test_descriptor_labels_round_trip():
    assert descriptor_from_label("t32r8", 4) == BatchDescriptor(32, 8, 4)
    assert descriptor_from_label("3", 4) == BatchDescriptor(12, 3, 4)
    with pytest.raises(ConfigError):
        descriptor_from_label("x", 4)
    with pytest.raises(ConfigError):
        BatchDescriptor(2, 3)


def test_window_minus_one_and_zero_are_cases():
    from repro.case.descriptors import AttnConfig
    from repro.errors import ConfigError

    assert not AttnConfig(window_left=-1).is_local and AttnConfig(window_left=0).is_local
    with pytest.raises(ConfigError, match="window_left must be -1"):
        AttnConfig(window_left=-5)
