"""The `folio` console script: `folio` or `folio app` starts the desktop app, any other
command runs on the engine's command line. Living above both packages lets the engine
stay free of the GUI: only this module imports `gui`, and only to start the app."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    from engine.cli import parse_args, run, starts_app
    from engine.cli.main import app_argv

    args = parse_args(argv)
    if starts_app(args):
        from gui.app import main as app_main

        return app_main(app_argv(args))
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
