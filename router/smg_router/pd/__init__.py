"""pd: prefill/decode disaggregation, below ``proxy`` and above ``relay`` and ``attempt``.

One interface, ``PDDispatcher.forward``, and one module per way the KV moves from a prefill to a decode
worker: ``bootstrap`` (SGLang: both legs at once, paired through a bootstrap room; ``--pd-mode sglang``, the
default) and ``vllm`` (vLLM: the prefill leg first, then the decode leg with the ``kv_transfer_params`` the
prefill returned; ``--pd-mode vllm``).  Both choose their workers through the same ``Attempts`` (the PD
policy slots), send through ``legs`` and answer through the same ``Relay``; ``vllm`` retries its prefill leg
with the regular path's ``RetryLoop``.
"""

from __future__ import annotations

from typing import Protocol

from smg_router import wire
from smg_router.attempt import Attempts
from smg_router.metrics import Metrics
from smg_router.pd.bootstrap import BootstrapDispatcher
from smg_router.pd.vllm import VllmDispatcher
from smg_router.relay import Relay
from smg_router.request import ProxyRequest
from smg_router.retry import RetryLoop
from smg_router.settings import PD_MODES
from smg_router.upstream import Upstream

__all__ = ["PD_MODES", "PDDispatcher", "pd_dispatcher"]


class PDDispatcher(Protocol):
    """Answers one PD-mode request: choose a prefill and a decode worker, hand the KV over, relay the decode."""

    async def forward(self, request: wire.Request, req: ProxyRequest) -> wire.Response: ...


def pd_dispatcher(
    mode: str, *, attempts: Attempts, upstream: Upstream, relay: Relay, metrics: Metrics, retries: RetryLoop
) -> PDDispatcher:
    """The dispatcher of ``--pd-mode``: ``sglang`` (bootstrap rooms) or ``vllm`` (kv_transfer_params)."""
    if mode == "sglang":
        return BootstrapDispatcher(attempts=attempts, upstream=upstream, relay=relay, metrics=metrics)
    if mode == "vllm":
        return VllmDispatcher(attempts=attempts, upstream=upstream, relay=relay, metrics=metrics, retries=retries)
    raise ValueError(f"unknown PD mode {mode!r}: one of {', '.join(PD_MODES)}")
