"""The package version, in a leaf module: anything in peagle that needs it imports it from here, never
from the package root (whose import registers Auto classes and hooks)."""

__version__ = "0.1.0"
