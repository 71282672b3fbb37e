#!/usr/bin/env python3
"""Opens the built docs site in a headless Chromium (Debian's `chromium`), as a reader would,
and checks that the pages render (make docs). Standard library only.

The site (target/docs) is served on 127.0.0.1 by Python's http.server, at the origin's root,
as it is meant to be published. For each page below: the DOM after load (`--dump-dom`) must
have the expected title and heading, Chromium's log must show no console error (an uncaught
exception, a resource that failed to load), and the server must have answered every request
the page made with 2xx or 304; then a screenshot is saved under target/docs-shots/. The third
page is a problem type reached by the URI its `type` member names (`/problems/<slug>`), so
that the URI is proven to resolve.

Usage: docs-browser.py SITE_DIR SHOTS_DIR. Exits 1 on any failure, 2 when Chromium is missing
(it says how to get it): never skips.
"""

import contextlib
import http.server
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading

# (name, path on the site, what the <title> must contain (the summary's name of the page),
# what the first <h1> of the page's <main> must say)
PAGES = [
    ("index", "/", "Edge idempotency", "Edge idempotency"),
    ("configuration", "/reference/configuration.html", "The configuration file", "The configuration file"),
    ("problem-outcome-unknown", "/problems/outcome-unknown", "outcome-unknown",
     "The outcome of the request with this key is unknown"),
]

CHROMIUM_FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--hide-scrollbars", "--window-size=1280,900",
]


def chromium():
    for name in ("chromium", "chromium-browser"):
        path = shutil.which(name)
        if path:
            return path
    return None


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    """Serves the site; keeps the status of every request instead of printing it."""

    log = []

    def log_message(self, fmt, *args):
        pass

    def log_request(self, code="-", size="-"):
        try:
            status = int(code)
        except (TypeError, ValueError):
            status = 0
        QuietHandler.log.append((self.path, status))


@contextlib.contextmanager
def serve(site):
    handler = lambda *a, **k: QuietHandler(*a, directory=site, **k)  # noqa: E731
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def run_chromium(binary, args, url):
    """Runs one headless Chromium with a fresh profile; returns (stdout, stderr)."""
    with tempfile.TemporaryDirectory(prefix="docs-chromium-") as profile:
        cmd = [binary, *CHROMIUM_FLAGS, f"--user-data-dir={profile}",
               "--enable-logging=stderr", "--v=0", *args, url]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"chromium exited {done.returncode}: {done.stderr[-2000:]}")
        return done.stdout, done.stderr


def console_errors(stderr):
    """Console messages Chromium logged (at INFO, `CONSOLE` in the line) and failed loads."""
    bad = []
    for line in stderr.splitlines():
        # Chromium logs every console message the same way, whatever its level: the site
        # logs nothing, so any message is taken as a failure.
        if ":CONSOLE" in line:
            bad.append(line.strip())
        elif "ERR_" in line and "net::" in line:
            bad.append(line.strip())
    return bad


def text_of(html, tag):
    m = re.search(rf"<{tag}[^>]*>(.*?)</{tag}>", html, re.S | re.I)
    return re.sub(r"<[^>]+>", "", m.group(1)).strip() if m else None


def main():
    if len(sys.argv) != 3:
        print("usage: docs-browser.py SITE_DIR SHOTS_DIR", file=sys.stderr)
        return 2
    site, shots = sys.argv[1], sys.argv[2]
    binary = chromium()
    if binary is None:
        print("docs-browser: Debian's chromium is not installed: `make tools-docs` as root "
              "installs it, or `sudo apt-get install -y chromium`", file=sys.stderr)
        return 2
    if not os.path.isfile(os.path.join(site, "index.html")):
        print(f"docs-browser: {site}/index.html does not exist: build the site first (make docs)",
              file=sys.stderr)
        return 1
    os.makedirs(shots, exist_ok=True)
    failures = []
    with serve(site) as origin:
        for name, path, title, heading in PAGES:
            url = origin + path
            QuietHandler.log.clear()
            before = len(failures)
            try:
                dom, log = run_chromium(binary, ["--dump-dom", "--virtual-time-budget=3000"], url)
            except (RuntimeError, subprocess.TimeoutExpired) as e:
                failures.append(f"{path}: {e}")
                continue
            got_title = text_of(dom, "title")
            main = re.search(r"<main[^>]*>(.*?)</main>", dom, re.S | re.I)
            got_h1 = text_of(main.group(1), "h1") if main else None
            if not got_title or title not in got_title:
                failures.append(f"{path}: title {got_title!r}, expected one with {title!r}")
            if got_h1 != heading:
                failures.append(f"{path}: first heading {got_h1!r}, expected {heading!r}")
            for line in console_errors(log):
                failures.append(f"{path}: console: {line}")
            for requested, status in list(QuietHandler.log):
                if not (200 <= status < 300 or status in (301, 304)):
                    failures.append(f"{path}: the page asked for {requested}: HTTP {status}")
            shot = os.path.abspath(os.path.join(shots, f"{name}.png"))
            if os.path.exists(shot):
                os.remove(shot)
            try:
                run_chromium(binary, [f"--screenshot={shot}"], url)
            except (RuntimeError, subprocess.TimeoutExpired) as e:
                failures.append(f"{path}: screenshot: {e}")
                continue
            if not os.path.isfile(shot) or os.path.getsize(shot) < 10_000:
                failures.append(f"{path}: no screenshot, or an empty one, at {shot}")
                continue
            if len(failures) == before:
                print(f"docs-browser: {path}: title {got_title!r}, no console errors, {shot}")
    if failures:
        for f in failures:
            print(f"docs-browser: FAILED {f}", file=sys.stderr)
        return 1
    print(f"docs-browser: {len(PAGES)} pages rendered in {os.path.basename(binary)}, screenshots in {shots}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
