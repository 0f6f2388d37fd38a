"""Service entry points: each subpackage is a thin composition root."""
