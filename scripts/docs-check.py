#!/usr/bin/env python3
"""The docs site's own checks (make docs), standard library only.

Before the build (`docs-check.py source`):
  - every page under docs/ is in docs/SUMMARY.md, and every summary entry exists;
  - every relative link in docs/ and README.md names a file that exists, and a page it names
    inside docs/ is in the summary;
  - every alert in examples/prometheus/alerts.yml has a runbook_url naming its page, which
    exists and is in the summary;
  - every page is at most two clicks (links) away from README.md.

After the build (`docs-check.py built DIR`):
  - every anchor a link names (`page.md#anchor`, `#anchor`) is an id in the built page;
  - every problem type's page is served at the URI its `type` names (problems/<slug>/);
  - prints the number of pages built.

Exits 1 with every failure listed; never skips a check.
"""

import html.parser
import os
import re
import sys

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
DOCS = os.path.join(ROOT, "docs")
SUMMARY = os.path.join(DOCS, "SUMMARY.md")
ALERTS = os.path.join(ROOT, "examples", "prometheus", "alerts.yml")
RUNBOOK_BASE = "http://127.0.0.1:3000/runbooks/"

LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.S | re.M)
INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1", re.S)


def rel(path):
    return os.path.relpath(path, ROOT)


def pages_on_disk():
    found = set()
    for base, _, files in os.walk(DOCS):
        for name in files:
            if name.endswith(".md") and name != "SUMMARY.md":
                found.add(os.path.normpath(os.path.join(base, name)))
    return found


def summary_pages():
    """The pages SUMMARY.md lists, as absolute paths."""
    text = strip_code(open(SUMMARY, encoding="utf-8").read())
    return [os.path.normpath(os.path.join(DOCS, t.split("#")[0])) for t in LINK.findall(text)]


def strip_code(text):
    """Links inside code are text, not links."""
    text = FENCE.sub("", text)
    return INLINE_CODE.sub("", text)


def links(path):
    """(target, line) for every link and image in a Markdown file, outside code."""
    text = open(path, encoding="utf-8").read()
    text = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    text = INLINE_CODE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    for m in LINK.finditer(text):
        yield m.group(1), text.count("\n", 0, m.start()) + 1


def linked_pages(source):
    """The Markdown pages a file links to."""
    for target, _ in links(source):
        if is_external(target) or target.startswith("#"):
            continue
        resolved = os.path.normpath(os.path.join(os.path.dirname(source), target.split("#")[0]))
        if resolved.endswith(".md") and os.path.isfile(resolved):
            yield resolved


def is_external(target):
    return re.match(r"^[a-z][a-z0-9+.-]*:", target) is not None


def markdown_files():
    files = sorted(pages_on_disk() | {os.path.join(DOCS, "SUMMARY.md")})
    return [os.path.join(ROOT, "README.md")] + files


def check_source():
    errors = []
    listed = summary_pages()
    listed_set = set(listed)
    for page in listed:
        if not os.path.isfile(page):
            errors.append(f"docs/SUMMARY.md lists {rel(page)}, which does not exist")
    for dup in sorted({p for p in listed if listed.count(p) > 1}):
        errors.append(f"docs/SUMMARY.md lists {rel(dup)} more than once")
    for page in sorted(pages_on_disk() - listed_set):
        errors.append(f"{rel(page)} is not in docs/SUMMARY.md (every page must be)")

    for source in markdown_files():
        for target, line in links(source):
            if is_external(target) or target.startswith("#"):
                continue
            path = target.split("#")[0]
            resolved = os.path.normpath(os.path.join(os.path.dirname(source), path))
            where = f"{rel(source)}:{line}"
            if not os.path.exists(resolved):
                errors.append(f"{where}: broken link {target} ({rel(resolved)} does not exist)")
                continue
            inside_docs = resolved.startswith(DOCS + os.sep)
            if source.startswith(DOCS + os.sep) and not inside_docs:
                errors.append(f"{where}: link {target} leaves docs/ (the built site has only docs/)")
            if inside_docs and resolved.endswith(".md") and resolved not in listed_set \
                    and not resolved.endswith("SUMMARY.md"):
                errors.append(f"{where}: link {target} names a page not in docs/SUMMARY.md")

    # A newcomer reaches every page in two clicks from the README (issue 50).
    readme = os.path.join(ROOT, "README.md")
    reach = {readme}
    for _ in range(2):
        for page in list(reach):
            reach |= set(linked_pages(page))
    for page in sorted(listed_set - reach):
        errors.append(f"{rel(page)} is more than two clicks away from README.md")

    alerts = open(ALERTS, encoding="utf-8").read()
    blocks = re.split(r"^\s*- alert: ", alerts, flags=re.M)[1:]
    if not blocks:
        errors.append(f"{rel(ALERTS)}: no alerts found")
    for block in blocks:
        name = block.split()[0]
        url = re.search(r"runbook_url:\s*\"?([^\"\s]+)\"?", block)
        if not url:
            errors.append(f"{rel(ALERTS)}: alert {name} has no runbook_url annotation")
            continue
        url = url.group(1)
        if not url.startswith(RUNBOOK_BASE) or not url.endswith(".html"):
            errors.append(f"{rel(ALERTS)}: alert {name}'s runbook_url {url} is not {RUNBOOK_BASE}<page>.html")
            continue
        page = os.path.join(DOCS, "runbooks", url[len(RUNBOOK_BASE):-len(".html")] + ".md")
        if not os.path.isfile(page):
            errors.append(f"{rel(ALERTS)}: alert {name}'s runbook {rel(page)} does not exist")
        elif page not in listed_set:
            errors.append(f"{rel(ALERTS)}: alert {name}'s runbook {rel(page)} is not in docs/SUMMARY.md")
        elif name not in open(page, encoding="utf-8").readline():
            errors.append(f"{rel(page)}: its title does not name the alert {name}")
    return errors, len(listed_set), len(blocks)


class Ids(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.ids = set()

    def handle_starttag(self, tag, attrs):
        for key, value in attrs:
            if key == "id" and value:
                self.ids.add(value)


def ids_of(built_page, cache={}):
    if built_page not in cache:
        parser = Ids()
        parser.feed(open(built_page, encoding="utf-8").read())
        cache[built_page] = parser.ids
    return cache[built_page]


def built_page_of(source_md, built):
    """The HTML page mdBook makes of a page under docs/ (README.md is the folder's index)."""
    relative = os.path.relpath(source_md, DOCS)
    stem, _ = os.path.splitext(relative)
    if os.path.basename(stem) == "README":
        stem = os.path.join(os.path.dirname(stem), "index")
    return os.path.join(built, stem + ".html")


def check_built(built):
    errors = []
    if not os.path.isfile(os.path.join(built, "index.html")):
        return [f"{built}/index.html does not exist: was the site built?"], 0
    for source in markdown_files():
        for target, line in links(source):
            if is_external(target) or "#" not in target:
                continue
            path, anchor = target.split("#", 1)
            page_md = source if path == "" else os.path.normpath(os.path.join(os.path.dirname(source), path))
            if not page_md.endswith(".md") or not page_md.startswith(DOCS + os.sep):
                continue
            page = built_page_of(page_md, built)
            where = f"{rel(source)}:{line}"
            if not os.path.isfile(page):
                errors.append(f"{where}: {target}: {rel(page)} was not built")
            elif anchor not in ids_of(page):
                errors.append(f"{where}: {target}: no heading with id {anchor!r} in {rel(page)}")
    problems = os.path.join(DOCS, "problems")
    for slug in sorted(os.listdir(problems)):
        served = os.path.join(built, "problems", slug, "index.html")
        if not os.path.isfile(served):
            errors.append(f"/problems/{slug} does not resolve: {rel(served)} was not built")
    pages = sum(
        1 for base, _, files in os.walk(built) for f in files
        if f.endswith(".html") and f not in ("print.html", "404.html", "toc.html")
    )
    return errors, pages


def main():
    if len(sys.argv) >= 2 and sys.argv[1] == "source":
        errors, pages, alerts = check_source()
        summary = f"docs-check: {pages} pages in the summary, {alerts} alerts with their runbooks"
    elif len(sys.argv) == 3 and sys.argv[1] == "built":
        errors, pages = check_built(sys.argv[2])
        summary = f"docs-check: {pages} pages built, every anchor and problem type resolves"
    else:
        print("usage: docs-check.py source | built DIR", file=sys.stderr)
        return 2
    if errors:
        for e in errors:
            print(f"docs-check: {e}", file=sys.stderr)
        print(f"docs-check: {len(errors)} problem(s)", file=sys.stderr)
        return 1
    print(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
