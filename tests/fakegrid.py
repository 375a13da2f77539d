"""The in-process Grid of the tests: :class:`tools.fakegrid.FakeGrid` (importing it sets Flower's
task identity, needed to build Messages outside a Flower runtime)."""

from tools.fakegrid import FakeGrid

__all__ = ["FakeGrid"]
