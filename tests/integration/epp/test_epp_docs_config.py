"""The Envoy configuration docs/epp.md shows is one Envoy accepts (its strict validation), with the processing mode
the picker's tests use."""

from __future__ import annotations

import re
from pathlib import Path

import yaml
from support.envoy import validate

DOC = Path(__file__).parents[3] / "docs" / "epp.md"


def test_the_documented_envoy_configuration_validates(tmp_path: Path) -> None:
    (block,) = re.findall(r"```yaml\n(.*?)```", DOC.read_text(), flags=re.S)
    config = yaml.safe_load(block)
    result = validate(config, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    ext_proc = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    mode = ext_proc["http_filters"][0]["typed_config"]["processing_mode"]
    assert mode["response_body_mode"] == "NONE" and mode["response_trailer_mode"] == "SEND"
