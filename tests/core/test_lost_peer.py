"""Which failures of a multi-rank save's collectives read as "another rank is gone" (`is_lost_peer`): gloo's
own wording for a dropped peer or an unanswered send/recv, never a timeout of this rank's own work."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from ckptctl.core.distributed import is_lost_peer


@pytest.mark.parametrize(
    "error",
    [
        RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:5"),
        RuntimeError("[gloo/transport/tcp/pair.cc:598] Connection reset by peer"),
        RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 1800000ms for recv operation"),
        dist.DistNetworkError("store: connection refused"),
    ],
)
def test_a_dropped_or_silent_peer_is_a_lost_rank(error: BaseException) -> None:
    assert is_lost_peer(error)


@pytest.mark.parametrize(
    "error",
    [
        RuntimeError("write of /nfs/run/step-3/__0_0.distcp timed out"),
        RuntimeError("CUDA error: out of memory"),
        OSError(28, "No space left on device"),
    ],
)
def test_this_ranks_own_failure_is_not_a_lost_rank(error: BaseException) -> None:
    assert not is_lost_peer(error)
