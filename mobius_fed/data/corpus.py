"""A real English corpus that ships with CPython, so demos and tests need no download."""

from __future__ import annotations


def embedded_corpus() -> str:
    """Return CPython's pydoc topic help texts (``pydoc_data.topics.topics``, ~465 kB).

    These are the language-reference sections shown by ``help("topic")``; the values are
    joined in sorted-key order, separated by blank lines, so the result is deterministic
    for a given Python version.
    """
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics))
