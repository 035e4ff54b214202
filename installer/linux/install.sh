#!/bin/sh
# Install Folio for the current user so that it appears in the application menu and
# opens on double-click.  Run it from a checkout or an unpacked release:
#
#     sh installer/linux/install.sh [--no-fetch] [--torch cpu|cuda|auto]
#
# What it puts where (nothing outside the user's home, no root needed):
#   $ROOT/app/            a copy of Folio's source, installed editable into the venv
#   $ROOT/venv/           Folio's own virtual environment (made by installer/bootstrap.py)
#   $ROOT/bin/folio       the launcher (installer/linux/folio-launcher.sh)
#   $ROOT/logs/           install.log, launcher.log, folio.log
#   $DATA/applications/folio.desktop
#   $DATA/icons/hicolor/<N>x<N>/apps/folio.png, .../scalable/apps/folio.svg
# with DATA=${XDG_DATA_HOME:-~/.local/share} and ROOT=${FOLIO_HOME:-$DATA/folio}.
# The files it created are listed in $ROOT/installed-files.txt for uninstall.sh.
#
# Running it again is quick: the bootstrap's stamp skips every pip step unless
# pyproject.toml or the dependency lock changed, and then pip replaces only the
# packages whose pins changed.  If the install step fails, the previous copy of the
# source is put back (and the bootstrap keeps the previous venv state when it still
# works); the error names the log file.
set -eu

src=$(cd -- "$(dirname -- "$0")/../.." && pwd -P)
data=${XDG_DATA_HOME:-$HOME/.local/share}
case $data in /*) ;; *) data=$HOME/.local/share ;; esac  # XDG: relative means unset
root=${FOLIO_HOME:-$data/folio}
app=$root/app

boot_args=""
while [ $# -gt 0 ]; do
    case $1 in
        --no-fetch) boot_args="$boot_args --no-fetch" ;;
        --torch) [ $# -ge 2 ] || { echo "install.sh: --torch needs cpu, cuda or auto" >&2; exit 2; }
                 boot_args="$boot_args --torch $2"; shift ;;
        --torch=*) boot_args="$boot_args $1" ;;
        -h|--help) sed -n '2,22p' "$0"; exit 0 ;;
        *) echo "install.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    esac
    shift
done

say() { printf '[folio] %s\n' "$*" >&2; }

py=""
for cand in "${FOLIO_PYTHON:-}" python3.14 python3.13 python3.12 python3.11 python3; do
    [ -n "$cand" ] || continue
    if command -v "$cand" >/dev/null 2>&1 &&
        "$cand" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
        py=$(command -v "$cand")
        break
    fi
done
if [ -z "$py" ]; then
    say "Folio needs Python 3.11 or newer (with the venv module). Install it, e.g."
    say "  sudo apt install python3 python3-venv    (Debian, Ubuntu)"
    say "  sudo dnf install python3                 (Fedora)"
    exit 1
fi

mkdir -p "$root/logs"

# 1. Stage a copy of the source, then swap it in; the old copy stays until the
#    bootstrap has succeeded.  The path $root/app never changes, so the venv's
#    editable install of it stays valid across upgrades.
say "Copying Folio to $app ..."
rm -rf "$root/app.new" "$root/app.old"
mkdir -p "$root/app.new"
(cd "$src" && tar cf - --exclude=__pycache__ --exclude='*.pyc' --exclude='*.egg-info' \
    --exclude='*.nbi' --exclude='*.nbc' \
    pyproject.toml README.md engine kernels gui resources installer) |
    (cd "$root/app.new" && tar xf -)
if [ -d "$app" ]; then mv "$app" "$root/app.old"; fi
mv "$root/app.new" "$app"

# 2. The venv, PyTorch, Folio and the default model: all in the bootstrap.
# shellcheck disable=SC2086  # boot_args holds separate words on purpose
if ! "$py" "$app/installer/bootstrap.py" --user $boot_args; then
    say "The install failed; the previous version (if any) was left in place."
    say "Details: $root/logs/install.log"
    rm -rf "$app"
    if [ -d "$root/app.old" ]; then mv "$root/app.old" "$app"; fi
    exit 1
fi
rm -rf "$root/app.old"

manifest=$root/installed-files.txt
: >"$manifest.new"
put() {  # put SOURCE DEST MODE: copy a file and record it for uninstall.sh
    mkdir -p "$(dirname -- "$2")"
    cp -- "$1" "$2.tmp.$$" && chmod "$3" "$2.tmp.$$" && mv -f -- "$2.tmp.$$" "$2"
    printf '%s\n' "$2" >>"$manifest.new"
}

# 3. The launcher.
put "$app/installer/linux/folio-launcher.sh" "$root/bin/folio" 755

# 4. Icons in the hicolor theme, so Icon=folio resolves at every size.
for size in 16 24 32 48 64 128 256 512; do
    put "$app/resources/icons/folio-$size.png" "$data/icons/hicolor/${size}x$size/apps/folio.png" 644
done
put "$app/resources/folio.svg" "$data/icons/hicolor/scalable/apps/folio.svg" 644

# 5. The menu entry.  Its name must be folio.desktop: the app calls
#    QGuiApplication.setDesktopFileName("folio"), which is how Wayland compositors
#    find the icon; StartupWMClass=Folio is the X11 WM_CLASS Qt sets (the class
#    part is the application name).
"$py" - "$root/bin/folio" "$root/folio.desktop" <<'PYEOF'
import sys
launcher, out = sys.argv[1], sys.argv[2]
# Desktop Entry spec: an Exec argument with reserved characters is double-quoted, and
# inside the quotes " ` $ \ take a backslash; then the value itself escapes \ as \\.
quoted = '"' + "".join("\\" + c if c in '"`$\\' else c for c in launcher) + '"'
exec_value = quoted.replace("\\", "\\\\")
lines = [
    "[Desktop Entry]",
    "Type=Application",
    "Version=1.4",
    "Name=Folio",
    "GenericName=Local Language Models",
    "Comment=Run quantized language models locally and watch the KV cache at work",
    f"Exec={exec_value}",
    "TryExec=" + launcher.replace("\\", "\\\\"),
    "Icon=folio",
    "Terminal=false",
    "StartupNotify=true",
    "StartupWMClass=Folio",
    "Categories=Science;ArtificialIntelligence;",
    "Keywords=LLM;AI;chat;language model;GGUF;",
]
with open(out, "w", encoding="utf-8") as fh:
    fh.write("\n".join(lines) + "\n")
PYEOF
put "$root/folio.desktop" "$data/applications/folio.desktop" 644
rm -f "$root/folio.desktop"
mv -f "$manifest.new" "$manifest"

# The menu picks up folio.desktop by watching the folder (no MimeType, so no
# update-desktop-database).  An icon cache, where one already exists, would hide the new
# icons until rebuilt; none is created where there was none.
if [ -f "$data/icons/hicolor/icon-theme.cache" ] && command -v gtk-update-icon-cache >/dev/null 2>&1; then
    gtk-update-icon-cache -q -t -f "$data/icons/hicolor" 2>/dev/null || true
fi

say "Folio is installed: find it in the application menu, or run $root/bin/folio"
