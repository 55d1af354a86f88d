"""Commands over the whole engine (`speculate`, `schedule`, `export-hf`): the top floor, over the labs, the loaders
and the sessions they run on.

The rest of `python -m engine`'s commands live beside what they run (engine/__main__.py registers them all).
"""
