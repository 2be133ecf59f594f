"""`--port` of `gpupool serve` and `gpupool up`: a value that is not a TCP port is argparse's
usage error (exit 2, one line naming the flag), never a traceback from the config's validation
(the router section validates on construction, so `--port 70000` used to raise a pydantic
ValidationError out of `with_port`)."""

from __future__ import annotations

import pytest

from router.cli import main


@pytest.mark.parametrize("command", ["serve", "up"])
@pytest.mark.parametrize(
    ("value", "says"), [("70000", "a port is 1-65535, got 70000"), ("0", "got 0"), ("x", "'x'")]
)
def test_a_bad_port_is_a_usage_error(
    command: str, value: str, says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main([command, "--port", value])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "argument --port" in err and says in err
    assert "Traceback" not in err
