"""The README is the user's manual: its config reference must be the one the code defines."""

from __future__ import annotations

from conftest import REPO

from grpo_dist.cli import reference_markdown


def test_readme_config_reference_matches_the_schema():
    readme = (REPO / "README.md").read_text()
    assert reference_markdown() in readme, "README is stale: paste `grpo-dist reference --markdown` into it"


def test_readme_quick_start_is_the_two_make_commands():
    readme = (REPO / "README.md").read_text()
    assert "make demo" in readme and "make test" in readme
