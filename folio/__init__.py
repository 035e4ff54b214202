"""Folio's entry points, above both `gui` and `engine`.

`main.py` is the `folio` console script: the desktop app for `folio` and `folio app`,
every other command through the engine's command line (`engine/cli`).
`platform_setup.py` prepares a launcher's process (log file, Windows taskbar ID) before
anything heavy is imported, then runs `main`. `python -m folio` is the launchers' way in.
"""
