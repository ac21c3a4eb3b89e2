#!/bin/sh
# debian-python.sh DEST: put a relocatable copy of this Debian's own CPython (python3, with pip) into
# DEST, laid out as fetch-python.sh lays out python-build-standalone: DEST/bin/python3 and the standard
# library in DEST/lib/python3.X.
#
# The Dockerfiles' PYTHON_SOURCE=debian: for builds that reach Debian and PyPI but not github.com
# (python-build-standalone's releases). Runs in a Dockerfile build stage on Debian with python3,
# python3-pip-whl (pip's wheel, as Debian's ensurepip uses it) and patchelf installed; PYTHON names another
# interpreter of that system (default python3).
#
# Python finds its standard library relative to its own location. The shared libraries it and its
# extension modules need beyond glibc (zlib, expat, OpenSSL, libffi, sqlite, ...) are copied into
# DEST/lib and found there through each binary's run path ($ORIGIN), so DEST can be copied anywhere, as
# the trial pod does. Unlike python-build-standalone (glibc >= 2.17) the copy needs a glibc at least as
# new as the Debian it came from (bookworm 2.36, trixie 2.41) in the image it runs in: production builds
# keep PYTHON_SOURCE=standalone.
#
# Packages: Debian's site module reads DEST/lib/python3/dist-packages (and DEST/local/lib/...); with
# DEB_PYTHON_INSTALL_LAYOUT=deb in the environment, `DEST/bin/python3 -m pip install` puts packages there
# and their scripts in DEST/bin, as python-build-standalone's pip does in its prefix.
set -eu

die() {
  echo "debian-python: $*" >&2
  exit 1
}

[ "$#" -eq 1 ] || die "usage: debian-python.sh DEST"
dest=$1
python=${PYTHON:-python3}
command -v patchelf >/dev/null 2>&1 || die "needs patchelf (apt-get install patchelf)"
command -v ldd >/dev/null 2>&1 || die "needs ldd (libc-bin)"
"$python" -c 'import sys, sysconfig; sys.exit("deb_system" not in sysconfig.get_scheme_names())' ||
  die "$python is not Debian's own python3 (its sysconfig has no deb_system scheme)"
exe=$("$python" -c 'import os, sys; print(os.path.realpath(sys.executable))')
version=$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
stdlib=$("$python" -c 'import sysconfig; print(sysconfig.get_path("stdlib"))')
[ -d "$stdlib/lib-dynload" ] || die "$stdlib has no lib-dynload"
set -- /usr/share/python-wheels/pip-*.whl
[ -f "$1" ] || die "no pip wheel in /usr/share/python-wheels (apt-get install python3-pip-whl)"
pip_wheel=$1

rm -rf "$dest"
mkdir -p "$dest/bin" "$dest/lib"
cp "$exe" "$dest/bin/python$version"
ln -s "python$version" "$dest/bin/python3"
ln -s python3 "$dest/bin/python"
# -L: Debian links _sysconfigdata within the folder and sitecustomize.py into /etc (dropped below).
cp -RL "$stdlib" "$dest/lib/python$version"
lib=$dest/lib/python$version
# Debian's apport hook (sitecustomize), its marker that apt manages the packages (nothing does here), and
# what no legorl runtime uses: the test suite, Tk, IDLE, turtle demos, the static library for embedding.
rm -rf "$lib/sitecustomize.py" "$lib/EXTERNALLY-MANAGED" "$lib/test" "$lib/idlelib" "$lib/tkinter" "$lib/turtledemo" "$lib/turtle.py" \
  "$lib"/config-"$version"-*
rm -f "$lib"/lib-dynload/_tkinter*.so

# The libraries beyond glibc, next to each other in DEST/lib; the binaries look there first. DT_RPATH
# (--force-rpath), unlike RUNPATH, also serves the libraries' own dependencies.
glibc='^(linux-vdso|ld-linux|libc|libm|libpthread|libdl|librt|libutil|libresolv|libanl|libnsl|libBrokenLocale)\.so'
for binary in "$dest/bin/python$version" "$lib"/lib-dynload/*.so; do
  ldd "$binary" | while read -r name arrow path _; do
    [ "$arrow" = "=>" ] || continue
    echo "$name" | grep -Eq "$glibc" && continue
    [ -f "$path" ] || die "$binary needs $name, which is not found"
    [ -e "$dest/lib/$name" ] || cp -L "$path" "$dest/lib/$name"
  done
done
for bundled in "$dest"/lib/*.so*; do
  [ -f "$bundled" ] || continue
  chmod u+w "$bundled"
  patchelf --force-rpath --set-rpath "\$ORIGIN" "$bundled"
done
patchelf --force-rpath --set-rpath "\$ORIGIN/../lib" "$dest/bin/python$version"
for module in "$lib"/lib-dynload/*.so; do
  patchelf --force-rpath --set-rpath "\$ORIGIN/../.." "$module"
done

# pip from Debian's wheel (no network; Debian's ensurepip refuses a system Python), run from the wheel
# itself, into the copy's own site directory.
DEB_PYTHON_INSTALL_LAYOUT=deb "$dest/bin/python3" -I "$pip_wheel/pip" install --quiet --no-index \
  --no-cache-dir --disable-pip-version-check --root-user-action=ignore "$pip_wheel"

"$dest/bin/python3" -I -c '
import sys, ssl, sqlite3, ctypes, decimal, lzma, bz2, zlib, hashlib, pyexpat, uuid, pip
assert sys.prefix == sys.argv[1], (sys.prefix, sys.argv[1])
assert pip.__file__.startswith(sys.prefix + "/lib/python3/dist-packages/"), pip.__file__
print("debian-python:", sys.version.split()[0], sys.prefix, ssl.OPENSSL_VERSION)
' "$(cd "$dest" && pwd -P)"
