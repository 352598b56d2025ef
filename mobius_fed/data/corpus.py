"""A real English corpus that ships with CPython, so demos and tests need no download."""

from __future__ import annotations


def embedded_corpus() -> str:
    """CPython's pydoc topic help texts (``pydoc_data.topics.topics``, ~465 kB): the
    language-reference sections of ``help("topic")``, joined by blank lines in sorted-key
    order, so the text is the same for a given Python version."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics))
