#!/usr/bin/env bash
# Install the Debian packages that hold three of the default corpus sources (see gated_attention/data.py):
#   r-cran-janeaustenr (Austen novels, R data file), bible-kjv (King James Bible), python3.11-doc (Python docs, reST),
# and the C++ build tools (cmake, g++) that the `serve` extra's llama-cpp-python compiles llama.cpp with.
# GATTN_LARGE_SOURCES=1 adds the opt-in large sources (not in the default corpus; ~140 MB download, ~1.3 GB of text):
#   linux-source-6.1 (kernel_c, kernel_doc: GPL-2) and dict-gcide (gcide: GPL-2-or-later); see data/large_sources.py.
# GATTN_BROWSER=1 adds chromium (headless), which scripts/check_report_render.py renders the reports with.
# Idempotent: exits at once when all are installed; runs `apt-get update` only when a package is not yet known to apt.
# Needs root (or sudo). On a non-Debian system it says so and exits 1; `gattn data prepare` then skips those sources.
set -euo pipefail

PACKAGES=(r-cran-janeaustenr bible-kjv python3.11-doc cmake g++)
if [ "${GATTN_LARGE_SOURCES:-0}" = 1 ]; then
    PACKAGES+=(linux-source-6.1 dict-gcide)
fi
if [ "${GATTN_BROWSER:-0}" = 1 ]; then  # headless Chromium for scripts/check_report_render.py (optional)
    PACKAGES+=(chromium)
fi

if ! command -v dpkg-query >/dev/null 2>&1 || ! command -v apt-get >/dev/null 2>&1; then
    echo "install_debian_deps: not a Debian/Ubuntu system (no dpkg/apt-get); skipping ${PACKAGES[*]}" >&2
    exit 1
fi

missing=()
for pkg in "${PACKAGES[@]}"; do
    if [ "$(dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null)" != "install ok installed" ]; then
        missing+=("$pkg")
    fi
done
if [ ${#missing[@]} -eq 0 ]; then
    echo "install_debian_deps: already installed: ${PACKAGES[*]}"
    exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1; then SUDO="sudo"; else
        echo "install_debian_deps: need root to install ${missing[*]} (run as root or install sudo)" >&2
        exit 1
    fi
fi

# Refresh the package lists only if apt has no candidate for one of the missing packages (saves a network round trip).
need_update=0
for pkg in "${missing[@]}"; do
    cand="$(apt-cache policy "$pkg" 2>/dev/null | awk '/Candidate:/ {print $2}')"
    if [ -z "$cand" ] || [ "$cand" = "(none)" ]; then need_update=1; fi
done
if [ "$need_update" -eq 1 ]; then
    echo "install_debian_deps: apt-get update"
    $SUDO apt-get update -qq
fi

echo "install_debian_deps: installing ${missing[*]}"
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
echo "install_debian_deps: done"
