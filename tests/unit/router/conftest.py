from __future__ import annotations

import pytest
from support.policy_env import Env


@pytest.fixture
def env() -> Env:
    return Env()
