"""Sharded parameters (FSDP2 fully_shard, DTensor) watched on each rank's local shards."""
import pytest

pytest.importorskip("torch.distributed.fsdp")


@pytest.mark.timeout(200)
def test_fsdp2_nan_in_one_ranks_gradient_shard_stops_every_rank_naming_parameter_and_rank():
    # Each rank records its local shards (no all-gather); rank 1's NaN gradient shard stops both
    # ranks before the optimizer step, naming the full parameter and rank 1.
    from integ_workers import run_ranks

    results = run_ranks("fsdp2_local_shards", world=2, timeout=150)
    for res in results:
        assert res.get("exc") == "NonFiniteError", res
        assert res["steps"] == 1 and res["ranks"] == [1], res
    assert "fc1.weight.grad" in results[1]["msg"] and "on rank 1" in results[1]["msg"]
