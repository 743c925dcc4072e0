"""smg-sim: a simulated SGLang/OpenAI-compatible inference worker without a GPU.

Used by the SMG demo, the router's integration tests and benchmarks. The package sits beside the
router and imports nothing from it. Public API: `SimConfig`, `start_sim` (returns a `SimServer`) and
`create_app`; the `smg-sim` command wraps them (`__main__`), `smg-demo` starts a small fleet (`demo`).

Two conventions to know when reading numbers from it: one token is one character (`tokens`), and every
simulated GPU duration (prefill, decode steps) is multiplied by `SimConfig.time_scale`, while wall-clock
behaviours (slow start, bootstrap waits, room expiry) are not.
"""

from __future__ import annotations

from .config import SimConfig
from .server import SimServer, create_app, start_sim
from .version import __version__

__all__ = ["SimConfig", "SimServer", "__version__", "create_app", "start_sim"]
