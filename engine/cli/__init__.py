"""`folio`'s command line on the engine: `folio generate`, `chat`, `models`, `bench`.

`main.py` holds the parser and the dispatch; each command with more than a few lines has
its own module. The console script itself is `folio/main.py`, which starts the desktop
app for `folio` and `folio app` and hands every other command to `run`.
"""

from engine.cli.main import model_path, parse_args, run, starts_app

__all__ = ["model_path", "parse_args", "run", "starts_app"]
