"""The HTML template `dvc plots show` fills (`.dvc/plots/offline.html`), with Vega inlined from npm.

DVC's default page loads vega, vega-lite and vega-embed from a CDN, so it draws nothing offline or
behind a firewall. The template inlines the very files that CDN serves (each package's `jsdelivr`
build), pinned in `vendor.json` with the npm registry's `integrity` (sha512 of the tarball) and the
sha512 of the file taken from it. Inlined, the page is one self-contained file to open or share.

    python .dvc/plots/vendor/vendor.py            # offline: the template holds exactly the pinned files
    python .dvc/plots/vendor/vendor.py verify     # + download the tarballs, check their npm integrity
    python .dvc/plots/vendor/vendor.py build      # write the template from the tarballs (after a bump)

To move to other versions: edit `version` in vendor.json, run `build --trust-registry` (it records the
registry's integrity and the file's hash), review the diff, then `verify`.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import re
import sys
import tarfile
import urllib.request
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
MANIFEST = HERE / "vendor.json"
TEMPLATE = HERE.parent / "offline.html"
REGISTRY = "https://registry.npmjs.org"
# dvc_render fills a template by plain text replacement of these (dvc_render/html.py): a vendored
# file must not contain one. "{scripts}" is left out of the template on purpose: DVC would put its
# CDN <script> tags there.
PLACEHOLDERS = ("{scripts}", "{plot_divs}", "{refresh_tag}")
HEAD = """<!DOCTYPE html>
<html>
<head>
<meta charset="utf-8">
<title>DVC Plot</title>
<!-- lockstep: vega, vega-lite and vega-embed are inlined (.dvc/plots/vendor/README.md), so that this
     page draws without a network. Written by .dvc/plots/vendor/vendor.py: do not edit by hand. -->
"""
TAIL = """<script>
// lockstep: SVG rather than vega-embed's default canvas, for every plot DVC embeds: labels stay text
// (searchable, sharp when zoomed or printed) and the drawn marks are elements a test can count.
vegaEmbed = (function (embed) {
    return function (el, spec, opt) { return embed(el, spec, Object.assign({renderer: "svg"}, opt)); };
})(vegaEmbed);
</script>
<style>
table {
    border-spacing: 15px;
}
</style>
</head>
<body>
{plot_divs}
</body>
</html>
"""


def sri(data: bytes) -> str:
    """The npm registry's (and Subresource Integrity's) notation: sha512-<base64 digest>."""
    return "sha512-" + base64.b64encode(hashlib.sha512(data).digest()).decode()


def packages() -> list[dict[str, Any]]:
    return json.loads(MANIFEST.read_text())["packages"]


def inlined_scripts(html: str) -> dict[str, Any]:
    """name@version -> the script text the template inlines for it."""
    found = re.findall(r'<script data-package="([^"]+)">\n(.*?)\n</script>', html, flags=re.DOTALL)
    return dict(found)


def check_template(html: str) -> list[str]:
    """What is wrong with `html` as the offline template (nothing: an empty list)."""
    problems = []
    scripts = inlined_scripts(html)
    for pkg in packages():
        key = f"{pkg['name']}@{pkg['version']}"
        text = scripts.pop(key, None)
        if text is None:
            problems.append(f"{key}: not inlined")
        elif sri(text.encode()) != pkg["file_integrity"]:
            problems.append(f"{key}: inlined script differs from {pkg['file']} of the pinned tarball")
    problems += [f"{key}: inlined but not pinned in vendor.json" for key in scripts]
    if "{plot_divs}" not in html or "{scripts}" in html:
        problems.append("the template must hold {plot_divs} and not {scripts} (DVC's CDN tags)")
    if re.search(r"""<script[^>]+src=["']?https?:""", html):
        problems.append("the template loads a script from the network")
    return problems


def fetch_file(pkg: dict[str, Any], trust_registry: bool = False) -> bytes:
    """The pinned file from the package's npm tarball, after checking the tarball's integrity."""
    url = f"{REGISTRY}/{pkg['name']}/-/{pkg['name']}-{pkg['version']}.tgz"
    with urllib.request.urlopen(url, timeout=60) as response:
        tarball = response.read()
    if trust_registry:  # a version bump: take the registry's word, recorded for every later check
        with urllib.request.urlopen(f"{REGISTRY}/{pkg['name']}/{pkg['version']}", timeout=60) as response:
            pkg["integrity"] = json.loads(response.read())["dist"]["integrity"]
    if sri(tarball) != pkg["integrity"]:
        raise SystemExit(f"{url}: integrity {sri(tarball)} is not the pinned {pkg['integrity']}")
    with tarfile.open(fileobj=io.BytesIO(tarball), mode="r:gz") as archive:
        member = archive.extractfile(pkg["file"])
        assert member is not None, f"{url}: no {pkg['file']}"
        data = member.read()
    if trust_registry:
        pkg["file_integrity"], pkg["file_bytes"] = sri(data), len(data)
    if sri(data) != pkg["file_integrity"]:
        raise SystemExit(f"{url}: {pkg['file']} is not the pinned file ({sri(data)})")
    return data


def build(html_packages: list[dict[str, Any]], files: list[bytes]) -> str:
    for pkg, data in zip(html_packages, files, strict=True):
        text = data.decode()
        if any(p in text for p in PLACEHOLDERS) or "</script" in text.lower():
            raise SystemExit(f"{pkg['name']}: holds a DVC placeholder or </script>: cannot be inlined as it is")
    scripts = [
        f'<script data-package="{pkg["name"]}@{pkg["version"]}">\n{data.decode()}\n</script>\n'
        for pkg, data in zip(html_packages, files, strict=True)
    ]
    return HEAD + "".join(scripts) + TAIL


def main(argv: list[str]) -> int:
    command = argv[0] if argv else "check"
    if command in ("verify", "build"):
        pinned = packages()
        files = [fetch_file(pkg, trust_registry="--trust-registry" in argv) for pkg in pinned]
        if command == "build":
            TEMPLATE.write_text(build(pinned, files))
            manifest = json.loads(MANIFEST.read_text())
            MANIFEST.write_text(json.dumps({**manifest, "packages": pinned}, indent=2) + "\n")
        elif build(pinned, files) != TEMPLATE.read_text():
            print(f"{TEMPLATE}: not what `build` writes from the pinned tarballs", file=sys.stderr)
            return 1
    problems = check_template(TEMPLATE.read_text())
    for problem in problems:
        print(f"{TEMPLATE}: {problem}", file=sys.stderr)
    if not problems:
        print(f"{TEMPLATE}: " + ", ".join(f"{p['name']}@{p['version']}" for p in packages()) + ": as pinned")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
