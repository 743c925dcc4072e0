"""pd: prefill/decode disaggregation (DESIGN 2.6); below ``proxy``, above ``relay`` and ``attempt``."""

from smg_router.pd.bootstrap import PDDispatcher

__all__ = ["PDDispatcher"]
