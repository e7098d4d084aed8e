import sys

import click
import uvloop

from meshbus.demo.run import run


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--play-seconds",
    type=click.FloatRange(8),
    default=45.0,
    show_default=True,
    help="How long the MMO plays; the broker is killed a quarter in, the fourth joins halfway.",
)
@click.option(
    "--report",
    "report_path",
    type=click.Path(dir_okay=False, writable=True),
    default="report.html",
    show_default=True,
    help="Where the telemetry report is written.",
)
def main(play_seconds: float, report_path: str) -> None:
    """The whole product in one command: see `meshbus.demo`."""
    try:
        sys.exit(uvloop.run(run(play_seconds, report_path)))
    except KeyboardInterrupt:
        click.echo("demo interrupted; every broker and Spark process was stopped", err=True)
        sys.exit(130)


main()
