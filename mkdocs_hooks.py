"""Build hooks of the documentation site (`mkdocs.yml`): the configuration reference is written from the config's
own definitions at every build, so the page cannot fall behind the code."""

from __future__ import annotations

MARKER = "<!-- grpo-dist reference --markdown -->"


def on_page_markdown(markdown: str, page, config, files) -> str:
    if MARKER not in markdown:
        return markdown
    from grpo_dist.cli import reference_markdown

    return markdown.replace(MARKER, reference_markdown())
