"""On a GPU machine (skipped elsewhere, with the reason): the client's CUDA shared memory against
`epserve launch --ranks 1 --backend nccl` (synthetic:tiny): a tensor on the GPU in, the answer a
tensor on the same GPU, per token equal to the same rows over the wire, in f32 and bf16, with
client routing, across a region's growth; a service without --allow-client-shm: "auto" falls
back to the wire, "cuda" is refused. Run by scripts/bench/client-gpu.sh."""

import grpc
import pytest
import torch

import epserve
from conftest import Service

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (torch.cuda)")


def worst(got, want):
    got, want = got.double().cpu(), want.double().cpu()
    return ((got - want).abs().amax(1) / want.abs().amax(1).clamp_min(1e-30)).max().item()


@pytest.fixture(scope="module")
def gpu_service():
    s = Service("--ranks", "1", "--backend", "nccl", "--allow-client-shm")
    yield s
    s.stop()


def test_cuda_tensors_through_cuda_shared_memory(gpu_service):
    dev = torch.device("cuda", 0)
    with epserve.Client(gpu_service.addr) as wire, epserve.Client(gpu_service.addr, shared_memory="cuda") as c:
        layer, h = c.info.moe_layers[0], c.info.hidden_size
        for n, dtype, tol in ((7, torch.float32, 1e-6), (300, torch.bfloat16, 1e-2), (5000, torch.float32, 1e-6)):
            x = torch.randn(n, h, generator=torch.Generator().manual_seed(n)).to(dtype)
            y = c.forward(x.to(dev), layer)
            assert y.is_cuda and y.device == dev and y.dtype == dtype and y.shape == (n, h)
            assert worst(y, wire.forward(x, layer)) <= tol, (n, dtype)
        assert len(c._cuda) == 1 and c._cuda[dev] is not None
        k = c.info.top_k
        ids = torch.stack([torch.randperm(c.info.num_experts, generator=torch.Generator().manual_seed(i))[:k]
                           for i in range(64)]).int()
        w = torch.rand(64, k, generator=torch.Generator().manual_seed(1))
        x = torch.randn(64, h, generator=torch.Generator().manual_seed(2))
        y = c.forward(x.to(dev), layer, topk_ids=ids.to(dev), topk_weights=w.to(dev))
        assert worst(y, wire.forward(x, layer, topk_ids=ids, topk_weights=w)) <= 1e-6


def test_a_service_without_client_shm():
    s = Service("--ranks", "1", "--backend", "nccl")
    try:
        x = torch.randn(4, 64, device="cuda")
        with epserve.Client(s.addr, shared_memory="auto") as c:
            y = c.forward(x, c.info.moe_layers[0])
            assert not y.is_cuda and c._cuda[x.device] is None  # answered over the wire
        with pytest.raises(epserve.EpserveError) as e:
            with epserve.Client(s.addr, shared_memory="cuda") as c:
                c.forward(x, c.info.moe_layers[0])
        assert e.value.code == grpc.StatusCode.PERMISSION_DENIED
    finally:
        s.stop()
