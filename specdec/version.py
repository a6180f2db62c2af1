"""The package version: a leaf module, so code anywhere in specdec can read it without importing the package."""
__version__ = "0.1.0"
