"""megatron-core TP/DP groups over gloo: ranks land where the layout says."""
from distributed import run_distributed


def _body(rank, world_size):
    from pipeline.parallel import MegatronMPU, init_distributed
    info = init_distributed(tensor_parallel_size=2)
    mpu = MegatronMPU()
    return (info.tp_rank, info.dp_rank, info.tp_size, info.dp_size,
            mpu.get_model_parallel_rank(), mpu.get_data_parallel_world_size())


def test_tp2_dp2_layout():
    results = run_distributed(_body, world_size=4)
    # TP ranks adjacent: ranks 0,1 form TP group 0; ranks 0,2 form DP group 0.
    assert results == [(0, 0, 2, 2, 0, 2), (1, 0, 2, 2, 1, 2),
                       (0, 1, 2, 2, 0, 2), (1, 1, 2, 2, 1, 2)]
