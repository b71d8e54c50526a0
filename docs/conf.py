"""Sphinx configuration of the pbrl docs: markdown pages read by MyST, built with `make docs` (warnings are errors).

The pages never import pbrl: the options reference is generated into a committed page
(`python -m pbrl.config.reference > docs/reference/options.md`), so the build needs only Sphinx and MyST.
"""

project = "pbrl"
author = "pbrl maintainers"
copyright = "2026, pbrl maintainers"

extensions = ["myst_parser"]
source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store"]

# Headings down to ### get anchors (GitHub-style slugs), so `docs/design/algorithms.md#madpo` resolves here and on
# GitHub alike; tests/repo/test_docs.py checks every such reference in the code against these slugs.
myst_heading_anchors = 3
myst_enable_extensions = ["dollarmath"]  # $...$ and $$...$$ equations

html_theme = "alabaster"
html_title = "pbrl"
html_static_path: list[str] = []
