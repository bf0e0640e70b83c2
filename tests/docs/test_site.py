"""The documentation site builds with warnings as errors, its API reference names every public name,
and in a real headless Chromium every page loads, every internal link reaches a page and anchor that
exist, and every image loads.

The build is the README's command (``mkdocs build --strict``). The browser is the system's Chromium
(Debian's ``chromium`` package) driven by playwright, which downloads no browser of its own here.
Where Chromium is missing the browser test skips, except in CI (``CI=true``), where it fails.
"""

from __future__ import annotations

import functools
import http.server
import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from urllib.parse import unquote, urldefrag, urljoin

import pytest
from helpers.docblocks import DOCS, ROOT

try:
    import mkdocs  # noqa: F401
except ImportError:
    if os.environ.get("CI"):  # CI installs the docs extra: a broken install must fail, not skip
        raise
    pytest.skip("the documentation site needs the docs extra: pip install -e '.[docs]'", allow_module_level=True)

REFERENCE = DOCS / "reference.md"


def build(site: Path) -> subprocess.CompletedProcess:
    """``mkdocs build --strict`` of this checkout into ``site``."""
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
                          cwd=ROOT, capture_output=True, text=True, timeout=240)


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    proc = build(out)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return out


def test_the_readme_names_the_build_command():
    assert "mkdocs build --strict" in (ROOT / "README.md").read_text()


# -- the API reference ------------------------------------------------------------------------------

def public_names() -> list[str]:
    import fastdata

    return list(fastdata.__all__)


def unreferenced(reference_md: str, reference_html: str, names: list[str]) -> list[str]:
    """The public names that the reference page does not document: no ``::: fastdata.NAME`` entry,
    or no heading of that id in the built page."""
    entries = set(re.findall(r"^::: fastdata\.(\S+)\s*$", reference_md, re.M))
    return [n for n in names if n not in entries or f'id="fastdata.{n}"' not in reference_html]


def test_the_reference_documents_every_public_name(site):
    names = public_names()
    assert len(names) > 20
    html = (site / "reference" / "index.html").read_text()
    assert unreferenced(REFERENCE.read_text(), html, names) == []


def test_control_a_name_left_out_of_the_reference_is_found(site):
    text = REFERENCE.read_text().replace("::: fastdata.mix\n", "")
    html = (site / "reference" / "index.html").read_text()
    assert unreferenced(text, html, public_names()) == ["mix"]
    assert unreferenced(REFERENCE.read_text(), html, [*public_names(), "WriteOptionsNotYetWritten"]) == [
        "WriteOptionsNotYetWritten"]


#: a Sphinx role as the docstrings write it and as mkdocstrings would show it unrewritten (":class:" then code)
_ROLE_TEXT = re.compile(r":(?:class|func|meth|mod|attr|exc|data|obj):")


def test_the_reference_shows_no_sphinx_role_as_text(site):
    """The docstrings' roles (:class:`fastdata.X`, :func:`...`) are rewritten by docs/griffe_roles.py:
    none is left as text, a role naming a documented object links to its entry, and one naming an
    internal helper is plain code, no link."""
    html = (site / "reference" / "index.html").read_text()
    assert _ROLE_TEXT.findall(html) == []
    # :func:`fastdata.loader` (in DistributedShardSampler's docstring), :meth:`load_state_dict` (a member)
    assert re.search(r'<a class="autorefs[^"]*"[^>]*href="#fastdata\.loader"><code>fastdata\.loader</code></a>', html)
    assert re.search(r'href="#fastdata\.DistributedShardSampler\.load_state_dict"><code>load_state_dict</code></a>',
                     html)
    # :mod:`fastdata.writer.remote_sink` is not on the site: code with its path as a tooltip, no link
    assert '<span title="fastdata.writer.remote_sink"><code>fastdata.writer.remote_sink</code></span>' in html
    assert "<autoref" not in html


def test_control_a_role_left_unrewritten_is_found():
    """The check above finds a role that mkdocstrings would print as text, and the rewriting turns
    each form into code (shortened with ``~``, titled with ``Title <target>``)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("griffe_roles", DOCS / "griffe_roles.py")
    roles = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(roles)
    assert _ROLE_TEXT.findall("see :class:<code>fastdata.X</code> and :meth:<code>get</code>") == [":class:", ":meth:"]
    assert roles.parse_role("fastdata.loader") == ("fastdata.loader", "fastdata.loader")
    assert roles.parse_role("~fastdata.writer.options.WriteOptions") == ("WriteOptions",
                                                                         "fastdata.writer.options.WriteOptions")
    assert roles.parse_role("ImageStorage <fastdata.sources.ImageStorage>") == ("ImageStorage",
                                                                               "fastdata.sources.ImageStorage")
    text = "a :class:`~a.B`, :py:func:`c` and :unknown:`d`"
    assert roles.ROLE.sub(lambda m: f"[{roles.parse_role(m['body'])[0]}]", text) == "a [B], [c] and :unknown:`d`"


@pytest.mark.slow  # a second build (seconds): the control of the strict build, nightly
def test_control_a_broken_link_fails_the_strict_build(tmp_path):
    """A copy of the docs with a link to a page that does not exist does not build."""
    copy = tmp_path / "repo"
    shutil.copytree(ROOT / "docs", copy / "docs")
    shutil.copy(ROOT / "mkdocs.yml", copy / "mkdocs.yml")
    (copy / "fastdata").symlink_to(ROOT / "fastdata")
    page = copy / "docs" / "getting-started.md"
    page.write_text(page.read_text() + "\nSee [the missing page](guides/no-such-page.md).\n")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "s")],
                          cwd=copy, capture_output=True, text=True, timeout=240)
    assert proc.returncode != 0 and "no-such-page.md" in proc.stdout + proc.stderr


# -- the site in a real browser ---------------------------------------------------------------------

def chromium() -> str:
    """The system's Chromium; skips where it is missing, fails in CI."""
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    if os.environ.get("CI"):
        pytest.fail("CI is set but no Chromium was found: apt-get install -y chromium")
    pytest.skip("no Chromium here (apt-get install -y chromium); CI installs it")


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


def serve(root: Path) -> tuple[http.server.ThreadingHTTPServer, str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Quiet, directory=str(root)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/"


def browse(root: Path, only: list[str] | None = None) -> list[str]:
    """Open every HTML page of the site at ``root`` (or those named in ``only``) in headless Chromium;
    return what is broken: a page that does not load, an internal link to a page or anchor that does
    not exist, an image that did not load."""
    from playwright.sync_api import sync_playwright

    files = sorted(p.relative_to(root).as_posix() for p in root.rglob("*.html"))
    to_open = [f for f in files if only is None or f in only]
    server, base = serve(root)
    problems: list[str] = []
    ids: dict[str, set[str]] = {}
    links: list[tuple[str, str]] = []
    try:
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=chromium(), headless=True, args=["--no-sandbox"])
            page = browser.new_page()

            def visit(url: str) -> bool:
                """Load one page and note its ids; False when it does not load."""
                response = page.goto(url, wait_until="load")
                if response is None or response.status != 200:
                    return False
                ids[url] = set(page.eval_on_selector_all("[id]", "els => els.map(e => e.id)"))
                return True

            for name in to_open:
                url = urljoin(base, name[: -len("index.html")] if name.endswith("index.html") else name)
                if not visit(url):
                    problems.append(f"{name}: does not load")
                    continue
                for img in page.eval_on_selector_all(
                        "img", "els => els.map(e => [e.getAttribute('src'), e.complete && e.naturalWidth > 0])"):
                    if not img[1]:
                        problems.append(f"{name}: image {img[0]} did not load")
                for href in page.eval_on_selector_all("a[href]", "els => els.map(e => e.href)"):
                    if href.startswith(base):
                        links.append((name, href))
            for name, href in links:
                target, fragment = urldefrag(href)
                if target not in ids and not visit(target):
                    problems.append(f"{name}: link to {href}: no such page")
                    continue
                if target in ids and fragment and unquote(fragment) not in ids[target]:
                    problems.append(f"{name}: link to {href}: no such anchor")
            browser.close()
    finally:
        server.shutdown()
    return problems


#: what the test below breaks in its copy of the site's home page, and what browse() must report
_BROKEN = ('<a href="guides/no-such-page/">x</a> <a href="getting-started/#no-such-anchor">y</a> '
           '<img src="img/no-such-image.png">')


def test_every_page_link_and_image_works_in_chromium(site, tmp_path):
    """One walk of the whole site, with three faults put into a copy of its home page as the control:
    exactly those three are reported, so the check finds faults and the site has no other."""
    chromium()
    assert len(list(site.rglob("*.html"))) >= 20  # every page of mkdocs.yml's nav, and the 404 page
    copy = tmp_path / "site"
    shutil.copytree(site, copy)
    index = copy / "index.html"
    index.write_text(index.read_text().replace("</article>", _BROKEN + "</article>", 1))
    found = browse(copy)
    assert len(found) == 3, found
    assert any("no-such-page" in p and "no such page" in p for p in found), found
    assert any("no-such-anchor" in p and "no such anchor" in p for p in found), found
    assert any("no-such-image.png" in p and "did not load" in p for p in found), found
