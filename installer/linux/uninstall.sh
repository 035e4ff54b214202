#!/bin/sh
# Remove what installer/linux/install.sh put in place:
#
#     sh uninstall.sh                  the menu entry, icons, launcher and source copy
#     sh uninstall.sh --remove-venv    ... and Folio's virtual environment
#     sh uninstall.sh --remove-models  ... and the models in $ROOT/models
#     sh uninstall.sh --purge          everything in $ROOT: venv, models, logs, chats
#                                      and settings
#
# Without options the venv and models stay, so a later install.sh is quick.  Models
# kept elsewhere ($FOLIO_MODELS_DIR) are never touched.
set -eu

data=${XDG_DATA_HOME:-$HOME/.local/share}
case $data in /*) ;; *) data=$HOME/.local/share ;; esac
root=${FOLIO_HOME:-$data/folio}
remove_venv="" remove_models="" purge=""
for arg in "$@"; do
    case $arg in
        --remove-venv) remove_venv=1 ;;
        --remove-models) remove_models=1 ;;
        --purge) purge=1 ;;
        -h|--help) sed -n '2,12p' "$0"; exit 0 ;;
        *) echo "uninstall.sh: unknown option $arg (see --help)" >&2; exit 2 ;;
    esac
done

manifest=$root/installed-files.txt
if [ -f "$manifest" ]; then
    while IFS= read -r file; do
        [ -n "$file" ] && rm -f -- "$file"
    done <"$manifest"
else  # an install older than the manifest: the fixed names
    rm -f -- "$data/applications/folio.desktop" "$root/bin/folio" \
        "$data/icons/hicolor/scalable/apps/folio.svg"
    for size in 16 24 32 48 64 128 256 512; do
        rm -f -- "$data/icons/hicolor/${size}x$size/apps/folio.png"
    done
fi
# Empty icon folders this install may have created (never non-empty ones).
for dir in "$data"/icons/hicolor/*/apps "$data"/icons/hicolor/* "$data/icons/hicolor" \
    "$data/icons" "$data/applications"; do
    [ -d "$dir" ] && rmdir -- "$dir" 2>/dev/null || true
done
rm -rf -- "$root/app" "$root/app.new" "$root/app.old" "$root/bin" "$manifest"
[ -n "$remove_venv" ] && rm -rf -- "$root/venv"
[ -n "$remove_models" ] && rm -rf -- "$root/models"
[ -n "$purge" ] && rm -rf -- "$root"
[ -d "$root" ] && rmdir -- "$root" 2>/dev/null || true

if [ -f "$data/icons/hicolor/icon-theme.cache" ] && command -v gtk-update-icon-cache >/dev/null 2>&1; then
    gtk-update-icon-cache -q -t -f "$data/icons/hicolor" 2>/dev/null || true
fi
echo "[folio] Folio was removed${purge:+, with all its data}."
