"""Every alert links a runbook: a section of docs/deploying.md that exists and names the alert."""

from __future__ import annotations

import re
from urllib.parse import urlsplit

from deploy_testlib import REPO

DOC = "docs/deploying.md"


def github_anchor(heading: str) -> str:
    """The fragment GitHub (and GitLab) give a Markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def doc_sections() -> dict[str, str]:
    """anchor -> heading text, for every heading of the doc outside code blocks."""
    sections, fenced = {}, False
    for line in (REPO / DOC).read_text().splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"#{1,6}\s+(.*)", line)):
            sections[github_anchor(m.group(1))] = m.group(1).strip()
    return sections


def test_links_inside_the_doc_resolve() -> None:
    """The runbooks link each other and the doc's other sections by anchor."""
    sections = doc_sections()
    links = re.findall(r"\]\(#([^)]+)\)", (REPO / DOC).read_text())
    assert links
    missing = sorted(set(links) - set(sections))
    assert not missing, f"{DOC} links to missing sections: {missing}"


def test_every_alert_links_its_runbook(rule_groups) -> None:
    sections = doc_sections()
    alerts = [r for g in rule_groups for r in g["rules"] if "alert" in r]
    bases = set()
    for rule in alerts:
        url = rule.get("annotations", {}).get("runbook_url")
        assert url, f"{rule['alert']}: no runbook_url annotation"
        parts = urlsplit(url)
        assert parts.scheme == "https" and parts.path.endswith("/" + DOC), (
            f"{rule['alert']}: runbook_url {url} should point into {DOC}"
        )
        bases.add(url.split("#")[0])
        assert parts.fragment in sections, f"{rule['alert']}: no heading for #{parts.fragment}"
        assert sections[parts.fragment] == rule["alert"], (
            f"{rule['alert']}: #{parts.fragment} is the section {sections[parts.fragment]!r}"
        )
    # One base URL, so an operator changes the placeholder for all alerts at once.
    assert len(bases) == 1, bases
