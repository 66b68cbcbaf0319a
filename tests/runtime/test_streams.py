"""runtime.streams: nothing changes on CPU; on a GPU, copies ahead on a side stream arrive whole
and a pipeline trained through them (one GPU, or two over NCCL) equals the oracle. The GPU tests
are marked ``gpu`` and skip without CUDA (the NCCL ones without two GPUs)."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
from torch import nn

from pl_pipedream.planner.plan import Plan
from pl_pipedream.runtime.channel import Channel
from pl_pipedream.runtime.executor import StageExecutor
from pl_pipedream.runtime.feed import Feed
from pl_pipedream.runtime.frames import Message
from pl_pipedream.runtime.losses import LossBook
from pl_pipedream.runtime.streams import (
    HostValue,
    prefetch,
    prefetch_each,
    read_done,
    read_later,
    settle,
    upload,
)
from pl_pipedream.schedule import build
from pl_pipedream.schedule.modes import SyncMode, update_settings
from tests.runtime import oracle
from tests.runtime.distributed import one_rank_group, run
from tests.runtime.test_executor import (
    NUM_BATCHES,
    OPTIMIZERS,
    loss_fn,
    make_batches,
    make_model,
    optimizer_update,
)

CPU = torch.device("cpu")
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
needs_two_gpus = pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="needs two CUDA devices (NCCL, one GPU per rank)"
)


# ----- CPU: the helpers keep the plain behaviour ------------------------------------------------


def test_on_cpu_a_prefetch_is_the_value_itself_and_nothing_is_copied_ahead() -> None:
    x, y = torch.randn(3, 2), torch.arange(4)
    value = {"x": x, "rest": (y, 7, None)}
    got = prefetch(value, CPU).take()
    assert got["x"] is x and got["rest"][0] is y and got["rest"][1:] == (7, None)
    called: list[int] = []
    assert prefetch_each([0, 1], lambda k: called.append(k), CPU) == {}
    assert called == []  # each forward moves its own input, as before


def test_on_cpu_upload_and_read_done_are_plain_copies() -> None:
    target = torch.zeros(4, dtype=torch.int64)
    upload(target, torch.tensor([5, -1, 2**40, 3]))
    assert target.tolist() == [5, -1, 2**40, 3]
    assert read_done(target[1:3]).tolist() == [-1, 2**40]
    settle(CPU)  # nothing to wait for


def test_on_cpu_a_loss_is_read_at_once_and_the_book_has_it() -> None:
    value = read_later(torch.tensor(0.25, requires_grad=True) * 3)
    assert type(value) is float and value == 0.75
    book = LossBook()
    book.add_later(0, 1, value)
    book.add_later(0, 0, 0.25)
    assert book.mean(0, 2) == 0.5 and [x.value for x in book.of(0)] == [0.25, 0.75]


# ----- GPU ---------------------------------------------------------------------------------------


def _busy(device: torch.device) -> torch.Tensor:
    """Queue a few hundred milliseconds of work on the current stream, so that anything ordered
    wrongly against it would read memory before it is written."""
    a = torch.randn(2048, 2048, device=device)
    for _ in range(20):
        a = torch.tanh(a @ a) / 2048**0.5
    return a


@pytest.mark.gpu
@needs_gpu
def test_a_copy_ahead_arrives_whole_while_the_compute_stream_is_busy() -> None:
    device = torch.device("cuda", 0)
    torch.manual_seed(0)
    plain, pinned = torch.randn(1 << 20), torch.randn(256, 1024).pin_memory()
    busy = _busy(device)
    ahead = prefetch((plain, {"p": pinned}, "label"), device)
    got = ahead.take()
    assert got[0].device == device and got[1]["p"].device == device and got[2] == "label"
    sums = torch.stack([got[0].double().sum(), got[1]["p"].double().sum()]).cpu()
    expected = torch.stack([plain.double().sum(), pinned.double().sum()])
    assert torch.allclose(sums, expected, rtol=1e-12, atol=1e-9)
    assert torch.isfinite(busy).all()
    del got, ahead  # freed memory is reused only after the compute stream's use (record_stream)
    again = prefetch(torch.ones(1 << 20), device).take()
    assert again.sum().item() == float(1 << 20)


@pytest.mark.gpu
@needs_gpu
def test_upload_and_read_done_round_trip_on_a_gpu() -> None:
    device = torch.device("cuda", 0)
    frame = torch.zeros(64, dtype=torch.int64, device=device)
    _busy(device)
    upload(frame[8:12], torch.tensor([3, -4, 2**50, 9]))
    torch.cuda.current_stream(device).synchronize()  # the upload's producer has finished
    assert read_done(frame[8:12]).tolist() == [3, -4, 2**50, 9]
    assert read_done(frame[:8]).tolist() == [0] * 8


@pytest.mark.gpu
@needs_gpu
def test_a_loss_read_later_is_the_gpus_value_and_the_book_reads_it_when_asked() -> None:
    device = torch.device("cuda", 0)
    busy = _busy(device)
    loss = busy.double().pow(2).mean()
    later = read_later(loss)
    assert isinstance(later, HostValue)
    book = LossBook()
    book.add_later(3, 6, later)
    book.add_later(3, 7, 1.0)
    expected = busy.double().cpu().pow(2).mean().item()
    assert book.of(3)[0].value == pytest.approx(expected, rel=1e-12)
    assert book.mean(3, 2) == pytest.approx((expected + 1.0) / 2, rel=1e-12)


@pytest.mark.gpu
@needs_gpu
def test_values_logged_beside_a_loss_are_read_when_asked_and_cross_a_gpu_frame() -> None:
    from pl_pipedream.runtime.frames import HEADER_BYTES, MinibatchLoss, layout_of, pack, unpack

    device = torch.device("cuda", 0)
    busy = _busy(device)
    book = LossBook()
    logged = (("acc", read_later(busy.double().abs().max())), ("n", 4.0))
    book.add_later(0, 0, read_later(busy.double().mean()), logged)
    expected = (("acc", busy.double().abs().max().item()), ("n", 4.0))
    assert book.logged(0, 1) == (expected,)
    message = Message([busy[:2, :3]], book.of(0), fingerprint=1.5)
    layout = layout_of(message)
    frame = pack(message, layout, layout.needed, device)
    torch.cuda.current_stream(device).synchronize()
    back = unpack(frame, read_done(frame[:HEADER_BYTES].view(torch.int64)).tolist())
    assert back.losses == (MinibatchLoss(0, busy.double().mean().item(), expected),)
    assert back.fingerprint == 1.5 and torch.equal(back.tensors[0], busy[:2, :3])


def _train_on(
    rank: int, plan: Plan, sync: str, m: int, device: torch.device, channel: Channel
) -> dict[str, torch.Tensor]:
    """One rank's stage of the executor tests' model trained on ``device`` (SGD), inputs and
    targets handed over on the CPU (the first stage copies them ahead), the timeline recorded."""
    model = make_model()
    stage = plan.stage_of_rank(rank)
    module = nn.Sequential(OrderedDict((n, model[int(n)]) for n in stage.nodes)).to(device)
    optimizer = OPTIMIZERS["sgd"](list(module.parameters()))
    batches = make_batches(m)
    xs = [x for batch in batches for x in batch[0].chunk(m)]
    ys = [y for batch in batches for y in batch[1].chunk(m)]
    executor = StageExecutor(
        module,
        rank,
        stage.index,
        plan.num_stages,
        channel,
        update_settings(SyncMode(sync), m, stage.replicas),
        device=device,
        record_timeline=True,
    )
    feed = Feed(lambda i: xs[i], lambda out, i: loss_fn(out, ys[i].to(device)))
    executor.execute(
        build(plan, sync, NUM_BATCHES, m).actions[rank], feed, optimizer_update(module, optimizer)
    )
    assert len(executor.timeline) == len(build(plan, sync, NUM_BATCHES, m).actions[rank])
    got = {k: v.detach().cpu() for k, v in module.state_dict().items()}
    # the losses this rank knows (read from the GPU when asked), beside the weights
    got["losses"] = torch.tensor([[x.value for x in executor.losses.of(b)] for b in range(2)])
    return got


def _expected(plan: Plan, sync: str, m: int) -> dict[str, torch.Tensor]:
    return oracle.train(make_model(), plan, sync, make_batches(m), m, loss_fn, OPTIMIZERS["sgd"])


def _close(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert got
    for key, tensor in got.items():
        if key == "losses":
            continue
        diff = (tensor - expected[key]).abs().max().item()
        assert diff <= 1e-4, f"{key}: {diff}"


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("sync", ["async", "flush"])
def test_one_stage_on_a_gpu_with_inputs_copied_ahead_equals_the_oracle(sync: str) -> None:
    plan, device = Plan.from_balance([6]), torch.device("cuda", 0)
    with one_rank_group():
        got = _train_on(0, plan, sync, 2, device, Channel(0, device, timeout=60.0))
        on_cpu = _train_on(0, plan, sync, 2, CPU, Channel(0, CPU, timeout=60.0))
    _close(got, _expected(plan, sync, 2))
    assert got["losses"].shape == (2, 2)  # both minibatches of the first two batches
    assert torch.allclose(got["losses"], on_cpu["losses"], rtol=1e-5, atol=1e-7)


def _two_gpu_stage(rank: int, world: int, sync: str) -> dict[str, torch.Tensor]:
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    channel = Channel(rank, device, timeout=60.0)
    # one message with losses, a fingerprint and a structure, both ways, checked field by field
    if rank == 0:
        channel.send(Message([torch.arange(6.0, device=device)], fingerprint=2.5), 1, 9, "probe")
        back = channel.recv(1, 9, "the probe's answer")
        assert back.tensors[0].device == device
        assert back.tensors[0].tolist() == [[0.0, 2.0], [6.0, 8.0]] and back.structure == b"xy"
    else:
        probe = channel.recv(0, 9, "the probe")
        assert probe.tensors[0].device == device and probe.fingerprint == 2.5
        doubled = (2 * probe.tensors[0]).view(2, 3)[:, :2].contiguous()
        channel.send(Message([doubled], structure=b"xy"), 0, 9, "the probe's answer")
    channel.flush()
    got = _train_on(rank, Plan.from_balance([3, 3]), sync, 2, device, channel)
    channel.flush()
    return got


@pytest.mark.gpu
@pytest.mark.slow
@needs_two_gpus
@pytest.mark.parametrize("backend", ["cpu:gloo,cuda:nccl", "gloo"])
@pytest.mark.parametrize("sync", ["async", "flush"])
def test_two_gpus_over_nccl_or_gloo_equal_the_oracle(backend: str, sync: str) -> None:
    results = run(2, _two_gpu_stage, sync, timeout=180.0, backend=backend)
    for rank, (status, value) in results.items():
        assert status == "ok", f"rank {rank}: {value}"
    expected = _expected(Plan.from_balance([3, 3]), sync, 2)
    _close({**results[0][1], **results[1][1]}, expected)
    assert torch.equal(results[0][1]["losses"], results[1][1]["losses"])  # sent back whole
