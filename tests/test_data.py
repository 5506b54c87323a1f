import pytest
import torch

from diloco.data.text import DataError, eval_batches, load_tokens, random_batch, split_tokens


def test_tokens_are_the_bytes_of_the_file(tmp_path):
    path = tmp_path / "t.txt"
    path.write_bytes("héllo".encode())

    tokens = load_tokens(path)

    assert tokens.dtype == torch.uint8
    assert tokens.tolist() == list("héllo".encode())


def test_empty_file_is_rejected(tmp_path):
    path = tmp_path / "empty.txt"
    path.write_bytes(b"")

    with pytest.raises(DataError, match="empty"):
        load_tokens(path)


def test_split_gives_a_validation_tail_and_disjoint_contiguous_shards():
    positions = torch.arange(1000)

    data = split_tokens(positions, val_fraction=0.1, n_shards=3, block_size=8)

    assert data.val.tolist() == list(range(900, 1000))
    assert [s.flatten().tolist() for s in data.shards] == [
        list(range(0, 300)),
        list(range(300, 600)),
        list(range(600, 900)),
    ]
    assert data.train_tokens == 900


def test_chunked_split_deals_chunks_round_robin_so_every_shard_spans_the_corpus():
    positions = torch.arange(1100)

    data = split_tokens(positions, val_fraction=0.09, n_shards=2, block_size=8, chunk_size=100)

    # 1001 training tokens: 5 chunks of 100 per shard, the last token dropped
    assert data.chunk_len == 100
    assert data.shards[0][:, 0].tolist() == [0, 200, 400, 600, 800]
    assert data.shards[1][:, 0].tolist() == [100, 300, 500, 700, 900]
    seen = [set(s.flatten().tolist()) for s in data.shards]
    assert not seen[0] & seen[1] and not (seen[0] | seen[1]) & set(data.val.tolist())


def test_corpus_smaller_than_a_chunk_per_shard_falls_back_to_contiguous_shards():
    positions = torch.arange(1000)

    data = split_tokens(positions, val_fraction=0.1, n_shards=3, block_size=8, chunk_size=8192)

    assert [s.shape for s in data.shards] == [(1, 300)] * 3
    assert data.shards[1][0, 0] == 300


def test_chunk_shorter_than_a_window_is_refused():
    with pytest.raises(DataError, match="chunk_size 8 must be at least block_size"):
        split_tokens(
            torch.zeros(1000, dtype=torch.uint8),
            val_fraction=0.1,
            n_shards=2,
            block_size=16,
            chunk_size=8,
        )


def test_too_small_corpus_is_a_clear_error():
    with pytest.raises(DataError, match="fewer than one window"):
        split_tokens(
            torch.zeros(100, dtype=torch.uint8), val_fraction=0.1, n_shards=2, block_size=32
        )


def test_random_batches_are_next_byte_pairs_from_the_shard_and_seeded():
    shard = torch.arange(200)
    gen_a, gen_b = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)

    x, y = random_batch(shard, batch_size=5, block_size=16, generator=gen_a)
    x2, _ = random_batch(shard, batch_size=5, block_size=16, generator=gen_b)

    assert x.shape == y.shape == (5, 16)
    assert torch.equal(y[:, :-1], x[:, 1:])  # targets are inputs shifted by one
    assert torch.equal(y - x, torch.ones_like(x))  # consecutive bytes of the shard
    assert torch.equal(x, x2)


def test_random_windows_never_straddle_two_chunks():
    shard = torch.arange(4 * 20).view(4, 20)  # chunks [0..19], [20..39], ...
    gen = torch.Generator().manual_seed(0)

    x, y = random_batch(shard, batch_size=500, block_size=8, generator=gen)

    assert torch.equal(x // 20, y // 20)  # first and last byte of each window: one chunk
    assert set((x[:, 0] // 20).tolist()) == {0, 1, 2, 3}


def test_eval_batches_cover_non_overlapping_windows_in_order():
    val = torch.arange(100)

    batches = list(eval_batches(val, batch_size=4, block_size=10))

    starts = torch.cat([x[:, 0] for x, _ in batches]).tolist()
    assert starts == [0, 10, 20, 30, 40, 50, 60, 70, 80]
    first_x, _ = next(eval_batches(val, batch_size=4, block_size=10, max_windows=2))
    assert first_x.shape == (2, 10)


def test_range_batches_read_every_window_of_the_range_exactly_once():
    from diloco.data.text import range_batches, range_windows

    T, B = 8, 4
    tokens = torch.arange(3 * B * T + 1)  # 12 windows of T + 1 tokens sharing their edges
    gen = torch.Generator().manual_seed(5)

    batches = list(range_batches(tokens, batch_size=B, block_size=T, generator=gen))

    assert range_windows(tokens.numel(), T) == 12 and len(batches) == 3
    starts = sorted(int(x[i, 0]) for x, _ in batches for i in range(B))
    assert starts == [k * T for k in range(12)]
    for x, y in batches:
        assert torch.equal(y[:, :-1], x[:, 1:]) and torch.equal(y[:, -1], x[:, -1] + 1)
    again = list(range_batches(tokens, batch_size=B, block_size=T,
                               generator=torch.Generator().manual_seed(5)))  # fmt: skip
    assert all(torch.equal(a[0], b[0]) for a, b in zip(batches, again, strict=True))


def test_a_prepared_dataset_is_dealt_into_the_simulators_shards(tmp_path):
    from diloco.config import parse_config
    from diloco.data.text import simulated_data
    from tests.support.datasets import make_dataset

    manifest = make_dataset(tmp_path / "ds")
    cfg = parse_config({"name": "x", "data": {"dataset": str(tmp_path / "ds"), "chunk_size": 512},
                        "model": {"block_size": 32}})  # fmt: skip

    recorded, data = simulated_data(cfg, 4)

    assert recorded.model.vocab_size == 257 and len(data.shards) == 4
    assert data.val.numel() == manifest.val.tokens
    assert sum(int(s.numel()) for s in data.shards) <= manifest.train_tokens
    assert data.shards[0].shape[1] == 512 and data.shards[0].dtype == torch.int32
