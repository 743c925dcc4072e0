"""Suite-wide setup: every test talks to loopback only, so no HTTP proxy from the environment may apply."""

from __future__ import annotations

import os

for _name in ("http_proxy", "https_proxy", "all_proxy", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"):
    os.environ.pop(_name, None)
os.environ["NO_PROXY"] = os.environ["no_proxy"] = "127.0.0.0/8,localhost"
