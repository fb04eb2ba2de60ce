"""The tests' shared kit: each helper once. Test modules import from here, never from each other.

Importable as ``kit`` because pytest puts ``tests/`` on ``sys.path`` (``pythonpath`` in
pyproject.toml); tools outside pytest (bench/, e2e/) insert ``<repo>/tests`` themselves.
"""
