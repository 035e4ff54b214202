#!/bin/sh
# Folio's launcher, installed as <data>/folio/bin/folio by install.sh and started by
# the application menu entry (folio.desktop).  It only finds a Python >= 3.11 and
# hands over to the bootstrap, which keeps the install up to date, checks that Qt can
# open a window and then starts the app; all logic lives there (installer/bootstrap.py).
# Arguments go to the app, e.g. `folio --smoke-test`.
set -u

# <root>/bin/folio -> <root>; resolve symlinks so a link in ~/.local/bin works too.
self=$(readlink -f -- "$0" 2>/dev/null || printf '%s' "$0")
root=$(cd -- "$(dirname -- "$self")/.." && pwd -P)
export FOLIO_HOME="$root"

fail() {
    mkdir -p "$root/logs"
    printf '%s folio launcher: %s\n' "$(date '+%Y-%m-%d %H:%M:%S')" "$1" >>"$root/logs/launcher.log"
    printf 'folio: %s\n' "$1" >&2
    if [ ! -t 2 ]; then  # started from the menu: nobody sees stderr, so show a dialog
        if command -v zenity >/dev/null 2>&1; then zenity --error --title=Folio --no-markup --text="$1"
        elif command -v kdialog >/dev/null 2>&1; then kdialog --title Folio --error "$1"
        elif command -v notify-send >/dev/null 2>&1; then notify-send --urgency=critical Folio "$1"
        fi
    fi
    exit 1
}

py=""
for cand in "${FOLIO_PYTHON:-}" python3.14 python3.13 python3.12 python3.11 python3; do
    [ -n "$cand" ] || continue
    if command -v "$cand" >/dev/null 2>&1 &&
        "$cand" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
        py=$cand
        break
    fi
done
[ -n "$py" ] || fail "Folio needs Python 3.11 or newer. Install it with your package manager (for example: sudo apt install python3), then start Folio again."
[ -f "$root/app/installer/bootstrap.py" ] || fail "Folio's files are missing from $root/app; run installer/linux/install.sh again."

# No terminal (menu, file manager): the bootstrap logs to <root>/logs and shows errors
# in a dialog instead of printing them.
windowed=""
[ -t 2 ] || windowed="--windowed"
exec "$py" "$root/app/installer/bootstrap.py" --user $windowed --launch "$@"
