"""docs/security.md tells which commands take TLS options as the code has them: the
report and the Spark source do (the client commands' --tls-* and tlsCa/tlsCert/tlsKey),
`mesh up` through its --config, the demo always."""

from __future__ import annotations

import re
from pathlib import Path

from click.testing import CliRunner

from meshbus.report.cli import report

ROOT = Path(__file__).parents[3]


def _tls_section() -> str:
    text = (ROOT / "docs" / "security.md").read_text()
    found = re.search(r"\n## TLS\n(.*?)\n## ", text, re.S)
    assert found is not None
    return " ".join(found[1].split())


def test_the_docs_say_the_report_and_the_spark_source_take_tls_options() -> None:
    helped = CliRunner().invoke(report, ["--help"])
    for flag in ("--tls-ca", "--tls-cert", "--tls-key"):
        assert flag in helped.stdout
    spark_options = (ROOT / "src" / "meshbus" / "spark" / "options.py").read_text()
    section = _tls_section()
    assert "`meshbus report` takes the same options" in section
    for option in ("tlsCa", "tlsCert", "tlsKey"):
        assert f'"{option}"' in spark_options
        assert f"`{option}`" in section
    assert "`meshbus mesh up --config FILE` starts every broker with TLS" in section
    assert "do not take TLS options" not in section
