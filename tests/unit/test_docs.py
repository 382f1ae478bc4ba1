"""The documentation pages: every setting listed, every relative link leads somewhere."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def example_keys() -> list[str]:
    """Every key of the example configuration, commented-out optional ones included."""
    text = (ROOT / "deploy" / "tes-bridge.example.toml").read_text()
    uncommented = re.sub(r"^# ?([a-z0-9_]+ = )", r"\1", text, flags=re.M)
    keys = []
    for name, value in tomllib.loads(uncommented).items():
        if isinstance(value, dict):
            keys += [f"{name}.{key}" for key in value]
        else:
            keys.append(name)
    return keys


def test_the_configuration_page_lists_every_setting_of_the_example():
    page = (ROOT / "docs" / "configuration.md").read_text()
    sections = re.split(r"^### ", page, flags=re.M)
    for key in example_keys():
        section, _, name = key.rpartition(".")
        body = next((s for s in sections if s.startswith(f"`[{section}]`")), sections[1])
        assert f"| `{name}` |" in body, f"docs/configuration.md lacks {key}"


def test_relative_links_lead_to_existing_files_and_headings():
    for page in PAGES:
        for target in re.findall(r"\]\(([^)#:]*)(#[^)]*)?\)", page.read_text()):
            path, anchor = target
            file = (page.parent / path).resolve() if path else page
            assert file.exists(), f"{page.name}: {path} does not exist"
            if anchor and file.suffix == ".md":
                headings = re.findall(r"^#+ (.*)$", file.read_text(), re.M)
                slugs = {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}
                assert anchor[1:] in slugs, f"{page.name}: no heading {anchor} in {file.name}"
